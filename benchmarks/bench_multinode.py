#!/usr/bin/env python
"""Past one node: stage 3, each ZeRO++ part, all three, hybrid stages 2/3 and FSDP2's HSDP
on the bundled GPT at 2 nodes x 2 ranks.

    .venv/bin/python benchmarks/bench_multinode.py --model 120m --steps 6

Each variant is two torchrun launches (`--nnodes 2 --node-rank 0/1 --nproc-per-node 2`,
static rendezvous on 127.0.0.1), one after another, OMP_NUM_THREADS=1: two "nodes" that
share this machine's cores, so step times measure compute and loopback, not a network.
What crosses nodes is measured by zerodp's comm ledger (bytes per step by link); the time
those bytes would take between real nodes at 25 and 100 Gbit/s is a model, labelled as
such: inter-node bytes of one step ÷ link speed (the full tensors' bytes as the ledger
counts them, no overlap with compute). FSDP2 counts nothing: its bytes are the formula of
its HSDP schedule (all-gathers and reduce-scatter of Ψ inside the node, an all-reduce of
Ψ/n across), marked as such. Every variant trains the same model (same seed) on the same
per-rank tokens, fp32, AdamW(lr 1e-4).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (ROOT, Trainer, _loss_fn, adamw_kwargs, build_model, make_batches, make_setup_zerodp,  # noqa: E402
                   peak_rss_bytes, timed_steps, uptime)

NODES, PER_NODE = 2, 2
WARMUP = 2
ZEROPP = {
    "zerodp3": {},
    "hpz": {"hpz": True},
    "qwz": {"quantize_weights": True},
    "qgz": {"quantize_grads": "int4"},
    "zeropp": {"hpz": True, "quantize_weights": True, "quantize_grads": "int4"},
    "hybrid2": {"stage": 2, "replicate_size": "nodes"},
    "hybrid3": {"replicate_size": "nodes"},
}
VARIANTS = (*ZEROPP, "fsdp2_hsdp")
LINKS_GBIT = (25, 100)


def setup_fsdp2_hsdp(model, args) -> Trainer:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from zerodp.demo.models import Block

    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    for block in model.modules():
        if isinstance(block, Block):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs())
    psi = sum(p.numel() for p in model.parameters())

    def formula():  # not counted: HSDP's schedule, fp32
        return {"nbytes_by_link": {"intra_node": 3 * psi * 4, "inter_node": psi // PER_NODE * 4},
                "source": "formula"}
    return Trainer(_loss_fn(model), lambda loss: loss.backward(), opt.step, lambda: opt.zero_grad(set_to_none=True),
                   lambda: {"source": "none"}, formula)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = build_model(args.model)
    psi = model.num_params()
    batches = make_batches(rank, args.steps, args.micro_batch, args.seq, model.config.vocab_size)
    setup = setup_fsdp2_hsdp if args.variant == "fsdp2_hsdp" else make_setup_zerodp(
        **{"stage": 3, **ZEROPP[args.variant]})
    trainer = setup(model, args)
    del model
    losses, step_s = timed_steps(trainer, batches)
    mine = {"losses": losses, "step_s": step_s, "peak_rss": peak_rss_bytes(), "comm": trainer.comm(),
            "memory": trainer.model_state()}
    everyone = [None] * ws
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        slowest = [max(r["step_s"][i] for r in everyone) for i in range(args.steps)]
        comm = everyone[0]["comm"]
        record = {"variant": args.variant, "model": args.model, "psi": psi, "world_size": ws, "steps": args.steps,
                  "median_step_s": statistics.median(slowest[WARMUP:]),
                  "peak_rss_max": max(r["peak_rss"] for r in everyone),
                  "final_loss": statistics.fmean(r["losses"][-1] for r in everyone),
                  "by_link": comm["nbytes_by_link"], "bytes_source": comm.get("source", "ledger"),
                  "secondary_params": everyone[0]["memory"].get("secondary_params"),
                  "torch": torch.__version__}
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[bench] {args.variant}: {record['median_step_s']:.2f} s/step", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_nodes(worker_args: list[str], timeout: float, log_path: Path, program=None) -> int:
    """Two torchrun launches of `program` (default: this script's worker) with `worker_args`."""
    port = free_port()
    program = program if program is not None else [str(Path(__file__).resolve()), "--worker"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    with open(log_path, "a") as log:
        for node in range(NODES):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(node),
                   "--nproc-per-node", str(PER_NODE), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   *program, *worker_args]
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    os.killpg(q.pid, signal.SIGKILL)
                return -1
    return max(p.returncode for p in procs)


def render(records: dict, failures: dict, steps: int) -> str:
    base = records.get("zerodp3")
    lines = ["| variant | cross-node MiB/step | intra-node MiB/step | × stage 3 cross | step s (measured) "
             "| peak RSS GiB/rank | final loss | model: step s at 25 Gbit/s | at 100 Gbit/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for v in VARIANTS:
        if v in failures:
            lines.append(f"| {v} | failed: {failures[v]} |" + " |" * 7)
            continue
        r = records.get(v)
        if r is None:
            continue
        inter, intra = r["by_link"]["inter_node"], r["by_link"]["intra_node"]
        mark = " ‡" if r["bytes_source"] == "formula" else ""
        ratio = f"{inter / base['by_link']['inter_node']:.3f}" if base else "—"
        model = " | ".join(f"{r['median_step_s'] + inter * 8 / (g * 1e9):.3f} (+{inter * 8 / (g * 1e9):.3f})"
                           for g in LINKS_GBIT)
        lines.append(f"| {v} | {inter / 2**20:,.1f}{mark} | {intra / 2**20:,.1f}{mark} | {ratio} "
                     f"| {r['median_step_s']:.2f} | {r['peak_rss_max'] / 2**30:.2f} | {r['final_loss']:.6f} | {model} |")
    lines += ["", f"Bytes: one step's, from zerodp's comm ledger (‡ FSDP2: its HSDP schedule's formula, not "
              f"counted). Step time: median of the slowest rank over steps {WARMUP + 1}-{steps}, both 'nodes' "
              f"on this machine's 2 cores. Final loss: mean over ranks at step {steps}. The last two columns "
              f"are a model, not a measurement: the measured step plus (in brackets) the cross-node bytes "
              f"x 8 / link speed, as if none of that transfer overlapped compute.", ""]
    return "\n".join(lines)


def parent(args) -> None:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"multinode-{stamp}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    results, log_path = out.with_suffix(".jsonl"), out.with_suffix(".log")
    before = uptime()
    records, failures = {}, {}
    for v in args.variants:
        t0 = time.perf_counter()
        n_before = len(results.read_text().splitlines()) if results.exists() else 0
        rc = launch_two_nodes(["--variant", v, "--model", args.model, "--steps", str(args.steps), "--micro-batch",
                               str(args.micro_batch), "--seq", str(args.seq), "--results", str(results),
                               "--timeout", str(args.timeout)], args.timeout, log_path)
        lines = results.read_text().splitlines() if results.exists() else []
        if rc == 0 and len(lines) > n_before:
            records[v] = json.loads(lines[-1])
            print(f"[bench] {v} done in {time.perf_counter() - t0:.0f} s", flush=True)
        else:
            failures[v] = f"exit code {rc}, see {log_path.name}"
            print(f"[bench] {v} FAILED ({failures[v]})", flush=True)
    psi = next(iter(records.values()))["psi"] if records else 0
    text = "\n".join([f"# zerodp multi-node benchmark, {stamp}", "",
                      f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
                      f"GPT {args.model} (Ψ = {psi:,}), {NODES} nodes x {PER_NODE} ranks (two torchrun launches on "
                      f"loopback), fp32 AdamW, sequence {args.seq}, micro-batch {args.micro_batch} per rank, "
                      f"{args.steps} steps. Load before: `{before}`, after: `{uptime()}`.", "",
                      render(records, failures, args.steps)])
    out.write_text(text)
    print("\n" + text + f"\n[bench] wrote {out}")


def convergence(args) -> None:
    """The demo (`zerodp.demo.train`, its default model) for `--convergence` steps at 2 nodes
    x 2, plain stage 3 against all three ZeRO++ parts: the final validation losses."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"zeropp-convergence-{stamp}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_suffix(".log")
    rows = {}
    for name in ("zerodp3", "zeropp"):
        run = out.parent / f"{out.stem}-{name}"
        config = run.with_suffix(".json")
        config.write_text(json.dumps({"stage": 3, **ZEROPP[name]}))
        t0 = time.perf_counter()
        rc = launch_two_nodes(["--steps", str(args.convergence), "--config", str(config), "--sample-tokens", "0",
                               "--out", str(run)], args.timeout, log_path, program=["-m", "zerodp.demo.train"])
        if rc != 0:
            raise SystemExit(f"{name}: exit code {rc}, see {log_path}")
        summary = json.loads((run / "summary.json").read_text())
        rows[name] = (summary["loss"]["val_last"], summary["median_step_seconds"], time.perf_counter() - t0,
                      summary["nbytes_by_link_last_step"])
    base = rows["zerodp3"][0]
    lines = [f"# ZeRO++ convergence, {stamp}", "", f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
             "", f"The demo's default model and data, {args.convergence} steps, 2 nodes x 2 ranks (two torchrun "
             f"launches on loopback), fp32; ZeRO++ = hpZ + qwZ (int8) + qgZ (int4), block "
             f"{1024}.", "",
             "| run | final val loss | vs stage 3 | median step s | cross-node bytes/step | intra-node bytes/step |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, (val, step, _, link) in rows.items():
        lines.append(f"| {name} | {val:.4f} | {100 * (val - base) / base:+.2f}% | {step:.3f} "
                     f"| {link['inter_node']:,} | {link['intra_node']:,} |")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines) + f"\n[bench] wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="120m", choices=("20m", "120m"))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--convergence", type=int, default=0, metavar="STEPS",
                    help="instead: the demo for STEPS steps, stage 3 against ZeRO++ (final validation loss)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed the {WARMUP} warm-up steps")
    if args.worker:
        worker(args)
    elif args.convergence:
        convergence(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
