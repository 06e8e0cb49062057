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
  zerodp2_async     stage 2, the time a training step is blocked by zerodp.save against
                    zerodp.save(..., asynchronous=True), the background write's throughput
                    against `dd` into the same directory, and the staging bytes
                    (`--variants zerodp2_async`; its own table, see async_worker)

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench  # benchmarks/bench.py: model, data, optimizer settings and the launcher

VARIANTS = ("zerodp2", "zerodp3", "fsdp2_dcp", "zerodp2_async")


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

        stage = int(variant[len("zerodp")])
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


def dd_bandwidth(directory: str) -> dict:
    """Bytes/s of `dd` writing 512 MiB into `directory`, bypassing the page cache
    (oflag=direct) and through it with one final fdatasync (conv=fdatasync, as a save writes)."""
    out = {}
    for name, flag in (("direct", "oflag=direct"), ("fdatasync", "conv=fdatasync")):
        target = os.path.join(directory, f"dd-{name}.bin")
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", "count=512", flag], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out[name] = 512 * 2**20 / (time.perf_counter() - t0)
        os.remove(target)
    return out


def async_worker(args, rank, ws, model, opt, train_step, batches) -> dict:
    """Blocked time of synchronous against asynchronous saves, measured the same way: from a
    barrier to the return of `zerodp.save` on the slowest rank. An asynchronous save's
    background part is timed by its thread (this rank's files written and fsynced with their
    sha256: `write`; agreed on and committed: `total`), once while training steps run and once
    with training idle. `dd` runs on rank 0 between the saves, with the other rank idle."""
    import torch.distributed as dist
    import zerodp
    from zerodp.checkpoint import background

    def blocked(fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    path = lambda tag: os.path.join(args.dir, f"async-{tag}")  # noqa: E731
    def drop(tag):  # each measurement starts with the same disk usage
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path(tag), ignore_errors=True)

    # The disk's bandwidth moves 2-5x between runs on a shared virtual disk: three runs before
    # the saves and three after, the median reported.
    dd = [dd_bandwidth(args.dir) if rank == 0 else {} for _ in range(3)]
    sync_s = []
    for i in range(args.repeats):
        sync_s.append(blocked(lambda i=i: zerodp.save(path(f"sync{i}"), model, opt))[0])
        drop(f"sync{i}")
    runs = []
    for i in range(args.repeats):
        for training in (True, False):
            s, handle = blocked(lambda i=i, t=training: zerodp.save(path(f"a{i}{t}"), model, opt, asynchronous=True))
            steps = []
            while training and not handle.done():
                t0 = time.perf_counter()
                train_step(*batches[0])
                steps.append(time.perf_counter() - t0)
            handle.wait()
            runs.append({"training": training, "blocked_s": s, "write_s": handle.timings["write"],
                         "total_s": handle.timings["total"], "steps_during": steps,
                         "nbytes": handle.staged_nbytes})
            drop(f"a{i}{training}")
    dd += [dd_bandwidth(args.dir) if rank == 0 else {} for _ in range(3)]
    step_s = []
    for _ in range(2):  # steps with no save in flight, for the ones above
        t0 = time.perf_counter()
        train_step(*batches[0])
        step_s.append(time.perf_counter() - t0)
    return {"sync_s": sync_s, "async": runs, "dd": dd, "step_s": step_s,
            "staging_nbytes": background.staging(opt).nbytes}


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
    if args.variant == "zerodp2_async":
        mine = async_worker(args, rank, ws, model, opt, train_step, batches)
        everyone = [None] * ws
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            record = {"variant": args.variant, "model": args.model, "psi": psi, "world_size": ws,
                      "repeats": args.repeats, "torch": torch.__version__, "ranks": everyone}
            with open(args.results, "a") as f:
                f.write(json.dumps(record) + "\n")
        dist.barrier()
        dist.destroy_process_group()
        return
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


def render_async_table(r: dict) -> str:
    """The asynchronous save against the synchronous one, and the background write against dd."""
    ranks, n = r["ranks"], r["repeats"]
    sync = statistics.median(max(x["sync_s"][i] for x in ranks) for i in range(n))
    lines = [f"### Asynchronous save, GPT {r['model']} (Ψ = {r['psi']:,} parameters, N = {r['world_size']}), "
             "stage 2, fp32 AdamW", "",
             "| save | blocked s (slowest rank) | × sync | background: files written s | committed s "
             "| write GB/s (both ranks) | × dd fdatasync | × dd direct | steps during | step s during / idle |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    dd = {k: statistics.median(d[k] for d in ranks[0]["dd"]) for k in ("direct", "fdatasync")}
    idle_step = statistics.median(s for x in ranks for s in x["step_s"])
    lines.append(f"| synchronous | {sync:.2f} | 1.00 | | | | | | | |")
    for training in (True, False):
        runs = [[run for run in x["async"] if run["training"] is training] for x in ranks]
        blocked = statistics.median(max(rr[i]["blocked_s"] for rr in runs) for i in range(n))
        write = statistics.median(max(rr[i]["write_s"] for rr in runs) for i in range(n))
        total = statistics.median(max(rr[i]["total_s"] for rr in runs) for i in range(n))
        nbytes = sum(rr[0]["nbytes"] for rr in runs)
        gbps = nbytes / write / 1e9
        during = [s for rr in runs for run in rr for s in run["steps_during"]]
        step = f"{statistics.median(during):.2f} / {idle_step:.2f}" if during else f"— / {idle_step:.2f}"
        lines.append(f"| asynchronous, {'training on' if training else 'idle'} | {blocked:.2f} | "
                     f"{blocked / sync:.2f} | {write:.2f} | {total:.2f} | {gbps:.2f} | "
                     f"{gbps * 1e9 / dd['fdatasync']:.2f} | {gbps * 1e9 / dd['direct']:.2f} | "
                     f"{len(during) // max(n, 1)} | {step} |")
    shard = [x["async"][0]["nbytes"] for x in ranks]
    staging = [x["staging_nbytes"] for x in ranks]
    lines += ["", f"dd into the checkpoint directory, 512 MiB, median of {len(ranks[0]['dd'])} runs (half before "
              f"and half after the saves): {dd['fdatasync'] / 1e9:.2f} GB/s with conv=fdatasync, {dd['direct'] / 1e9:.2f} "
              f"GB/s with oflag=direct (runs: "
              + ", ".join(f"{d['fdatasync'] / 1e9:.2f}/{d['direct'] / 1e9:.2f}" for d in ranks[0]["dd"]) + ").",
              "Staging bytes per rank: " + ", ".join(f"rank {i}: {s / 2**20:,.1f} MiB" for i, s in enumerate(staging))
              + "; the rank's checkpoint tensors: " + ", ".join(f"{b / 2**20:,.1f} MiB" for b in shard)
              + f" (staging ÷ shard: {max(s / b for s, b in zip(staging, shard)):.3f}).",
              "",
              "Blocked: barrier to the return of `zerodp.save`, slowest rank, median of the repeats (an "
              "asynchronous save returns once the rank's state is copied into its staging buffers). Files "
              "written: the background thread's time to write and fsync the rank's files and compute their "
              "sha256 (safetensors; the sha256 is of the staged tensors, hashed while the file is flushed), slowest rank; committed: until the "
              "ranks agreed and rank 0 renamed the checkpoint into place. Write GB/s: both ranks' bytes over "
              "the slowest rank's files-written time (the two ranks write to the same disk at once), against "
              "one `dd` writer. Steps during: training steps run while the save was in the background "
              "(per save), and their median time against steps with no save in flight.", ""]
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
    tables = [render_table(args.model, {k: v for k, v in records.items() if k != "zerodp2_async"}, failures)]
    if "zerodp2_async" in records:
        tables.append(render_async_table(records["zerodp2_async"]))
    text = "\n".join(header + tables)
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
