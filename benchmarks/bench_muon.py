#!/usr/bin/env python
"""AdamW against the Muon recipe (Muon for the hidden matrices, AdamW for the rest) under
zerodp stages 1-3: step time, peak RSS and communicated bytes per step, HF GPT-2 124M, N=2.

    .venv/bin/python benchmarks/bench_muon.py --steps 6 --warmup 3

The parent launches `torch.distributed.run --nproc_per_node 2` once per (stage, optimizer),
one after another with OMP_NUM_THREADS=1, so variants never share the cores. Every variant
trains the same model (same seed) on the same per-rank tokens, fp32. A step is timed from a
barrier to the end of `optimizer.step()` on each rank (all `--accumulation` micro-batches and
the step), the slowest rank counting; the table gives the median over the steps after the
warm-up, and apart the time of `optimizer.step()` alone (Muon's Newton-Schulz runs there,
once per step whatever the accumulation). Communicated bytes are the comm ledger's
for the last step (scalar agreements apart), which must be equal for both optimizers at
stages 1-2 ([Note: whole-parameter alignment] in zerodp/memory/layout.py): Muon's whole
matrices reach their owner inside the usual reduce-scatter. Alignment pads the flat buffers,
so both the padding and the ranks' owned-element imbalance are printed.

Figures are comparable only within one run on one machine: quote the ratios.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
SEED = 1234
ADAMW = dict(lr=1e-4, weight_decay=0.0)
MUON = dict(lr=0.02, momentum=0.95)  # torch's Muon defaults otherwise (Keller Jordan's recipe)


# ============================================================================ worker side
def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import zerodp

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    cfg = GPT2Config()  # 124M: 12 layers, 768 wide, tied embedding and head
    model = GPT2LMHeadModel(cfg)
    if args.optimizer == "adamw":
        optimizer = [torch.optim.AdamW(model.parameters(), **ADAMW)]
    else:
        hidden, rest = zerodp.split_hidden_matrices(model)
        optimizer = [torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)]
    zcfg = zerodp.Config(stage=args.stage, unit_modules=(GPT2Block,) if args.stage == 3 else (),
                         grad_accumulation_steps=args.accumulation)
    model, opt = zerodp.initialize(model, optimizer, zcfg)
    g = torch.Generator().manual_seed(SEED + rank)
    batches = [[torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq), generator=g)
                for _ in range(args.accumulation)] for _ in range(args.warmup + args.steps)]
    step_s, opt_step_s = [], []
    for micro in batches:
        dist.barrier()
        t0 = time.perf_counter()
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss
            opt.backward(loss)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - t0)
        opt_step_s.append(time.perf_counter() - t1)
    rep = opt.memory_report()
    comm = opt.comm.ledger.summary()
    mine = {"step_s": step_s, "opt_step_s": opt_step_s, "peak_rss": peak_rss_bytes(), "comm_nbytes": comm["nbytes"],
            "comm_numel": comm["volume_numel"], "by_op": comm["by_op"], "padded": rep.padded_numel,
            "numel": rep.numel, "alignment_padding": rep.alignment_padding, "imbalance": rep.owned_imbalance,
            "optimizer_states": rep.optimizer_states, "loss": float(loss)}
    everyone = [None] * WORLD_SIZE
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        slowest = [max(r["step_s"][i] for r in everyone) for i in range(len(step_s))]
        record = {**mine, "stage": args.stage, "optimizer": args.optimizer,
                  "median_step_s": statistics.median(slowest[args.warmup:]), "slowest": slowest,
                  "median_opt_step_s": statistics.median(
                      max(r["opt_step_s"][i] for r in everyone) for i in range(args.warmup, len(step_s))),
                  "peak_rss_max": max(r["peak_rss"] for r in everyone),
                  "optimizer_states_max": max(r["optimizer_states"] for r in everyone)}
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ parent side
def launch(args, stage: int, optimizer: str, results: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD_SIZE}",
           str(Path(__file__).resolve()), "--worker", "--stage", str(stage), "--optimizer", optimizer,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq", str(args.seq),
           "--micro-batch", str(args.micro_batch), "--accumulation", str(args.accumulation), "--results", results,
           "--timeout", str(args.timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    return "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-2000:]


def table(records: list[dict]) -> str:
    by = {(r["stage"], r["optimizer"]): r for r in records}
    lines = ["| stage | optimizer | median step (s) | x AdamW | optimizer.step (s) | peak RSS (GiB) | comm bytes/step "
             "| extra bytes vs AdamW | padded Ψ | alignment padding | owned imbalance | optimizer states/rank (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (stage, name), r in sorted(by.items()):
        base = by.get((stage, "adamw"))
        ratio = f"{r['median_step_s'] / base['median_step_s']:.2f}" if base else "—"
        extra = f"{r['comm_nbytes'] - base['comm_nbytes']:+,}" if base else "—"
        lines.append(f"| {stage} | {name} | {r['median_step_s']:.3f} | {ratio} | {r['median_opt_step_s']:.3f} "
                     f"| {r['peak_rss_max'] / 2**30:.2f} "
                     f"| {r['comm_nbytes']:,} | {extra} | {r['padded']:,} | {r['alignment_padding']:,} "
                     f"({r['alignment_padding'] / r['numel']:.2%}) | {r['imbalance']:.3f} "
                     f"| {r['optimizer_states_max'] / 2**20:,.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="muon")
    ap.add_argument("--results", default="")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=6, help="measured steps, after the warm-up")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--accumulation", type=int, default=1,
                    help="micro-batches per optimizer step (Config.grad_accumulation_steps)")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.jsonl")
        for stage in args.stages:
            for name in ("adamw", "muon"):
                err = launch(args, stage, name, results)
                print(f"[bench_muon] stage {stage} {name}: {'ok' if not err else 'FAILED'}", flush=True)
                if err:
                    print(err)
        records = [json.loads(line) for line in open(results)] if os.path.exists(results) else []
    print(f"\nHF GPT-2 124M, N={WORLD_SIZE}, fp32, seq {args.seq} x micro-batch {args.micro_batch} x "
          f"{args.accumulation} accumulated per rank and step, {args.warmup} warm-up + {args.steps} measured steps, "
          f"torchrun, OMP_NUM_THREADS=1\n")
    print(table(records))


if __name__ == "__main__":
    main()
