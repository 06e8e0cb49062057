#!/usr/bin/env python
"""What handing the C heap's free pages back costs and saves on the CPU: HF GPT-2 124M, N=2,
fp32 AdamW, DDP against zerodp stages 2 and 3 as shipped and with the releases off.

    .venv/bin/python benchmarks/bench_heap_release.py --steps 7 --warmup 2

zerodp calls `hostmem.release_free_heap` after each stage-3 unit's backward and after each
stage-3 step (earlier, after every step at stages 0-2 as well: results/20261205-heap-release.md), trimming glibc's heap when
it holds at least `hostmem.STEP_RELEASE_MIN_FREE` free bytes (docs/stages.md, "Where the bytes
go at stage 3"). The `_keep` variants raise that threshold out of reach, so nothing is released.
The parent launches `torch.distributed.run
--nproc_per_node 2` once per variant, one after another with OMP_NUM_THREADS=1; a step is
timed from a barrier to the end of the optimizer step, the slowest rank counting, median
after the warm-up; peak RSS is the largest rank's VmHWM. Every variant trains the same model
on the same tokens: the final losses must agree.
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

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("ddp", "zerodp2", "zerodp2_keep", "zerodp3", "zerodp3_keep", "ddp")
NEVER = 2**62


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import zerodp
    from zerodp.memory import hostmem

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
    if args.variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        run, opt = DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-4)
        backward = lambda loss: loss.backward()  # noqa: E731
    else:
        if args.variant.endswith("_keep"):
            hostmem.STEP_RELEASE_MIN_FREE = NEVER
        stage = int(args.variant[len("zerodp")])
        units = {"unit_modules": [GPT2Block]} if stage == 3 else {}
        cfg = zerodp.Config(stage=stage, mixed_precision="fp32", **units)
        run, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=1e-4)
        backward = opt.backward
    gen = torch.Generator().manual_seed(rank)
    times, loss = [], None
    for _ in range(args.steps):
        ids = torch.randint(0, 50257, (args.micro_batch, args.seq), generator=gen)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = run(input_ids=ids, labels=ids).loss
        backward(loss)
        opt.step()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rss = torch.tensor([peak_rss()], dtype=torch.int64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"steps": slowest.tolist(), "peak_rss": int(rss), "loss": loss.item()}))
    # DDP's reducer freed after the group is destroyed deadlocks in gloo's destructor (torch 2.13).
    del run, opt, backward
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=None, help="markdown file to write the table to")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate(VARIANTS):
            result = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   __file__, "--worker", "--variant", variant, "--result", result, "--steps", str(args.steps),
                   "--micro-batch", str(args.micro_batch), "--seq", str(args.seq)]
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            r = json.loads(Path(result).read_text())
            rows.append((variant, statistics.median(r["steps"][args.warmup:]), r["peak_rss"], r["loss"]))
            print(f"{variant}: {rows[-1][1]:.3f} s, {rows[-1][2] / 2**30:.2f} GiB", file=sys.stderr)
    ddp_s = [s for v, s, _, _ in rows if v == "ddp"]
    ddp_rss = statistics.mean(m for v, _, m, _ in rows if v == "ddp")
    lines = ["# Heap release on the CPU: HF GPT-2 124M, N=2, fp32 AdamW", "",
             f"Command: `python benchmarks/bench_heap_release.py --steps {args.steps} --warmup {args.warmup}`", "",
             f"batch {args.micro_batch}x{args.seq} per rank, median of the last {args.steps - args.warmup} steps "
             f"(slowest rank), peak RSS of the largest rank; DDP ran first and last ({ddp_s[0]:.3f} / {ddp_s[-1]:.3f} s)",
             "", "| variant | step s | x DDP (first / last) | peak RSS GiB/rank | x DDP | final loss |",
             "|---|---:|---:|---:|---:|---:|"]
    for v, s, m, loss in rows:
        lines.append(f"| {v} | {s:.3f} | {s / ddp_s[0]:.2f} / {s / ddp_s[-1]:.2f} | {m / 2**30:.2f} | "
                     f"{m / ddp_rss:.2f} | {loss:.6f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
