"""The picture of a `zerodp train` run: loss curves, and model-state bytes per rank by
category next to what DDP would hold (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import matplotlib  # the optional `plot` extra: importing this module without it raises ImportError

CATEGORIES = ("params", "grads", "master", "optimizer_states")


def plot_run(path: str, summary: dict) -> None:
    """Write a two-panel PNG of `summary` (the dict `zerodp.demo.train` writes to summary.json)."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=(3, 2))
    losses = summary["losses"]
    if losses:
        ax_loss.plot([s for s, _ in losses], [v for _, v in losses], lw=1, label="train")
    val = summary["val_losses"]
    if val:
        ax_loss.plot([s for s, _ in val], [v for _, v in val], "o-", lw=1.5, ms=4, label="val")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats / byte)")
    ax_loss.set_title(f"{summary['model']}: stage {summary['stage']}, N={summary['world_size']}")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()

    bars = {f"this run\n(stage {summary['stage']})": summary["memory"], "DDP\n(stage 0)": summary["memory_ddp"]}
    labels = list(bars)
    bottom = [0.0] * len(labels)
    for cat in CATEGORIES:
        heights = [bars[lab].get(cat, 0) / 1e6 for lab in labels]
        if any(heights):
            ax_mem.bar(labels, heights, bottom=bottom, label=cat.replace("_", " "), width=0.55)
            bottom = [b + h for b, h in zip(bottom, heights)]
    ax_mem.set_ylabel("MB per rank")
    ax_mem.set_title(f"model state per rank, Ψ = {summary['numel']:,}")
    ax_mem.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
