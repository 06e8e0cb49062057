#!/usr/bin/env python
"""Soak: the demo GPT at stage 3, bf16, N=2, for many steps against DDP, watching for drift,
leaks and the cost of the per-step agreement ([Note: step fingerprint]).

    .venv/bin/python benchmarks/soak.py --steps 300

Launches `torch.distributed.run --nproc_per_node 2` twice, one after the other (DDP, then
zerodp), each with OMP_NUM_THREADS=1, on the same model (same seed) and the same per-rank
batches of the bundled corpus, AdamW(lr=1e-3). DDP runs the mixed-precision recipe zerodp
follows: a bf16 copy of the model under DDP, an fp32 master stepped by AdamW. Prints, and
writes to benchmarks/results/soak-<timestamp>.md: the largest loss difference (bf16
tolerance: 2% of the loss, about five bf16 ulps), resident memory at step 50 and at the
last step (no leak: at most 2% growth), and the median time of the step agreement against
the median step.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOSS_TOL = 0.02  # relative
RSS_GROWTH = 0.02


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zerodp
    from zerodp.demo.data import TokenBatches, load_splits
    from zerodp.demo.models import GPT, Block

    zerodp.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT("small")
    batches = TokenBatches(load_splits(), "train", args.micro_batch, 128, seed=1, rank=rank, world_size=world)
    agree_s: list[float] = []
    if args.variant == "ddp":
        compute = copy.deepcopy(model)
        for p in compute.parameters():
            p.data = p.data.to(torch.bfloat16)
        ddp = DDP(compute)
        master = list(model.parameters())
        opt = torch.optim.AdamW(master, lr=1e-3)

        def step(x, y):
            _, loss = ddp(x, y)
            loss.backward()
            for m, c in zip(master, ddp.module.parameters()):
                m.grad = c.grad.float()
            opt.step()
            opt.zero_grad()
            ddp.module.zero_grad(set_to_none=True)
            with torch.no_grad():
                for m, c in zip(master, ddp.module.parameters()):
                    c.copy_(m)
            return loss
    else:
        cfg = zerodp.Config(stage=3, mixed_precision="bf16", unit_modules=(Block,))
        zmodel, zopt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=1e-3)
        agree = zopt.comm.agree_on_step

        def timed_agree(*a, **k):  # the agreement's own time, as the step sees it
            t0 = time.perf_counter()
            try:
                return agree(*a, **k)
            finally:
                agree_s.append(time.perf_counter() - t0)
        zopt.comm.agree_on_step = timed_agree

        def step(x, y):
            _, loss = zmodel(x, y)
            zopt.backward(loss)
            zopt.step()
            zopt.zero_grad()
            return loss
    losses, rss, seconds = [], [], []
    for _ in range(args.steps):
        x, y = next(batches)
        t0 = time.perf_counter()
        loss = step(x, y)
        seconds.append(time.perf_counter() - t0)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        rss.append(rss_bytes())
    if rank == 0:
        with open(args.results, "a") as f:
            f.write(json.dumps({"variant": args.variant, "losses": losses, "rss": rss, "seconds": seconds,
                                "agree_seconds": agree_s}) + "\n")
    zerodp.shutdown_distributed()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=("ddp", "zerodp3"), help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / f"soak-{stamp}.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for variant in ("ddp", "zerodp3"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--worker", "--variant", variant, "--steps", str(args.steps), "--micro-batch", str(args.micro_batch),
               "--results", str(results)]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-5000:])
            return 1
        print(f"[soak] {variant} done in {time.time() - t0:.0f} s", flush=True)
    runs = {r["variant"]: r for r in map(json.loads, results.read_text().splitlines())}
    ddp, z = runs["ddp"], runs["zerodp3"]
    diffs = [abs(a - b) / max(1.0, abs(a)) for a, b in zip(ddp["losses"], z["losses"])]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    at = min(49, len(z["rss"]) - 1)
    growth = z["rss"][-1] / z["rss"][at] - 1.0
    step_s = statistics.median(z["seconds"][2:])
    agree_s = statistics.median(z["agree_seconds"][2:])
    lines = [f"# zerodp soak, {stamp}", "",
             f"Command: `python benchmarks/soak.py --steps {args.steps} --micro-batch {args.micro_batch}`; "
             f"GPT small, stage 3 bf16 vs DDP bf16 + fp32 master, N=2, CPU/gloo.", "",
             "| check | measured | bound | ok |", "|---|---:|---:|---|",
             f"| largest relative loss difference (step {worst}) | {diffs[worst]:.2e} | {LOSS_TOL:.0e} | "
             f"{diffs[worst] <= LOSS_TOL} |",
             f"| RSS growth, step {at + 1} to step {len(z['rss'])} (rank 0) | {growth:+.2%} | {RSS_GROWTH:+.0%} | "
             f"{growth <= RSS_GROWTH} |",
             f"| step agreement, median, share of the median step ({step_s * 1e3:.0f} ms) | "
             f"{agree_s * 1e3:.2f} ms = {agree_s / step_s:.2%} | 1% | {agree_s / step_s <= 0.01} |",
             f"| final loss DDP / zerodp | {ddp['losses'][-1]:.4f} / {z['losses'][-1]:.4f} | | |", ""]
    text = "\n".join(lines)
    print(text)
    (out_dir / f"soak-{stamp}.md").write_text(text + "\n")
    ok = diffs[worst] <= LOSS_TOL and growth <= RSS_GROWTH and agree_s / step_s <= 0.01
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
