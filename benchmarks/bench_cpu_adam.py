#!/usr/bin/env python
"""The CPU optimizer step of an offloaded master: torch's AdamW implementations on this
machine, against its memory bandwidth.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_cpu_adam.py --numel 50e6

Steps the same fp32 master (split into `bucket_bytes` pieces, as zerodp steps it) with
AdamW for-loop (`foreach=False`), `foreach=True` and `fused=True`, median of several steps
each, and checks which give the for-loop's result bit for bit. Throughput is counted as
the bytes AdamW must move per element: read param, grad, exp_avg, exp_avg_sq (16 bytes) and
write param, exp_avg, exp_avg_sq (12 bytes). Memory bandwidth: the median of large
`copy_`s (read + write), the same threads.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

BYTES_PER_ELEMENT = 28


def bandwidth_gbs(numel: int, repeats: int = 5) -> float:
    a, b = torch.ones(numel), torch.empty(numel)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 2 * numel * 4 / statistics.median(times) / 1e9


def run(kind: str, numel: int, piece: int, steps: int) -> tuple[float, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(min(piece, numel - at), generator=gen).requires_grad_() for at in range(0, numel, piece)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    flags = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **flags)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), [p.detach() for p in params]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=50e6, help="master elements (fp32)")
    ap.add_argument("--bucket-bytes", type=int, default=25 * 2**20)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    numel, piece = int(args.numel), args.bucket_bytes // 4
    bw = bandwidth_gbs(numel)
    print(f"AdamW on {numel:,} fp32 elements in pieces of {piece:,}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; memory bandwidth (copy_) {bw:.1f} GB/s\n")
    print("| implementation | median step s | GB/s of optimizer state | × memory bandwidth | same bits as for-loop |")
    print("|---|---:|---:|---:|---|")
    reference = None
    for kind in ("loop", "foreach", "fused"):
        seconds, result = run(kind, numel, piece, args.steps)
        if reference is None:
            reference = result
        same = all(torch.equal(a, b) for a, b in zip(result, reference))
        gbs = numel * BYTES_PER_ELEMENT / seconds / 1e9
        print(f"| {kind} | {seconds:.3f} | {gbs:.2f} | {gbs / bw:.2f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
