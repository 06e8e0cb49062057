#!/usr/bin/env python
"""The largest bundled GPT each setup trains on this machine at world size 2 (CPU/gloo).

    .venv/bin/python benchmarks/bench_largest.py

For each setup the parent walks a ladder of GPT sizes: from the setup's starting rung up
while a size trains, or down while it does not, so the largest size that trains is found
with the smallest one above it seen failing. "Trains" means three AdamW steps (fp32,
micro-batch 1 x 64 tokens per rank) with a finite loss, every rank exiting cleanly. A run
fails when it is killed for memory: by the kernel, or by this script's watchdog once the
processes' unreclaimable memory (anonymous + shared pages, summed over the launch) passes
--memory-limit (default: 90% of the machine's memory, so the machine itself survives).
File pages of the disk tier are not counted there: the kernel writes them back and drops
them under pressure, which is what ZeRO-Infinity relies on.

Setups: torch DDP (eager init), FSDP2 (fully_shard per Block, built on the meta device and
initialised after sharding), zerodp stage 3 (built under zerodp.init), stage 3 with the
optimizer on disk, and stage 3 with the optimizer and the parameter/gradient shards on
disk (Config.offload_params="disk"). The disk's own bandwidth is measured first with dd
(O_DIRECT, 2 GiB) in the offload directory; each disk run reports the bytes its ranks read
and wrote (/proc/<pid>/io) per step and the bandwidth that makes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import ROOT, adamw_kwargs, make_batches, peak_rss_bytes  # noqa: E402

OFFLOAD_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "zerodp-bench-largest")
WORLD_SIZE, STEPS, SEQ, SEED = 2, 3, 64, 1234
# (name, n_layer, n_embd): GPT-2 medium, large and XL, then wider and deeper ones.
LADDER = [("0.35B", 24, 1024), ("0.77B", 36, 1280), ("1.1B", 36, 1536), ("1.6B", 48, 1600),
          ("2.1B", 40, 2048), ("2.7B", 32, 2560), ("3.6B", 44, 2560)]
SETUPS = {  # name -> (first rung tried, description)
    "ddp": (0, "torch DDP"),
    "fsdp2": (0, "FSDP2 fully_shard"),
    "zerodp3": (1, "zerodp stage 3"),
    "zerodp3_opt_disk": (3, "stage 3 + optimizer on disk"),
    "zerodp3_all_disk": (5, "stage 3 + optimizer and parameters on disk"),
}


# ============================================================================ worker side
def gpt_config(rung: str):
    from zerodp.demo.models import GPTConfig

    _, n_layer, n_embd = next(r for r in LADDER if r[0] == rung)
    return GPTConfig(vocab_size=50304, block_size=SEQ, n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd)


def disk_io() -> tuple[int, int]:
    """Bytes this process has read from and written to storage (not the page cache)."""
    with open("/proc/self/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    return int(io["read_bytes"]), int(io["write_bytes"])


def build(setup: str, cfg):
    """The setup's training step: (x, y) -> loss."""
    import torch
    import torch.distributed as dist
    from zerodp.demo.models import GPT, Block

    torch.manual_seed(SEED)
    if setup == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(GPT(cfg))
        opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs())
        backward = lambda loss: loss.backward()  # noqa: E731
    elif setup == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = GPT(cfg)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.modules():
            if isinstance(block, Block):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        for m in model.modules():  # the bundled GPT initialises in reset_parameters
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs())
        backward = lambda loss: loss.backward()  # noqa: E731
    else:
        import zerodp

        fields = {}
        if setup != "zerodp3":
            if dist.get_rank() == 0:
                shutil.rmtree(OFFLOAD_DIR, ignore_errors=True)
                os.makedirs(OFFLOAD_DIR)
            dist.barrier()
            fields = dict(offload_optimizer="disk", offload_dir=OFFLOAD_DIR,
                          offload_params="disk" if setup == "zerodp3_all_disk" else "none")
        config = zerodp.Config(stage=3, mixed_precision="fp32", unit_modules=[Block], **fields)
        with zerodp.init(config):
            model = GPT(cfg)
        model, opt = zerodp.initialize(model, torch.optim.AdamW, config, **adamw_kwargs())
        backward = opt.backward
    def step(x, y):
        opt.zero_grad()
        loss = model(x, y)[1]
        backward(loss)
        opt.step()
        return float(loss.detach())
    return step


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    cfg = gpt_config(args.rung)
    t0 = time.perf_counter()
    step = build(args.setup, cfg)
    setup_s = time.perf_counter() - t0
    losses, step_s, io = [], [], []
    for x, y in make_batches(rank, STEPS, 1, SEQ, cfg.vocab_size):
        dist.barrier()
        before, t = disk_io(), time.perf_counter()
        losses.append(step(x, y))
        dist.barrier()
        step_s.append(time.perf_counter() - t)
        after = disk_io()
        io.append((after[0] - before[0], after[1] - before[1]))
    mine = {"losses": losses, "step_s": step_s, "io": io, "peak_rss": peak_rss_bytes(), "setup_s": setup_s}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        print("[largest] " + json.dumps({"setup": args.setup, "rung": args.rung, "ranks": everyone}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ parent side
def unreclaimable_bytes(root_pid: int) -> int:
    """RssAnon + RssShmem summed over `root_pid` and its descendants."""
    total, pids = 0, [root_pid]
    try:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(root_pid)], capture_output=True, text=True).stdout
        pids += [int(p) for p in out.split()]
        for child in list(pids[1:]):
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(child)], capture_output=True, text=True).stdout
            pids += [int(p) for p in out.split()]
    except (OSError, ValueError):
        pass
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(("RssAnon:", "RssShmem:")):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def run_one(setup: str, rung: str, args, log) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD_SIZE}",
           __file__, "--worker", "--setup", setup, "--rung", rung, "--timeout", str(args.timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    peak, verdict = [0], [None]

    def watch():
        while proc.poll() is None:
            used = unreclaimable_bytes(proc.pid)
            peak[0] = max(peak[0], used)
            if used > args.memory_limit:
                verdict[0] = f"over the memory limit ({used / 2**30:.1f} GiB)"
                os.killpg(proc.pid, signal.SIGKILL)
                return
            if time.perf_counter() - start > args.timeout:
                verdict[0] = f"timed out after {args.timeout:.0f} s"
                os.killpg(proc.pid, signal.SIGKILL)
                return
            time.sleep(0.5)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, _ = proc.communicate()
    watcher.join()
    log.write(out)
    log.flush()
    found = [line for line in out.splitlines() if line.startswith("[largest] ")]
    record = {"setup": setup, "rung": rung, "wall_s": time.perf_counter() - start, "peak_unreclaimable": peak[0]}
    if proc.returncode == 0 and found:
        ranks = json.loads(found[-1][len("[largest] "):])["ranks"]
        losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(STEPS)]
        if all(math.isfinite(v) for v in losses):
            step_s = [max(r["step_s"][i] for r in ranks) for i in range(STEPS)]
            io = [tuple(sum(r["io"][i][k] for r in ranks) for k in (0, 1)) for i in range(STEPS)]
            return {**record, "ok": True, "losses": losses, "step_s": step_s, "io": io,
                    "peak_rss": max(r["peak_rss"] for r in ranks), "setup_s": max(r["setup_s"] for r in ranks)}
        verdict[0] = f"loss not finite: {losses}"
    if verdict[0] is None:
        oom = re.search(r"(Killed|SIGKILL|OutOfMemory|Cannot allocate memory|exitcode\s*:\s*-9)", out)
        err = next((line.strip() for line in reversed(out.splitlines()) if "Error" in line), None)
        verdict[0] = "killed for memory" if oom else (err or f"exit code {proc.returncode}")
    return {**record, "ok": False, "why": verdict[0]}


def disk_bandwidth(directory: str) -> tuple[float, float]:
    """(write, read) bytes/s of the disk under `directory`, O_DIRECT, 2 GiB."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "dd-probe")
    rates = []
    for cmd in (["dd", "if=/dev/zero", f"of={path}", "bs=4M", "count=512", "oflag=direct", "conv=fsync"],
                ["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"]):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        rates.append(2 * 2**30 / (time.perf_counter() - t))
    os.remove(path)
    return rates[0], rates[1]


def parent(args) -> None:
    from zerodp.demo.models import GPT

    results_dir = ROOT / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    log = open(results_dir / f"largest-{stamp}.log", "w")
    psi = {}
    import torch
    for name, _, _ in LADDER:
        with torch.device("meta"):
            psi[name] = sum(p.numel() for p in GPT(gpt_config(name)).parameters())
    write_bw, read_bw = disk_bandwidth(OFFLOAD_DIR)
    print(f"disk (dd, O_DIRECT, 2 GiB): write {write_bw / 1e9:.2f} GB/s, read {read_bw / 1e9:.2f} GB/s; "
          f"memory limit {args.memory_limit / 2**30:.1f} GiB", flush=True)
    rows = []
    for setup in args.setups:
        first, what = SETUPS[setup]
        at = args.start.get(setup, first)
        tried: dict[int, dict] = {}
        while 0 <= at < len(LADDER) and at not in tried:
            tried[at] = r = run_one(setup, LADDER[at][0], args, log)
            print(f"[largest] {setup} {LADDER[at][0]}: " + (f"ok, steps {[round(s, 1) for s in r['step_s']]} s"
                                                            if r["ok"] else f"failed: {r['why']}"), flush=True)
            at += 1 if r["ok"] else -1
        passed = [i for i in tried if tried[i]["ok"]]
        failed = [i for i in tried if not tried[i]["ok"]]
        best = tried[max(passed)] if passed else None
        rows.append((setup, what, best, LADDER[min(failed)][0] if failed and (not passed or min(failed) > max(passed))
                     else "—", tried))
        table = render(rows, psi, write_bw, read_bw)  # after each setup, so a stopped run keeps its table
        (results_dir / f"largest-{stamp}.md").write_text(table + "\n\n" + json.dumps(
            [t for *_, tried in rows for t in tried.values()], indent=1) + "\n")
    print("\n" + table)
    shutil.rmtree(OFFLOAD_DIR, ignore_errors=True)


def render(rows: list, psi: dict, write_bw: float, read_bw: float) -> str:
    base = next((psi[r[2]["rung"]] for r in rows if r[0] == "ddp" and r[2]), None)
    lines = [f"Largest bundled GPT that trains at N={WORLD_SIZE} (3 AdamW steps, fp32, 1x{SEQ} tokens per rank), "
             f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; "
             f"disk {write_bw / 1e9:.2f} GB/s write, {read_bw / 1e9:.2f} GB/s read (dd O_DIRECT)", "",
             "| setup | largest that trains | params | × DDP | first that fails | median step s | peak RSS GiB "
             "(max rank) | unreclaimable GiB (all ranks) | disk read+write GB/step | disk GB/s |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for setup, what, best, first_fail, _ in rows:
        if best is None:
            lines.append(f"| {what} | none | — | — | {first_fail} | — | — | — | — | — |")
            continue
        step = statistics.median(best["step_s"][1:])
        io = statistics.median([(r + w) for r, w in best["io"][1:]])
        ratio = f"{psi[best['rung']] / base:.1f}" if base else "—"
        lines.append(f"| {what} | {best['rung']} | {psi[best['rung']] / 1e9:.2f}B | {ratio} | {first_fail} | "
                     f"{step:.1f} | {best['peak_rss'] / 2**30:.2f} | {best['peak_unreclaimable'] / 2**30:.2f} | "
                     f"{io / 1e9:.1f} | {io / step / 1e9:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--start", nargs="*", default=[], metavar="SETUP=RUNG",
                    help="first rung to try per setup, e.g. zerodp3_all_disk=2.7B")
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ap.add_argument("--memory-limit", type=float, default=0.9 * total, help="bytes (default: 90%% of memory)")
    ap.add_argument("--timeout", type=float, default=2400, help="seconds allowed per run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    ap.add_argument("--rung", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    names = [r[0] for r in LADDER]
    args.start = {s.split("=")[0]: names.index(s.split("=")[1]) for s in args.start}
    parent(args)


if __name__ == "__main__":
    main()
