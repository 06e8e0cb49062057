#!/usr/bin/env python
"""What the sync points ([Note: sync points] in distributed/sync_points.py) cost a training
step: a small model, N=2, gloo over torchrun's TCPStore, stages 1 and 3, with the points on
and off in alternating blocks of steps on the same warm model.

    .venv/bin/python benchmarks/bench_sync_points.py --steps 40 --blocks 6

The parent launches `torch.distributed.run --nproc_per_node 2` with OMP_NUM_THREADS=1. A
step (forward, backward, step, zero_grad) is timed on each rank from a barrier to its end,
the slower rank counting; per stage it prints the median step with the points on and off,
their difference, the time spent inside the points themselves (store round trips and
waiting for the slower rank, which the collective after a point would wait for anyway), and
the cost of one point when nothing else runs (`--bare` points in a row on both ranks).
Turning the points off on both ranks at a block boundary keeps their numbering aligned.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import zerodp
    from zerodp.distributed.sync_points import SyncPoints

    zerodp.init_distributed()
    rank = dist.get_rank()
    spent = [0.0]
    arrive = SyncPoints._arrive

    def timed_arrive(self, *a, **kw):
        start = time.perf_counter()
        try:
            return arrive(self, *a, **kw)
        finally:
            spent[0] += time.perf_counter() - start
    SyncPoints._arrive = timed_arrive
    out = {}
    for stage in (1, 3):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.depth)])
        cfg = zerodp.Config(stage=stage, unit_modules=(nn.Sequential,) if stage == 3 else ())
        model, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=1e-4)
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))

        def step():
            opt.backward(model(x).square().mean())
            opt.step()
            opt.zero_grad()
        for _ in range(5):
            step()
        times = {True: [], False: []}
        inside = {True: 0.0, False: 0.0}
        points = opt.comm.sync_points
        before = points.point
        for block in range(2 * args.blocks):
            on = block % 2 == 0
            points.enabled = on
            spent[0] = 0.0
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                step()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[on].append(float(elapsed))
            inside[on] += spent[0]
        points.enabled = True
        per_step = (points.point - before) / (args.blocks * args.steps)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.bare):
            points.before_training("a bare point")
        bare = (time.perf_counter() - start) / args.bare
        out[stage] = {"bare_ms": 1e3 * bare, "on_ms": 1e3 * statistics.median(times[True]), "off_ms": 1e3 * statistics.median(times[False]),
                      "inside_ms": 1e3 * inside[True] / (args.blocks * args.steps),
                      "points_per_step": per_step}
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    zerodp.shutdown_distributed()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bare", type=int, default=2000, help="points in a row, nothing between them")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
           __file__, "--worker", *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or not lines:
        sys.exit(f"the workers failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    params = args.depth * (args.width * args.width + args.width)
    print(f"{params:,} parameters ({args.depth} x Linear({args.width}, {args.width})), batch {args.batch}, N=2, gloo")
    for stage, r in json.loads(lines[0][len("RESULT "):]).items():
        print(f"stage {stage}: step {r['off_ms']:.2f} ms without the points, {r['on_ms']:.2f} ms with them "
              f"({r['on_ms'] - r['off_ms']:+.2f} ms); {r['points_per_step']:.0f} points a step, "
              f"{r['inside_ms']:.3f} ms a step inside them (waits for the slower rank included); "
              f"one point alone, both ranks arriving together: {r['bare_ms']:.3f} ms")


if __name__ == "__main__":
    main()
