"""GPU smoke check: zerodp stages 0-3 x bf16/fp16 against torch DDP (built whole and born
sharded, zerodp's clip and torch's), the fp16 overflow skip, a DCP save/load round trip of the
DTensor state dicts (stages 1 and 3), the optimizer and stage 3's shards offloaded, the
delayed update, ZeRO++'s quantization kernels, activation checkpoints on the host (and tensor
parallelism with Pa, Pa+cpu), stage 3 compiled against eager; then, in gpu_check_parallel.py,
against a one-process reference: sequence parallelism 2 with the tiled loss and MLP (even
worlds), expert parallelism over every rank, and the stage-3 generation context with the
weight stream; and a stage-3 vs DDP step-time/memory line. Launch with
`bash scripts/gpu_check.sh` (torchrun, one process per GPU, NCCL); `--cpu` runs the same logic
on gloo."""
from __future__ import annotations

import argparse
import copy
import gc
import logging
import resource
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp
from zerodp.demo.models import GPT, Block, gpt_config

# Tolerances. zerodp and the reference do the same math in the same dtype but sum the
# ranks' gradients in a different order (flat buckets, reduce-scatter vs DDP's all-reduce),
# so they differ by rounding; at 2 ranks a+b is order-free and they agree bitwise.
# Measured on CPU, gloo, "tiny", 5 steps, lr 1e-3, largest over stages 0-3 at 3, 4, 8 ranks:
#   rounding noise   bf16: loss 1.5e-4, param 3.3e-3   fp16: loss 5.2e-5, param 2.0e-3
# and, for scale, the reference against broken copies of itself (2 ranks, bf16 / fp16):
#   gradients not all-reduced  loss 5.9e-3 / 6.0e-3, param 9.5e-3
#   no update at all           loss 7.9e-3 / 8.0e-3, param 5.0e-3
# So the loss is the sensitive metric: its limits sit 7-10x above the noise (room for
# NCCL's ring order and atomics in CUDA attention backward) and 6x below those bugs; a
# loose 2e-2 would pass a model that never trains. The parameter metric cannot be that
# tight: Adam turns a rounding flip in a near-zero gradient into a full lr-sized step, so
# honest runs may differ by up to 2*lr per element per step plus an ulp (2^-8 bf16, 2^-11
# fp16); more than that (a wrong shard, a stale or garbled publish) is a bug.
LR, CLIP = 1e-3, 1.0
LOSS_TOL = {"bf16": 1e-3, "fp16": 5e-4}
ULP = {"bf16": 2.0**-8, "fp16": 2.0**-11}
FP16_SCALE = 1024.0  # fixed loss scale, the same for zerodp and the reference


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def batch(step, rank, cfg, rows, device):
    """Random tokens, the same for zerodp and the reference, different per rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def build(preset, device, born_sharded_cfg=None):
    # Both sides draw weights from seed 0 on the target device. A model born sharded (built
    # under zerodp.init, materialised on this rank's device by initialize) replays the same
    # reset_parameters() calls, so it gets the same values.
    torch.manual_seed(0)
    with zerodp.init(born_sharded_cfg) if born_sharded_cfg else torch.device(device):
        return GPT(preset)


def agree_max(value, device):
    """Max over ranks. The tensor lives on the compute device: NCCL cannot reduce CPU tensors."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Reference:
    """torch DDP over a compute-dtype copy, AdamW on an fp32 master (tests/core_cases.py's
    train_reference), with the fixed loss scale zerodp uses for fp16."""

    def __init__(self, model, dtype, device, scale):
        self.scale = scale
        self.master = list(model.parameters())  # fp32, deduplicated (tied head counted once)
        self.compute = copy.deepcopy(model).to(dtype)
        self.ddp = DDP(self.compute, device_ids=[device.index] if device.type == "cuda" else None)
        self.opt = torch.optim.AdamW(self.master, lr=LR)

    def step(self, x, y):
        _, loss = self.ddp(x, y)
        (loss * self.scale).backward()
        master_step(self.master, self.compute, self.opt, self.scale)
        return loss.detach()


def master_step(master, compute, opt, scale=1.0):
    """The mixed-precision step of the references: the compute copy's gradients, unscaled, onto
    the fp32 masters; torch's clip; AdamW; the masters copied back into the compute copy."""
    for m, c in zip(master, compute.parameters()):
        m.grad = None if c.grad is None else c.grad.float() / scale
    torch.nn.utils.clip_grad_norm_(master, CLIP)
    opt.step()
    opt.zero_grad()
    compute.zero_grad()
    with torch.no_grad():
        for m, c in zip(master, compute.parameters()):
            c.copy_(m)


def zero_step(model, opt, x, y, torch_clip=False):
    _, loss = model(x, y)
    opt.backward(loss)
    if torch_clip:  # a DDP script's own clip: p.grad's handles answer it from the shards
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    else:
        opt.clip_grad_norm_(CLIP)  # a scalar all-reduce of the shards' norms
    opt.step()
    opt.zero_grad()
    return loss.detach()


def params_of(model):
    """{name: fp32 copy} of the full parameters (gathered at stage 3; a no-op below it)."""
    with zerodp.gathered_parameters(model):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def label(stage, born):
    return f"stage {stage}{' init' if born else ''}".ljust(12)


def make_zero(stage, precision, preset, device, born=False, **cfg_kwargs):
    cfg = zerodp.Config(stage=stage, mixed_precision=precision, unit_modules=(Block,) if stage == 3 else (),
                        **cfg_kwargs)
    model = build(preset, device, cfg if born else None)
    return zerodp.initialize(model, torch.optim.AdamW, cfg, lr=LR)


def check_case(stage, born, precision, args, device, tag="", torch_clip=False, **cfg_kwargs):
    rank, preset = dist.get_rank(), "tiny"
    scale = FP16_SCALE if precision == "fp16" else 1.0
    extra = {"loss_scale": FP16_SCALE} if precision == "fp16" else {}
    model, opt = make_zero(stage, precision, preset, device, born, **extra, **cfg_kwargs)
    ref = Reference(build(preset, device), zerodp.Config(mixed_precision=precision).compute_dtype, device, scale)
    cfg = model.config
    loss_diff = 0.0
    for step in range(args.steps):
        x, y = batch(step, rank, cfg, args.rows, device)
        a, b = zero_step(model, opt, x, y, torch_clip), ref.step(x, y)
        loss_diff = max(loss_diff, abs(float(a) - float(b)))
    # |a-b| / (1+|b|): relative for large elements, absolute near 0 (as tests/core_cases.py)
    mine, theirs = params_of(model), {n: p.detach().float() for n, p in ref.compute.named_parameters()}
    param_diff = max(float(((mine[n] - q).abs() / (1 + q.abs())).max()) for n, q in theirs.items())
    loss_diff, param_diff = agree_max(loss_diff, device), agree_max(param_diff, device)
    loss_tol, param_tol = LOSS_TOL[precision], 2 * LR * args.steps + ULP[precision]
    ok = loss_diff <= loss_tol and param_diff <= param_tol
    log(f"{label(stage, born)} {precision}{tag}  loss diff {loss_diff:.1e} (tol {loss_tol:.0e})  "
        f"param diff {param_diff:.1e} (tol {param_tol:.1e})  {'PASS' if ok else 'FAIL'}")
    return ok


def check_overflow_skip(stage, args, device):
    """The last rank's loss is inf: every rank must skip the step and halve the scale."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = make_zero(stage, "fp16", "tiny", device, loss_scale="dynamic", initial_loss_scale=FP16_SCALE)
    before = params_of(model)
    quiet, level = logging.getLogger("zerodp"), logging.getLogger("zerodp").level
    quiet.setLevel(logging.ERROR)  # its per-rank "skipping step" warning is expected here
    try:
        x, y = batch(0, rank, model.config, args.rows, device)
        _, loss = model(x, y)
        if rank == world - 1:
            loss = loss * float("inf")
        opt.backward(loss)
        opt.clip_grad_norm_(CLIP)  # inf norm: must not turn into nan parameters either
        opt.step()
        opt.zero_grad()
    finally:
        quiet.setLevel(level)
    after = params_of(model)
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    halved = opt.scaler.scale == FP16_SCALE / 2
    ok = agree_max(0.0 if unchanged and halved else 1.0, device) == 0.0
    log(f"{label(stage, False)} fp16  inf loss on rank {world - 1}: step skipped on every rank "
        f"(scale {FP16_SCALE:g} -> {opt.scaler.scale:g})  {'PASS' if ok else 'FAIL'}")
    return ok


def check_offload(stage, precision, args, device):
    """Config.offload_optimizer='host': pinned host masters, non-blocking copies both ways."""
    return check_case(stage, False, precision, args, device, tag=" host offload", offload_optimizer="host")


def check_param_offload(kind, args, device):
    """Config.offload_params: stage 3's shards in pinned host memory (or files), staged onto
    the device for each gather, reduced chunks copied back."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="zerodp-gpu-check-") as root:
        directory = [root]
        dist.broadcast_object_list(directory, src=0)  # one directory; each rank uses rank{r}/ in it
        return check_case(3, False, "bf16", args, device, tag=f" params on {kind}", offload_optimizer="host",
                          offload_params=kind, **({"offload_dir": directory[0]} if kind == "disk" else {}))


def check_delayed_update(args, device):
    """Config.delayed_update_after: the last step's host update on a thread, beside CUDA
    work; the parameters then lag it by one update, well inside the tolerance."""
    return check_case(2, False, "bf16", args, device, tag=" delayed update", offload_optimizer="host",
                      delayed_update_after=args.steps - 1)


def check_checkpoint_store(args, device):
    """Activation checkpoints in pinned host memory, copied back on a copy stream
    (activations_on_host), and with an even number of ranks tensor parallelism over pairs of
    them with Pa and Pa+cpu: each bit for bit the run without (stage 3, bf16, every block
    checkpointed). One GPU checks the host copies; two or more also the tp axis on NCCL."""
    rank, world = dist.get_rank(), dist.get_world_size()
    variants = [("plain", 1, {}), ("on host", 1, {"activations_on_host": True})]
    if world % 2 == 0:
        variants += [("tp 2", 2, {}), ("tp 2 Pa", 2, {"partition_activations": True}),
                     ("tp 2 Pa+cpu", 2, {"partition_activations": True, "activations_on_host": True})]
    runs = {}
    for name, tp, extra in variants:
        cfg = zerodp.Config(stage=3, mixed_precision="bf16", unit_modules=(Block,), tensor_parallel_size=tp, **extra)
        model = build("tiny", device)
        model.gradient_checkpointing_enable()
        model, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=LR)
        losses = [float(zero_step(model, opt, *batch(step, rank // tp, model.config, args.rows, device)))
                  for step in range(args.steps)]
        runs[name] = (losses, params_of(model))

    def same(a, b):
        return runs[a][0] == runs[b][0] and all(torch.equal(runs[a][1][n], runs[b][1][n]) for n in runs[a][1])
    checks = [("on host", "plain")] + ([("tp 2 Pa", "tp 2"), ("tp 2 Pa+cpu", "tp 2")] if world % 2 == 0 else [])
    ok = agree_max(float(not all(same(a, b) for a, b in checks)), device) == 0.0
    log(f"checkpoint store: {', '.join(f'{a} = {b}' for a, b in checks)} bit for bit  {'PASS' if ok else 'FAIL'}")
    return ok


def check_quantize_kernels(args, device):
    """ZeRO++'s blockwise int8/int4 round trip on the device, within max|block| / (2 qmax)."""
    from zerodp.distributed.quantized import dequantize, quantize

    x = torch.randn(3, 5000, device=device, generator=torch.Generator(device).manual_seed(0))
    ok = True
    for bits in (8, 4):
        y = dequantize(quantize(x, bits, 256), 5000, bits, 256)
        pad = torch.nn.functional.pad(x.abs(), (0, (-5000) % 256)).view(3, -1, 256).amax(2, keepdim=True)
        bound = pad.expand(-1, -1, 256).reshape(3, -1)[:, :5000] / (2 * (2 ** (bits - 1) - 1))
        ratio = float(((y - x).abs() / bound).max())
        ok = ok and ratio <= 1 + 1e-4 and y.device == x.device
        log(f"quantize int{bits}  error / bound {ratio:.4f}  {'PASS' if ratio <= 1 + 1e-4 else 'FAIL'}")
    return ok


def peak_and_reset(device):
    """Peak memory since the last call, GiB: CUDA allocator peak, or the process's max RSS
    on CPU (cumulative over the process's life, so the second number includes the first)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def bench(args, device):
    """Median step time and peak memory: stage 3 bf16 (model built whole, then sharded, so
    its peak includes that transient full copy) vs DDP with the reference's bf16 recipe."""
    rank, preset = dist.get_rank(), args.bench_model
    cfg = gpt_config(preset)
    x, y = batch(0, rank, cfg, args.bench_rows, device)
    results = []
    for name in ("stage3", "ddp"):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        peak_and_reset(device)
        if name == "stage3":
            model, opt = make_zero(3, "bf16", preset, device)
            run = lambda: zero_step(model, opt, x, y)  # noqa: E731
        else:
            base = build(preset, device)
            nparams = base.num_params()
            ref, base = Reference(base, torch.bfloat16, device, 1.0), None
            run = lambda: ref.step(x, y)  # noqa: E731
        times = []
        for i in range(args.bench_steps + 2):  # 2 warm-up steps (allocator, NCCL setup)
            sync(device)
            t0 = time.perf_counter()
            run()
            sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        results.append((statistics.median(times), peak_and_reset(device)))
        model = opt = ref = run = None  # free before the next variant
    (t3, m3), (td, md) = results
    mem = "peak mem" if device.type == "cuda" else "peak RSS (cumulative)"
    log(f"bench: {preset} ({nparams / 1e6:.2f}M params, {args.bench_rows}x{cfg.block_size} tokens/rank), "
        f"stage3 bf16 {t3:.3f} s/step, ddp {td:.3f} s/step, ratio {t3 / td:.2f}x, "
        f"{mem} {m3:.2f} GiB vs {md:.2f} GiB (rank 0)")


def check_compile(args, device):
    """Stage 3 bf16 with Config(compile_units=True) against the same run eagerly (docs/compile.md):
    parity on the tiny GPT (AdamW's rounding-independent bound, as check_case), then the median
    step time of both on the benchmark model (the first, compiling, step left out)."""
    rank = dist.get_rank()
    runs = {}
    for compiled in (False, True):
        model, opt = make_zero(3, "bf16", "tiny", device, compile_units=compiled)
        losses = [float(zero_step(model, opt, *batch(step, rank, model.config, args.rows, device)))
                  for step in range(args.steps)]
        runs[compiled] = (losses, params_of(model))
    (le, pe), (lc, pc) = runs[False], runs[True]
    loss_diff = agree_max(max(abs(a - b) for a, b in zip(lc, le)), device)
    param_diff = agree_max(max(float(((pc[n] - q).abs() / (1 + q.abs())).max()) for n, q in pe.items()), device)
    loss_tol, param_tol = LOSS_TOL["bf16"], 2 * LR * args.steps + ULP["bf16"]
    ok = loss_diff <= loss_tol and param_diff <= param_tol
    times = {}
    for compiled in (False, True):
        model, opt = make_zero(3, "bf16", args.bench_model, device, compile_units=compiled)
        x, y = batch(0, rank, model.config, args.bench_rows, device)
        steps = []
        for i in range(args.bench_steps + 2):  # the first compiles; 2 warm-up steps left out
            sync(device)
            t0 = time.perf_counter()
            zero_step(model, opt, x, y)
            sync(device)
            steps.append(time.perf_counter() - t0)
        times[compiled] = (statistics.median(steps[2:]), steps[0])
        model = opt = None
    (te, fe), (tc, fc) = times[False], times[True]
    log(f"stage 3 bf16 compile_units  loss diff {loss_diff:.1e} (tol {loss_tol:.0e})  param diff {param_diff:.1e} "
        f"(tol {param_tol:.1e})  {args.bench_model}: eager {te:.3f} s/step, compiled {tc:.3f} s/step "
        f"({tc / te:.2f}x; first step {fc:.1f} s vs {fe:.1f} s)  {'PASS' if ok else 'FAIL'}")
    return ok


def check_dcp_round_trip(stage, precision, args, device):
    """torch.distributed.checkpoint through get_state_dict/set_state_dict (DTensors on this
    device's mesh): a fresh model loaded at step 2 then equals the run that went straight on."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = dist.get_rank()
    where = [tempfile.mkdtemp(prefix="zerodp_gpu_check_") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    torch.manual_seed(0)
    model, opt = make_zero(stage, precision, "tiny", device)
    cfg = model.config
    for step in range(2):
        zero_step(model, opt, *batch(step, rank, cfg, args.rows, device))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where[0])
    for step in range(2, 4):
        zero_step(model, opt, *batch(step, rank, cfg, args.rows, device))
    straight = params_of(model)
    torch.manual_seed(1)
    fresh, fopt = make_zero(stage, precision, "tiny", device)
    msd, osd = get_state_dict(fresh, fopt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=where[0])
    set_state_dict(fresh, fopt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(2, 4):
        zero_step(fresh, fopt, *batch(step, rank, cfg, args.rows, device))
    resumed = params_of(fresh)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where[0], ignore_errors=True)
    ok = agree_max(0.0 if all(torch.equal(straight[n], resumed[n]) for n in straight) else 1.0, device) == 0.0
    log(f"{label(stage, False)} {precision}  DCP save at step 2, load into a fresh model: steps 3-4 "
        f"bit for bit  {'PASS' if ok else 'FAIL'}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cpu", action="store_true", help="run on CPU with gloo (logic check without a GPU)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=4, help="sequences per rank per step in the checks")
    ap.add_argument("--bench-model", default=None, help="GPT preset for the benchmark (default 120m, tiny on --cpu)")
    ap.add_argument("--bench-rows", type=int, default=8)
    ap.add_argument("--bench-steps", type=int, default=10)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a collective may wait (a hang fails fast)")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible (use --cpu to check the logic on CPU)")
    args.bench_model = args.bench_model or ("tiny" if args.cpu else "120m")
    zerodp.init_distributed(backend="gloo" if args.cpu else None, timeout_s=args.timeout)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    log(f"gpu_check: {dist.get_world_size()} ranks, backend {dist.get_backend()}, device {device.type}, "
        f"torch {torch.__version__}")
    # Stage 3 twice: a model built whole and passed in, and one born sharded under
    # zerodp.init (README's way), so a failure says which of the two paths broke.
    variants = [(0, False), (1, False), (2, False), (3, False), (3, True)]
    cases = [(f"{label(s, b)} {p}", check_case, s, b, p) for s, b in variants for p in ("bf16", "fp16")]
    cases += [(f"{label(s, False)} {p} torch clip", lambda s, p, a, d: check_case(s, False, p, a, d, tag=" torch clip",
                                                                               torch_clip=True), s, p)
              for s in (1, 3) for p in ("bf16", "fp16")]
    cases += [(f"{label(s, False)} fp16 overflow", check_overflow_skip, s) for s in (0, 1, 2, 3)]
    cases += [(f"{label(s, False)} {p} DCP", check_dcp_round_trip, s, p) for s in (1, 3) for p in ("bf16", "fp16")]
    cases += [(f"{label(s, False)} {p} host offload", check_offload, s, p) for s in (2, 3) for p in ("bf16",)]
    cases += [(f"stage 3 bf16 params on {k}", check_param_offload, k) for k in ("host", "disk")]
    cases += [("stage 2 bf16 delayed update", check_delayed_update)]
    cases += [("quantize kernels", check_quantize_kernels)]
    cases += [("checkpoint store", check_checkpoint_store)]
    cases += [("stage 3 bf16 compile_units", check_compile)]
    # Imported here: gpu_check_parallel imports this module's helpers.
    from gpu_check_parallel import parallel_cases
    cases += parallel_cases(args)
    cases += [] if args.no_bench else [("bench", bench)]
    results = []
    for name, fn, *fn_args in cases:
        # An error raised alike on every rank (the usual kind, e.g. a CPU tensor sent on an
        # NCCL group) fails this case and lets the others run; one raised on some ranks only
        # leaves the others waiting in a collective until the process group's timeout.
        try:
            results.append(fn(*fn_args, args, device) is not False)
        except Exception as e:  # noqa: BLE001 - reported and counted as a failure
            print(f"{name}  ERROR on rank {dist.get_rank()}: {type(e).__name__}: {e}", flush=True)
            results.append(False)
    failed = results.count(False)
    log("gpu_check: ALL PASS" if failed == 0 else f"gpu_check: {failed} FAILED")
    zerodp.shutdown_distributed()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
