"""torch.compile with data parallelism: eager and compiled DDP, FSDP2 with per-block compile,
zerodp stage 3 eager and with Config(compile_units=True); one table (docs/compile.md).

    python benchmarks/bench_compile.py --model gpt2 --steps 8
    python benchmarks/bench_compile.py --model gpt --layers 4 --embd 256 --vocab 8192

Each variant runs under its own torchrun (2 ranks, CPU/gloo, OMP_NUM_THREADS=1): step time
is the median after `--warmup` steps, the first step's time is reported apart (it includes
compiling), and peak RSS is the rank's VmHWM. Every variant trains the same weights on the
same batches with AdamW.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("ddp_eager", "ddp_compiled", "fsdp2_compiled", "zerodp3_eager", "zerodp3_compiled")
WORLD = 2


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build(args):
    """(model, block class, vocabulary): HF GPT-2 or the bundled GPT, 124M by default."""
    import torch

    torch.manual_seed(0)
    if args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        cfg = GPT2Config(n_layer=args.layers or 12, n_embd=args.embd or 768, n_head=args.heads or 12,
                         vocab_size=args.vocab or 50257, n_positions=max(args.seq, 128),
                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                         # A training run needs no KV cache; with one, per-block compile (FSDP2's
                         # too) makes a graph per block (docs/compile.md).
                         use_cache=False)
        return GPT2LMHeadModel(cfg), GPT2Block, cfg.vocab_size
    from zerodp.demo.models import GPT, Block, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab or 50304, block_size=max(args.seq, 128), n_layer=args.layers or 12,
                    n_head=args.heads or 12, n_embd=args.embd or 768)
    return GPT(cfg), Block, cfg.vocab_size


def loss_of(args, model, ids):
    if args.model == "gpt2":
        return model(input_ids=ids, labels=ids).loss
    return model(ids, ids)[1]


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zerodp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, block, vocab = build(args)
    blocks = [m for m in model.modules() if isinstance(m, block)]
    v = args.variant
    if v.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        run = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if v == "ddp_compiled":
            run = torch.compile(run)
        backward = lambda loss: loss.backward()  # noqa: E731
    elif v == "fsdp2_compiled":
        from torch.distributed.fsdp import fully_shard

        for b in blocks:  # torchtitan's order: compile each block, then shard it
            b.compile()
            fully_shard(b)
        fully_shard(model)
        run, opt = model, torch.optim.AdamW(model.parameters(), lr=1e-4)
        backward = lambda loss: loss.backward()  # noqa: E731
    else:
        cfg = zerodp.Config(stage=3, unit_modules=(block,), compile_units=v == "zerodp3_compiled")
        run, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=1e-4)
        backward = opt.backward
    times, losses = [], []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = loss_of(args, run, ids)
        backward(loss)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    rss = torch.tensor([peak_rss_bytes()], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"variant": v, "first_s": times[0], "step_s": statistics.median(times[args.warmup:]),
                       "peak_rss": float(rss), "losses": losses,
                       "params": sum(p.numel() for p in model.parameters())}, f)
    dist.destroy_process_group()


def run_variant(args, variant: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "r.json"
        argv = [a for a in sys.argv[1:]]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}", "--master-port",
               str(29600 + VARIANTS.index(variant)), __file__, *argv, "--worker", "--variant", variant,
               "--result", str(result)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0 or not result.exists():
            # The whole output is kept: its end is torchrun's summary, the cause is above it.
            log = Path(tempfile.gettempdir()) / f"bench_compile-{variant}-{os.getpid()}.log"
            log.write_text(proc.stdout + proc.stderr)
            return {"variant": variant, "error": f"(whole output: {log}) " + (proc.stdout + proc.stderr)[-2000:]}
        return json.loads(result.read_text())


def render(args, rows: list[dict]) -> str:
    base = {r["variant"]: r for r in rows if "error" not in r}
    ddp = base.get("ddp_eager")
    params = next((r["params"] for r in rows if "params" in r), 0)
    lines = [f"{args.model} ({params / 1e6:.1f}M parameters), N={WORLD} CPU/gloo, OMP_NUM_THREADS=1, AdamW, "
             f"batch {args.micro_batch}x{args.seq} per rank, {args.steps} steps, median of the last "
             f"{args.steps - args.warmup}", "",
             "| variant | step s | x DDP eager | x DDP compiled | peak RSS GiB/rank | first step s (compile) | "
             "final loss |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed | | | | | |")
            continue
        ratio = lambda ref: f"{r['step_s'] / ref['step_s']:.2f}" if ref else "—"  # noqa: E731
        lines.append(f"| {r['variant']} | {r['step_s']:.3f} | {ratio(ddp)} | {ratio(base.get('ddp_compiled'))} | "
                     f"{r['peak_rss'] / 2**30:.2f} | {r['first_s']:.1f} | {r['losses'][-1]:.6f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt2", "gpt"), default="gpt2",
                    help="Hugging Face GPT-2 or the bundled GPT (124M / 120m by default)")
    ap.add_argument("--layers", type=int, default=0, help="override the block count (0: the 124M model's)")
    ap.add_argument("--embd", type=int, default=0, help="override the width")
    ap.add_argument("--heads", type=int, default=0, help="override the head count")
    ap.add_argument("--vocab", type=int, default=0, help="override the vocabulary")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median (the first compiles)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=None, help="markdown file to write the table to")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for v in args.variants:
        rows.append(run_variant(args, v))
        print(v, {k: rows[-1].get(k) for k in ("step_s", "first_s", "peak_rss")} if "error" not in rows[-1]
              else rows[-1]["error"], flush=True)
    table = render(args, rows)
    print(table)
    if args.out:
        command = "python benchmarks/bench_compile.py " + " ".join(a for a in sys.argv[1:] if not a.startswith("--out")
                                                                   and a != args.out)
        Path(args.out).write_text(f"# torch.compile, N={WORLD}\n\nCommand: `{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
