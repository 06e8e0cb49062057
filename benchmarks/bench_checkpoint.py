#!/usr/bin/env python
"""Checkpoint save/load time and size: zerodp (stages 2 and 3) against torch DCP for FSDP2.

    .venv/bin/python benchmarks/bench_checkpoint.py            # the ~124M GPT, world size 2, CPU/gloo

Like bench.py, the parent launches `torch.distributed.run --nproc_per_node 2` once per
variant, sequentially, with a timeout and OMP_NUM_THREADS=1. Each worker trains one step
(so AdamW has its states), then saves `--repeats` checkpoints and loads them back:

  zerodp2, zerodp3  zerodp.save(path, model, opt) / zerodp.load(path, model, opt)
  fsdp2_dcp         fully_shard per Block, then root; get_state_dict(model, opt) ->
                    torch.distributed.checkpoint.save; get_state_dict -> dcp.load ->
                    set_state_dict (torch.distributed.checkpoint.state_dict)

A save or load is timed from a barrier to a barrier (so it is the slowest rank's). Bytes on
disk are the files' sizes in one checkpoint directory. Peak RSS is VmHWM, reset before
each timed phase. The round-trip check: the loss on a held-out batch right after loading
must equal the loss at save time, and one more training step from the loaded state must
reproduce the step taken from the saved state (parameters and optimizer states restored).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bench  # benchmarks/bench.py: model, data, optimizer settings and the launcher

VARIANTS = ("zerodp2", "zerodp3", "fsdp2_dcp")


# ============================================================================ worker side
def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def setup(variant: str, model):
    """(model, optimizer, backward, save(path), load(path)) for one variant."""
    import torch

    if variant.startswith("zerodp"):
        import zerodp
        from zerodp.demo.models import Block

        stage = int(variant[-1])
        cfg = zerodp.Config(stage=stage, mixed_precision="fp32", unit_modules=[Block] if stage == 3 else [])
        model, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, **bench.adamw_kwargs())
        return (model, opt, opt.backward, lambda path: zerodp.save(path, model, opt),
                lambda path: zerodp.load(path, model, opt))

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from zerodp.demo.models import Block

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model.modules():
        if isinstance(m, Block):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **bench.adamw_kwargs())

    def save(path):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def load(path):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    return model, opt, lambda loss: loss.backward(), save, load


def dir_nbytes(path: str) -> tuple[int, int]:
    """(bytes, files) of the regular files under `path`."""
    total = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            total += os.path.getsize(os.path.join(root, n))
            files += 1
    return total, files


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = bench.build_model(args.model)
    psi = model.num_params()
    batches = bench.make_batches(rank, 3, args.micro_batch, args.seq, model.config.vocab_size)
    model, opt, backward, save, load = setup(args.variant, model)

    def train_step(x, y):
        opt.zero_grad()
        backward(model(x, y)[1])
        opt.step()

    @torch.no_grad()
    def held_out_loss() -> float:
        x, y = batches[2]
        return model(x, y)[1].item()

    def timed(fn) -> tuple[float, int]:
        """Seconds (barrier to barrier) and this rank's peak RSS while `fn` ran."""
        reset_peak_rss()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0, bench.peak_rss_bytes()

    train_step(*batches[0])
    at_save = held_out_loss()
    paths = [os.path.join(args.dir, f"{args.variant}-{i}") for i in range(args.repeats)]
    saves = [timed(lambda p=p: save(p)) for p in paths]
    nbytes, nfiles = dir_nbytes(paths[0]) if rank == 0 else (0, 0)
    train_step(*batches[1])
    after_step = held_out_loss()
    loads = [timed(lambda p=p: load(p)) for p in paths]
    after_load = held_out_loss()
    train_step(*batches[1])
    after_replayed_step = held_out_loss()

    mine = {"rank": rank, "save_s": [s for s, _ in saves], "load_s": [s for s, _ in loads],
            "save_peak_rss": max(r for _, r in saves), "load_peak_rss": max(r for _, r in loads),
            "losses": {"at_save": at_save, "after_step": after_step, "after_load": after_load,
                       "after_replayed_step": after_replayed_step}}
    everyone = [None] * ws
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        ok = all(r["losses"]["after_load"] == r["losses"]["at_save"]
                 and r["losses"]["after_replayed_step"] == r["losses"]["after_step"]
                 and r["losses"]["after_step"] != r["losses"]["at_save"] for r in everyone)
        record = {"variant": args.variant, "model": args.model, "psi": psi, "world_size": ws,
                  "repeats": args.repeats, "nbytes": nbytes, "files": nfiles,
                  "save_s": statistics.median(max(r["save_s"][i] for r in everyone) for i in range(args.repeats)),
                  "load_s": statistics.median(max(r["load_s"][i] for r in everyone) for i in range(args.repeats)),
                  "save_peak_rss": max(r["save_peak_rss"] for r in everyone),
                  "load_peak_rss": max(r["load_peak_rss"] for r in everyone),
                  "round_trip_ok": ok, "torch": torch.__version__, "ranks": everyone}
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[bench_checkpoint] {args.variant}: save {record['save_s']:.2f} s, load {record['load_s']:.2f} s, "
              f"{nbytes / 2**20:.1f} MiB, round trip {'ok' if ok else 'MISMATCH'}", flush=True)
    dist.barrier()
    if rank == 0:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
    dist.destroy_process_group()


# ============================================================================ parent side
def render_table(model: str, records: dict, failures: dict) -> str:
    psi = next(iter(records.values()))["psi"] if records else None
    lines = [f"### GPT {model}" + (f" (Ψ = {psi:,} parameters, N = {bench.WORLD_SIZE})" if psi else ""), "",
             "| variant | save s | load s | bytes on disk | files | bytes ÷ 12Ψ | peak RSS GiB/rank save | "
             "peak RSS GiB/rank load | round trip |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for variant in VARIANTS:
        if variant in failures:
            lines.append(f"| {variant} | failed: {failures[variant]} |" + " |" * 7)
            continue
        r = records.get(variant)
        if r is None:
            continue
        lines.append(f"| {variant} | {r['save_s']:.2f} | {r['load_s']:.2f} | {r['nbytes'] / 2**20:,.1f} MiB "
                     f"| {r['files']} | {r['nbytes'] / (12 * r['psi']):.3f} | {r['save_peak_rss'] / 2**30:.2f} "
                     f"| {r['load_peak_rss'] / 2**30:.2f} | {'exact' if r['round_trip_ok'] else 'MISMATCH'} |")
    lines += ["", "Save/load: median over the repeats of the slowest rank, barrier to barrier. 12Ψ bytes = fp32 "
              "parameters + AdamW exp_avg and exp_avg_sq, the least a resumable checkpoint holds. Peak RSS: "
              "VmHWM reset before each save/load, largest rank. Round trip: held-out loss after load equals the "
              "loss at save, and a step from the loaded state reproduces the step from the saved one, bitwise.",
              ""]
    return "\n".join(lines)


def parent(args) -> None:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else bench.ROOT / "benchmarks" / "results" / f"checkpoint-{stamp}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    results, log_path = out.with_suffix(".jsonl"), out.with_suffix(".log")
    script = Path(__file__).resolve()
    ckpt_dir = tempfile.mkdtemp(prefix="zerodp-ckpt-bench-", dir=args.dir)
    load_before = bench.uptime()
    print(f"[bench_checkpoint] {load_before}\n[bench_checkpoint] checkpoints under {ckpt_dir}", flush=True)
    records, failures = {}, {}
    try:
        for variant in args.variants:
            worker_args = ["--variant", variant, "--model", args.model, "--repeats", str(args.repeats),
                           "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
                           "--dir", ckpt_dir, "--results", str(results), "--timeout", str(args.timeout)]
            record, err = bench.run_variant(script, worker_args, args.timeout, results, log_path)
            if err is not None:
                failures[variant] = err[:200].replace("|", "/")
                print(f"[bench_checkpoint] {variant} FAILED ({err}); see {log_path}", flush=True)
            else:
                records[variant] = record
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    import torch

    header = [f"# zerodp checkpoint benchmark, {stamp}", "",
              f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}` (from the repository root)", "",
              f"World size {bench.WORLD_SIZE} on CPU/gloo, OMP_NUM_THREADS=1, fp32 AdamW, checkpoints in "
              f"{args.dir or tempfile.gettempdir()}, {args.repeats} saves and loads per variant. "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs.", "",
              f"Load before: `{load_before}`  ", f"Load after: `{bench.uptime()}`", ""]
    text = "\n".join(header + [render_table(args.model, records, failures)])
    out.write_text(text)
    print("\n" + text)
    print(f"[bench_checkpoint] wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="120m", choices=bench.MODELS)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--repeats", type=int, default=3, help="saves (and loads) per variant; the median is reported")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: the system temp dir)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed per variant")
    ap.add_argument("--out", default=None,
                    help="markdown output (default benchmarks/results/checkpoint-<timestamp>.md)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.worker:
        worker(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
