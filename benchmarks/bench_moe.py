#!/usr/bin/env python
"""Expert parallelism beside ZeRO on an MoE GPT at world size 4: DDP, FSDP2 (the expert banks
gathered like any weight), zerodp stage 3 without expert parallelism, and with EP=2 and EP=4.

    .venv/bin/python benchmarks/bench_moe.py --steps 8 --repeat 3

The model: Hugging Face's Mixtral decoder (a GPT with MoE feed-forward layers) of 4 layers,
hidden 128, 8 experts of intermediate size 512 each, top-2 routing, the load-balancing loss on;
its expert banks are 95% of its parameters. One torchrun launch of 4 processes per variant,
one after another, OMP_NUM_THREADS=1, the same seed and fp32 AdamW(lr 1e-4), each rank its
own batch of `--batch` sequences of `--seq` tokens per step (the same tokens in every
variant). The variants run `--repeat` times, in turn, the order reversed every other round,
so that each round's launches meet about the same load on a shared machine; a ratio is the
median over the rounds of the ratio within a round (its range beside it). Reported per
variant: the median step time (slowest rank, after the warm-up steps; the median over the
rounds), the peak RSS of the largest rank,
and the bytes a rank sends per step: zerodp's from its comm ledger (by op: the all-gathers
and reduce-scatters of the units, the all-to-alls of the token dispatch), DDP's and FSDP2's
by the same count from their parameters (DDP's all-reduce 2Ψ, FSDP2's two gathers and one
reduce-scatter 3Ψ, 4 bytes an element; ZeRO, arXiv 1910.02054, §7).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import ROOT, peak_rss_bytes, run_variant, uptime  # noqa: E402

WORLD = 4
WARMUP = 2
VARIANTS = ("ddp", "fsdp2", "zerodp_s3", "zerodp_s3_ep2", "zerodp_s3_ep4")
VOCAB, HIDDEN, EXPERT_HIDDEN, EXPERTS, TOP_K, LAYERS = 512, 128, 512, 8, 2, 4


def build():
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=EXPERT_HIDDEN,
                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=512,
                        output_router_logits=True, tie_word_embeddings=False)
    model = MixtralForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zerodp

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    psi = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    ledger = None
    if args.variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sent = 2 * psi * 4
    elif args.variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        sent = 3 * psi * 4
    else:
        ep = int(args.variant.rsplit("ep", 1)[1]) if "_ep" in args.variant else 1
        cfg = zerodp.Config(stage=3, expert_parallel_size=ep)
        model, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=1e-4)
        ledger, sent = opt.comm.ledger, None
    step_s, losses = [], []
    for step in range(WARMUP + args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
        dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= WARMUP:
            step_s.append(float(elapsed))
        losses.append(float(loss.detach()))
    by_op = {}
    if ledger is not None:  # the last step's collectives, this rank's
        summary = ledger.summary()
        sent = sum(r.nbytes for r in ledger.last_step if r.phase in ("forward", "backward", "step"))
        for r in ledger.last_step:
            if r.phase in ("forward", "backward", "step"):
                by_op[r.op] = by_op.get(r.op, 0) + r.nbytes
        by_op["calls"] = summary["calls"]
    mine = {"rank": rank, "peak_rss": peak_rss_bytes(), "sent": sent, "by_op": by_op}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        record = {"variant": args.variant, "psi": psi, "expert_fraction": experts / psi,
                  "median_step_s": statistics.median(step_s), "peak_rss_max": max(r["peak_rss"] for r in everyone),
                  "sent_max": max(r["sent"] for r in everyone), "by_op": everyone[0]["by_op"],
                  "final_loss": losses[-1], "batch": args.batch, "seq": args.seq, "steps": args.steps}
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[bench_moe] {args.variant}: {record['median_step_s']:.3f} s/step, peak RSS "
              f"{record['peak_rss_max'] / 2**20:.0f} MiB, {record['sent_max'] / 2**20:.1f} MiB sent per step")
    dist.barrier()
    dist.destroy_process_group()


def paired(runs: list, base: list, key: str) -> str:
    """The median over the rounds of runs[i][key] / base[i][key], and its range: "—" without
    a round both finished."""
    ratios = sorted(a[key] / b[key] for a, b in zip(runs, base) if a is not None and b is not None and b[key])
    if not ratios:
        return "—"
    mid = f"{statistics.median(ratios):.2f}"
    return mid if len(ratios) == 1 else f"{mid} ({ratios[0]:.2f}–{ratios[-1]:.2f})"


def render(rounds: dict, failures: dict, variants) -> str:
    """`rounds`: variant -> its record in each round (None where it failed)."""
    s3, fsdp2 = rounds.get("zerodp_s3", []), rounds.get("fsdp2", [])
    any_record = next((r for runs in rounds.values() for r in runs if r is not None), None)
    lines = []
    if any_record:
        lines.append(f"Ψ = {any_record['psi']:,} parameters, experts {any_record['expert_fraction']:.1%} of them; "
                     f"{WORLD} ranks, {any_record['batch']} x {any_record['seq']} tokens per rank per step, "
                     f"{any_record['steps']} steps after {WARMUP} of warm-up, {len(s3) or 1} round(s)")
    lines += ["", "| variant | median step s | × stage 3 | × FSDP2 | peak RSS MiB/rank | × stage 3 "
                  "| MiB sent/rank/step | × stage 3 | of which all-to-all MiB |",
              "|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        runs = rounds.get(v, [])
        done = [r for r in runs if r is not None]
        if not done:
            lines.append(f"| {v} | failed: {failures.get(v, '?')} | | | | | | | |")
            continue
        r = done[0]
        a2a = r["by_op"].get("all_to_all")
        step_s = statistics.median(x["median_step_s"] for x in done)
        rss = max(x["peak_rss_max"] for x in done)
        lines.append(f"| {v} | {step_s:.3f} | {paired(runs, s3, 'median_step_s')} "
                     f"| {paired(runs, fsdp2, 'median_step_s')} "
                     f"| {rss / 2**20:.0f} | {paired(runs, s3, 'peak_rss_max')} "
                     f"| {r['sent_max'] / 2**20:.1f} | {paired(runs, s3, 'sent_max')} "
                     f"| {'' if a2a is None else f'{a2a / 2**20:.2f}'} |")
    lines += ["", "DDP's and FSDP2's bytes are their count (2Ψ, 3Ψ x 4 bytes), zerodp's its ledger's for the "
                  "last step (largest rank). Ratios: the median over the rounds of the ratio within a round, "
                  "its range in brackets; peak RSS the largest over the rounds."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every variant, in alternating order")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "moe.md"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        # The record is written and the group destroyed: skip the interpreter's teardown, where
        # a gloo worker thread's destructor can abort the process after a good run (torch's
        # exit race, pytorch #190489; seen on FSDP2's variant), which would drop its record.
        sys.stdout.flush()
        os._exit(0)
    import bench

    bench.WORLD_SIZE = WORLD
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = out.with_suffix(".jsonl")
    results.write_text("")
    log = out.with_suffix(".log")
    log.write_text(f"{uptime()}\n")
    rounds, failures = {v: [] for v in args.variants}, {}
    for i in range(args.repeat):
        for v in (args.variants if i % 2 == 0 else reversed(args.variants)):
            worker_args = ["--variant", v, "--steps", str(args.steps), "--batch", str(args.batch), "--seq",
                           str(args.seq), "--timeout", str(args.timeout), "--results", str(results)]
            rec, err = run_variant(Path(__file__).resolve(), worker_args, args.timeout, results, log)
            rounds[v].append(rec)
            if rec is None:
                failures[v] = err
                print(f"[bench_moe] {v} failed: {err}")
        with open(log, "a") as f:
            f.write(f"round {i + 1} done: {uptime()}\n")
    table = render(rounds, failures, args.variants)
    started = log.read_text().splitlines()[0]
    out.write_text(f"# bench_moe\n\n`{' '.join(sys.argv)}` (began: {started}; ended: {uptime()})\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
