#!/usr/bin/env python
"""Step time, peak memory and model-state bytes of zerodp against DDP, torch's ZeRO-1 and FSDP2.

One invocation measures every variant on the bundled GPT at world size 2 on CPU/gloo:

    .venv/bin/python benchmarks/bench.py --models 20m 120m --steps 10

The parent process launches `torch.distributed.run --nproc_per_node 2` once per
(model, variant), one after another, each with a timeout and OMP_NUM_THREADS=1, so the
variants never compete with each other for the two cores. Every variant trains the same
model (same init seed) on the same per-rank token stream, fp32, AdamW(lr=1e-4, wd=0).
Rank 0 of each worker appends one JSON line to a results file; the parent then prints,
and writes to --out, one markdown table per model size.

Figures are comparable only within one run on one machine: quote the ratios.

Variants:
  ddp          torch DistributedDataParallel + AdamW                 (formula: stage 0)
  zero1_torch  DDP + torch.distributed.optim.ZeroRedundancyOptimizer (formula: stage 1)
  fsdp2        torch.distributed.fsdp.fully_shard per Block, then root (formula: stage 3)
  zerodp0..3   zerodp.initialize(..., Config(stage=s, unit_modules=[Block]))
  zerodp3_host stage 3 with Config.offload_optimizer="host" (master, gradient copy, states in host memory)
  zerodp3_disk stage 3 with offload_optimizer="disk" (states in files under $TMPDIR/zerodp-bench-offload)
  zerodp3_all_disk  stage 3 with the optimizer and offload_params="disk" (every model-state byte in files)
  zerodp3_host_dpu  zerodp3_host with the delayed parameter update from step 0 (changes the maths)

Model state per rank, fp32 AdamW (K = 8: exp_avg and exp_avg_sq; 4-byte params and grads;
the fp32 parameters are their own master copy), ZeRO arXiv 1910.02054 §5 with Ψ parameters
and N ranks: stage 0 16Ψ; stage 1 4Ψ + 4Ψ + 8Ψ/N; stage 2 4Ψ + 12Ψ/N; stage 3 16Ψ/N.
For zerodp the measured figure is the library's own ledger (`opt.memory_report()`); for
the torch variants it is a census of the tensors they expose (parameters or their local
shards, .grad, optimizer states) and misses what they keep internally (e.g. DDP's
gradient buckets, another 4Ψ).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("ddp", "zero1_torch", "fsdp2", "zerodp0", "zerodp1", "zerodp2", "zerodp3", "zerodp3_host",
            "zerodp3_disk", "zerodp3_all_disk", "zerodp3_host_dpu")
MODELS = ("20m", "120m")
# The ZeRO stage whose formula each variant's model state should follow.
FORMULA_STAGE = {"ddp": 0, "zero1_torch": 1, "fsdp2": 3, "zerodp0": 0, "zerodp1": 1, "zerodp2": 2, "zerodp3": 3,
                 "zerodp3_host": 3, "zerodp3_disk": 3, "zerodp3_all_disk": 3, "zerodp3_host_dpu": 3}
# Where the disk variant keeps its optimizer states (each rank in its own rank{r}/).
OFFLOAD_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "zerodp-bench-offload")

WORLD_SIZE = 2
WARMUP = 2
LR = 1e-4
WEIGHT_DECAY = 0.0
SEED = 1234
# fp32 AdamW: exp_avg + exp_avg_sq (4 + 4 bytes); fp32 params are their own master copy.
K_FP32_ADAMW, PARAM_BYTES, GRAD_BYTES = 8, 4, 4


# ============================================================================ worker side
def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (not Linux?)")


def build_model(preset: str):
    """The bundled GPT, initialised identically on every rank."""
    import torch
    from zerodp.demo.models import GPT

    torch.manual_seed(SEED)
    model = GPT(preset)
    model.train()
    return model


def make_batches(rank: int, steps: int, micro_batch: int, seq: int, vocab: int):
    """This rank's token stream: a list of (input, target) pairs, the same for every variant."""
    import torch

    g = torch.Generator().manual_seed(SEED * 1000 + rank)
    tokens = torch.randint(0, vocab, (steps, micro_batch, seq + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def adamw_kwargs() -> dict:
    return dict(lr=LR, weight_decay=WEIGHT_DECAY)


def _local(t):
    """A DTensor's local shard; any other tensor as it is."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def census_nbytes(params, inner_optimizer) -> dict:
    """Bytes of the distinct storages behind params, their .grad and per-element optimizer
    states (Adam's step counter is not model state)."""
    def distinct(tensors):
        seen = {}
        for t in tensors:
            if t is None:
                continue
            st = _local(t).untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    params = list(params)
    states = [v for s in inner_optimizer.state.values() for v in s.values()
              if hasattr(v, "numel") and v.numel() > 1]
    out = {"params": distinct(params), "grads": distinct(p.grad for p in params),
           "optimizer_states": distinct(states)}
    out["model_state"] = sum(out.values())
    return out


@dataclass
class Trainer:
    """What the training loop needs from one variant."""

    forward: Callable  # (x, y) -> loss
    backward: Callable  # loss -> None
    step: Callable
    zero_grad: Callable
    model_state: Callable  # () -> dict of bytes by category, with "model_state" and "source"
    comm: Callable = lambda: None  # () -> the last step's communication summary, if known


def _loss_fn(model):
    return lambda x, y: model(x, y)[1]


def setup_ddp(model, args) -> Trainer:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), **adamw_kwargs())
    return Trainer(_loss_fn(ddp), lambda loss: loss.backward(), opt.step, lambda: opt.zero_grad(set_to_none=True),
                   lambda: {**census_nbytes(ddp.parameters(), opt), "source": "census"})


def setup_zero1_torch(model, args) -> Trainer:
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **adamw_kwargs())
    return Trainer(_loss_fn(ddp), lambda loss: loss.backward(), opt.step, lambda: opt.zero_grad(set_to_none=True),
                   lambda: {**census_nbytes(ddp.parameters(), opt.optim), "source": "census"})


def setup_fsdp2(model, args) -> Trainer:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from zerodp.demo.models import Block

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.modules():
        if isinstance(block, Block):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise RuntimeError("fully_shard untied lm_head from wte: the variants would train different models")
    opt = torch.optim.AdamW(model.parameters(), **adamw_kwargs())
    return Trainer(_loss_fn(model), lambda loss: loss.backward(), opt.step, lambda: opt.zero_grad(set_to_none=True),
                   lambda: {**census_nbytes(model.parameters(), opt), "source": "census"})


def make_setup_zerodp(stage: int, **fields):
    """zerodp at `stage` with other Config `fields` (e.g. offload_optimizer="disk", whose
    files go under OFFLOAD_DIR)."""
    def setup(model, args) -> Trainer:
        import torch
        import zerodp
        from zerodp.demo.models import Block

        chosen = dict(fields)
        if "disk" in (chosen.get("offload_optimizer"), chosen.get("offload_params")):
            os.makedirs(OFFLOAD_DIR, exist_ok=True)
            chosen.setdefault("offload_dir", OFFLOAD_DIR)
        cfg = zerodp.Config(stage=stage, mixed_precision="fp32", unit_modules=[Block] if stage == 3 else [], **chosen)
        zmodel, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, **adamw_kwargs())

        def model_state():
            return {**opt.memory_report().as_dict(), "source": "ledger"}

        return Trainer(_loss_fn(zmodel), opt.backward, opt.step, opt.zero_grad, model_state,
                       lambda: opt.comm.ledger.summary())
    return setup


def timed_steps(trainer: Trainer, batches: list) -> tuple[list[float], list[float]]:
    """One step per batch, every rank starting together (so a step's time is the slowest
    rank's); returns (losses, seconds per step)."""
    import torch.distributed as dist

    losses, step_s = [], []
    for x, y in batches:
        dist.barrier()
        t0 = time.perf_counter()
        trainer.zero_grad()
        loss = trainer.forward(x, y)
        trainer.backward(loss)
        trainer.step()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, step_s


SETUPS = {"ddp": setup_ddp, "zero1_torch": setup_zero1_torch, "fsdp2": setup_fsdp2,
          **{f"zerodp{s}": make_setup_zerodp(s) for s in range(4)},
          "zerodp3_host": make_setup_zerodp(3, offload_optimizer="host"),
          "zerodp3_disk": make_setup_zerodp(3, offload_optimizer="disk"),
          "zerodp3_all_disk": make_setup_zerodp(3, offload_optimizer="disk", offload_params="disk"),
          "zerodp3_host_dpu": make_setup_zerodp(3, offload_optimizer="host", delayed_update_after=0)}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    t_start = time.perf_counter()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = build_model(args.model)
    psi = model.num_params()
    batches = make_batches(rank, args.steps, args.micro_batch, args.seq, model.config.vocab_size)
    trainer = SETUPS[args.variant](model, args)
    del model
    setup_s = time.perf_counter() - t_start

    losses, step_s = timed_steps(trainer, batches)
    state = trainer.model_state()
    mine = {"rank": rank, "losses": losses, "step_s": step_s, "peak_rss": peak_rss_bytes(),
            "model_state": state, "comm": trainer.comm(), "setup_s": setup_s}
    everyone = [None] * ws
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        from zerodp.memory.estimator import model_state_bytes

        slowest = [max(r["step_s"][i] for r in everyone) for i in range(args.steps)]
        loss_mean = [statistics.fmean(r["losses"][i] for r in everyone) for i in range(args.steps)]
        stage = FORMULA_STAGE[args.variant]
        record = {
            "model": args.model, "variant": args.variant, "psi": psi, "world_size": ws,
            "steps": args.steps, "warmup": WARMUP, "seq": args.seq, "micro_batch": args.micro_batch,
            "median_step_s": statistics.median(slowest[WARMUP:]), "step_s_slowest_rank": slowest,
            "peak_rss_max": max(r["peak_rss"] for r in everyone),
            "model_state_max": max(r["model_state"]["model_state"] for r in everyone),
            "formula_stage": stage,
            "formula_bytes": model_state_bytes(psi, ws, stage, k=K_FP32_ADAMW,
                                               param_bytes=PARAM_BYTES, grad_bytes=GRAD_BYTES),
            "loss_mean": loss_mean, "final_loss": loss_mean[-1],
            "torch": torch.__version__, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "ranks": everyone,
        }
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[bench] {args.model} {args.variant}: median step {record['median_step_s']:.3f} s, "
              f"final loss {record['final_loss']:.6f}, peak RSS {record['peak_rss_max'] / 2**30:.2f} GiB",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ parent side
def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def launch(script: Path, worker_args: list[str], timeout: float, log_path: Path) -> tuple[int, str]:
    """Run `script --worker ...` under torchrun on WORLD_SIZE local ranks; returns (exit
    code, tail of its output). On timeout the whole launch (its own session) is killed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD_SIZE}",
           str(script), "--worker", *worker_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            rc = -1
            out += f"\n[bench] timed out after {timeout:.0f} s\n"
        log.write(out)
    return rc, out[-3000:]


def run_variant(script: Path, worker_args: list[str], timeout: float, results: Path,
                log_path: Path) -> tuple[Optional[dict], Optional[str]]:
    """Launch one variant; (its JSON record, None) if it appended one to `results`, else
    (None, a one-line reason taken from its output)."""
    before = len(results.read_text().splitlines()) if results.exists() else 0
    rc, tail = launch(script, worker_args, timeout, log_path)
    lines = results.read_text().splitlines() if results.exists() else []
    if rc == 0 and len(lines) > before:
        return json.loads(lines[-1]), None
    err = next((l.strip() for l in reversed(tail.splitlines()) if "Error" in l or "timed out" in l),
               f"exit code {rc}")
    return None, err


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}" if a is not None and b else "—"


def _mib(n: Optional[float]) -> str:
    return f"{n / 2**20:,.1f} MiB" if n is not None else "—"


def render_table(model: str, records: dict, failures: dict) -> str:
    """One markdown table for one model size; records: variant -> JSON record."""
    ddp, fsdp2 = records.get("ddp"), records.get("fsdp2")
    psi = next(iter(records.values()))["psi"] if records else None
    lines = [f"### GPT {model}" + (f" (Ψ = {psi:,} parameters, N = {WORLD_SIZE})" if psi else ""), "",
             "| variant | median step s | × DDP | × FSDP2 | peak RSS GiB/rank | × DDP | model state/rank (ledger) "
             "| formula | comm buffers/rank (ledger) | final loss | loss Δ vs DDP | comm/step (ledger) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for variant in VARIANTS:
        if variant in failures:
            lines.append(f"| {variant} | failed: {failures[variant]} |" + " |" * 10)
            continue
        r = records.get(variant)
        if r is None:
            continue
        t, rss = r["median_step_s"], r["peak_rss_max"]
        state = _mib(r["model_state_max"]) + (" †" if r["ranks"][0]["model_state"]["source"] == "census" else "")
        formula = f"{_mib(r['formula_bytes'])} (s{r['formula_stage']})"
        if ddp is not None:
            delta = max(abs(a - b) for a, b in zip(r["loss_mean"], ddp["loss_mean"]))
            delta_s = f"{delta:.1e}"
        else:
            delta_s = "—"
        buffers = r["ranks"][0]["model_state"].get("comm_buffers")
        comm = r["ranks"][0]["comm"]
        comm_s = f"{comm['volume_numel'] / r['psi']:.2f} Ψ" if comm else "—"
        lines.append(f"| {variant} | {t:.3f} | {_ratio(t, ddp and ddp['median_step_s'])} "
                     f"| {_ratio(t, fsdp2 and fsdp2['median_step_s'])} | {rss / 2**30:.2f} "
                     f"| {_ratio(rss, ddp and ddp['peak_rss_max'])} | {state} | {formula} | {_mib(buffers)} "
                     f"| {r['final_loss']:.6f} | {delta_s} | {comm_s} |")
    lines += ["", "Step time: median over the post-warm-up steps of the slowest rank's step. Peak RSS: VmHWM, "
              "largest rank. Model state: † = census of the tensors torch exposes (params or local shards, "
              ".grad, AdamW states), not counting DDP's internal gradient buckets; otherwise zerodp's ledger "
              "(`opt.memory_report().model_state`). Formula: fp32 AdamW, K = 8, 4-byte params and grads, "
              "for the ZeRO stage in brackets. Comm buffers: zerodp's pooled bucket/gather buffers "
              "(`memory_report().comm_buffers`), outside model state. Loss Δ: largest |mean-over-ranks loss − DDP's| over all steps. "
              "Comm: elements moved in the last step, in units of Ψ (zerodp's ledger).", ""]
    return "\n".join(lines)


def parent(args) -> None:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"{stamp}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = out.with_suffix(".jsonl")
    log_path = out.with_suffix(".log")
    script = Path(__file__).resolve()
    load_before = uptime()
    print(f"[bench] {load_before}\n[bench] results -> {results}, worker output -> {log_path}", flush=True)

    tables = []
    for model in args.models:
        records, failures = {}, {}
        for variant in args.variants:
            t0 = time.perf_counter()
            worker_args = ["--variant", variant, "--model", model, "--steps", str(args.steps),
                           "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
                           "--results", str(results), "--timeout", str(args.timeout)]
            record, err = run_variant(script, worker_args, args.timeout, results, log_path)
            if err is not None:
                failures[variant] = err[:200].replace("|", "/")
                print(f"[bench] {model} {variant} FAILED ({err}); see {log_path}", flush=True)
            else:
                records[variant] = record
                print(f"[bench] {model} {variant} done in {time.perf_counter() - t0:.0f} s", flush=True)
        tables.append(render_table(model, records, failures))

    load_after = uptime()
    import torch

    header = [f"# zerodp benchmark, {stamp}", "",
              f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}` (from the repository root)", "",
              f"World size {WORLD_SIZE} on CPU/gloo, OMP_NUM_THREADS=1, fp32, AdamW(lr={LR}, weight_decay="
              f"{WEIGHT_DECAY}), sequence {args.seq}, micro-batch {args.micro_batch} per rank, {args.steps} steps "
              f"({WARMUP} warm-up). torch {torch.__version__}, Python {platform.python_version()}, "
              f"{os.cpu_count()} CPUs.", "",
              f"Load before: `{load_before}`  ", f"Load after: `{load_after}`", ""]
    text = "\n".join(header + tables)
    out.write_text(text)
    print("\n" + text)
    print(f"[bench] wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=10, help=f"training steps; the first {WARMUP} are warm-up")
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed per variant")
    ap.add_argument("--out", default=None, help="markdown output (default benchmarks/results/<timestamp>.md)")
    # Internal: one torchrun rank.
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps <= WARMUP:
        ap.error(f"--steps must exceed the {WARMUP} warm-up steps")
    if args.worker:
        worker(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
