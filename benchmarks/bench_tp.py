#!/usr/bin/env python
"""ZeRO with tensor parallelism and ZeRO-R's partitioned activation checkpoints (Pa, Pa+cpu)
on the bundled GPT at world size 4.

    .venv/bin/python benchmarks/bench_tp.py --model 120m --seq 512 --steps 5

One torchrun launch of 4 processes per variant, one after another, OMP_NUM_THREADS=1, each
training the same model (same seed) with every block checkpointed (`GPT.gradient_checkpointing_enable`,
non-reentrant), fp32 AdamW(lr 1e-4), the same global batch of `--global-batch` sequences per
step (split over the data-parallel ranks; the tensor-parallel ranks of one data-parallel rank
see the same sequences). Variants: DP x TP = 2 x 2 with no Pa, Pa and Pa+cpu; 4 x 1 with
checkpoints on the device and in host memory (at TP 1 there is nothing to partition, so Pa is
refused and Pa+cpu is the host copy alone). Reported per variant: the median
step time (slowest rank, after the warm-up steps), the peak RSS of the largest rank, the
activation checkpoints a rank holds at most (the memory ledger's, measured from the store's
tensors), the bytes Pa's all-gathers and the tensor-parallel collectives move per step (the
comm ledger's), and the final loss. `2x2_split` keeps the LM head's logits split over the
vocabulary and computes the loss on them (`zerodp.tensor_parallel.keep_logits_split`). With
`--checkpoint-dir`, each variant's trained state is saved and loaded back, timed. Then the paper's §6.1 figure from `zerodp estimate`.
On CPU "host" is the same memory as "device": Pa+cpu's copies happen (the code path a GPU run
takes) but free nothing; its row shows their cost.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import ROOT, build_model, make_batches, peak_rss_bytes, uptime  # noqa: E402

WORLD = 4
WARMUP = 2
LAYOUTS = {"2x2": 2, "4x1": 1}  # name -> tensor-parallel size
PA = {"none": {}, "pa": {"partition_activations": True},
      "pa_cpu": {"partition_activations": True, "activations_on_host": True},
      "cpu": {"activations_on_host": True},  # at TP 1 there is nothing to partition: Pa+cpu is "cpu"
      "split": {}}  # no Pa; the LM head's logits kept split, the loss on the pieces (keep_logits_split)
VARIANTS = ("2x2_none", "2x2_split", "2x2_pa", "2x2_pa_cpu", "4x1_none", "4x1_cpu")


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zerodp

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    layout, pa = args.variant.split("_", 1)
    tp = LAYOUTS[layout]
    dp, dp_rank = WORLD // tp, rank // tp
    model = build_model(args.model)
    model.gradient_checkpointing_enable()
    cfg = zerodp.Config(stage=args.stage, tensor_parallel_size=tp, unit_modules=["Block"] if args.stage == 3 else [],
                        **PA[pa])
    model, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=1e-4)
    if pa == "split":
        zerodp.tensor_parallel.keep_logits_split(model)
    # Every data-parallel rank takes its part of one global batch (the same for every variant).
    batches = make_batches(0, args.steps, args.global_batch, args.seq, model.config.vocab_size)
    per = args.global_batch // dp
    losses, step_s, comm = [], [], None
    for x, y in batches:
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, y)[1]
        opt.backward(loss)
        records = list(opt.comm.ledger.current)
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
        comm = {"pa_gather": sum(r.nbytes for r in records if r.label == "activation checkpoint"),
                "tp": sum(r.nbytes for r in records if r.axis == "tp" and r.label.startswith("tensor parallel")),
                "zero": sum(r.nbytes for r in records if r.axis != "tp" and r.phase in ("forward", "backward"))}
    report = opt.memory_report()
    peak = peak_rss_bytes()  # before the checkpoint's copies
    ckpt = None
    if args.checkpoint_dir:  # the trained state saved, then loaded back: each timed from a barrier to a barrier
        path = os.path.join(args.checkpoint_dir, args.variant)
        dist.barrier()
        t0 = time.perf_counter()
        zerodp.save(path, model, opt)
        dist.barrier()
        t1 = time.perf_counter()
        zerodp.load(path, model, opt)
        dist.barrier()
        t2 = time.perf_counter()
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        ckpt = {"save_s": t1 - t0, "load_s": t2 - t1, "bytes": size}
    mine = {"step_s": step_s, "losses": losses, "peak_rss": peak, "comm": comm,
            "act_peak": report.activation_checkpoints_peak, "model_state": report.model_state, "ckpt": ckpt}
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        slowest = [max(r["step_s"][i] for r in everyone) for i in range(args.steps)]
        record = {"variant": args.variant, "tp": tp, "dp": dp, "median_step_s": statistics.median(slowest[WARMUP:]),
                  "peak_rss": max(r["peak_rss"] for r in everyone), "act_peak": max(r["act_peak"] for r in everyone),
                  "model_state": max(r["model_state"] for r in everyone), "comm": everyone[0]["comm"],
                  "final_loss": statistics.fmean(everyone[d * tp]["losses"][-1] for d in range(dp)),
                  "ckpt": everyone[0]["ckpt"],
                  "loss_comm": sum(r.nbytes for r in records if r.label == "vocab-parallel loss")}
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[bench_tp] {args.variant}: {record['median_step_s']:.2f} s/step", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def launch(args, variant: str, results: Path, log: Path) -> str | None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           str(Path(__file__).resolve()), "--worker", "--variant", variant, "--model", args.model,
           "--seq", str(args.seq), "--steps", str(args.steps), "--global-batch", str(args.global_batch),
           "--stage", str(args.stage), "--results", str(results), "--timeout", str(args.timeout)]
    if args.checkpoint_dir:
        cmd += ["--checkpoint-dir", args.checkpoint_dir]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            return f"timed out after {args.timeout:.0f} s"
    return None if rc == 0 else f"exit code {rc} (see {log})"


def table(records: dict, failures: dict) -> str:
    base = records.get("2x2_none")
    rows = ["| variant | DP x TP | step s | x 2x2 no Pa | peak RSS GiB/rank | activation checkpoints/rank (peak) | "
            "Pa all-gather MiB/step | TP collectives MiB/step | ZeRO MiB/step | final loss | save s | load s | "
            "checkpoint MiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v in VARIANTS:
        if v in failures:
            rows.append(f"| {v} | — | failed: {failures[v]} | | | | | | | |")
            continue
        if v not in records:
            continue
        r = records[v]
        ratio = f"{r['median_step_s'] / base['median_step_s']:.2f}" if base else "—"
        held = f"{r['act_peak'] / 2**20:.2f} MiB" if r["act_peak"] else "— (not kept by the store)"
        rows.append(f"| {v} | {r['dp']} x {r['tp']} | {r['median_step_s']:.2f} | {ratio} | "
                    f"{r['peak_rss'] / 2**30:.2f} | "
                    f"{held} | "
                    f"{r['comm']['pa_gather'] / 2**20:.2f} | {r['comm']['tp'] / 2**20:.1f} | "
                    f"{r['comm']['zero'] / 2**20:.1f} | {r['final_loss']:.6f} | " + (
                        f"{r['ckpt']['save_s']:.2f} | {r['ckpt']['load_s']:.2f} | {r['ckpt']['bytes'] / 2**20:.1f} |"
                        if r.get("ckpt") else "— | — | — |"))
    return "\n".join(rows)


def parent(args) -> None:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = ROOT / "benchmarks" / "results" / f"tp-{stamp}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    results, log = out.with_suffix(".jsonl"), out.with_suffix(".log")
    load_before = uptime()
    records, failures = {}, {}
    for variant in args.variants:
        t0 = time.perf_counter()
        before = len(results.read_text().splitlines()) if results.exists() else 0
        err = launch(args, variant, results, log)
        lines = results.read_text().splitlines() if results.exists() else []
        if err is None and len(lines) > before:
            records[variant] = json.loads(lines[-1])
            print(f"[bench_tp] {variant} done in {time.perf_counter() - t0:.0f} s", flush=True)
        else:
            failures[variant] = err or "no result"
            print(f"[bench_tp] {variant} FAILED: {failures[variant]}", flush=True)
    paper = [sys.executable, "-m", "zerodp", "estimate", "--params", "100e9", "--tp-size", "16",
             "--world-sizes", "1", "--layers", "125", "--hidden", "8192", "--seq-len", "1024", "--batch-size", "32",
             "--partition-activations"]
    estimate = subprocess.run(paper, capture_output=True, text=True).stdout.strip()
    text = "\n".join([
        f"# zerodp tensor parallelism + Pa, {stamp}", "",
        f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
        f"GPT {args.model}, world {WORLD} on CPU/gloo, OMP_NUM_THREADS=1, stage {args.stage}, fp32 AdamW, sequence "
        f"{args.seq}, global batch {args.global_batch}, every block checkpointed (non-reentrant), {args.steps} steps "
        f"({WARMUP} warm-up).", "", f"Load before: `{load_before}`  ", f"Load after: `{uptime()}`", "",
        table(records, failures), "", "The paper's §6.1 case from the estimator (`" + " ".join(paper[3:]) + "`):",
        "", "```", estimate, "```", ""])
    out.write_text(text)
    print("\n" + text)
    print(f"[bench_tp] wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="120m")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5, help=f"training steps; the first {WARMUP} are warm-up")
    ap.add_argument("--global-batch", type=int, default=4, help="sequences per step, over all data-parallel ranks")
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--checkpoint-dir", help="after training, time zerodp.save and zerodp.load of the state "
                                             "into <dir>/<variant> (slowest rank: barrier to barrier)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps <= WARMUP:
        ap.error(f"--steps must be more than the {WARMUP} warm-up steps")
    worker(args) if args.worker else parent(args)


if __name__ == "__main__":
    main()
