"""Cases for stages 0-2 (test_core.py), one per call in the session's worlds (worldpool.py).

Each case returns plain numbers; the tests assert on them in the parent process.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from parity import StepTrace

import zerodp
from zerodp.memory import formula_bytes

STEPS = 5
SMALL_BUCKET = 256  # bytes: 64 fp32 elements, so the 171-element model spans several buckets


class Net(nn.Module):
    """171 trainable elements: odd, so never divisible by the world size."""

    def __init__(self, frozen: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(7, 11)
        self.norm = nn.LayerNorm(11)
        self.fc2 = nn.Linear(11, 5)
        self.scale = nn.Parameter(torch.ones(1))
        self.frozen = nn.Linear(5, 5) if frozen else None
        if frozen:
            self.frozen.requires_grad_(False)

    def forward(self, x):
        y = self.fc2(torch.tanh(self.norm(self.fc1(x)))) * self.scale
        return self.frozen(y) if self.frozen is not None else y


class Tiny(nn.Module):
    """Fewer elements (3) than ranks at world size 4."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, x):
        return (x[:, :3] * self.w).sum(1, keepdim=True).expand(-1, 5)


def adamw_two_groups(params):
    params = list(params)
    return torch.optim.AdamW([
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 5e-3},
    ], lr=1e-2)


class CountingAdamW(torch.optim.AdamW):
    """AdamW that counts the calls of its step."""

    calls: list = []

    def step(self, closure=None):
        CountingAdamW.calls.append(1)
        return super().step(closure)


def sgd_momentum(params):
    return torch.optim.SGD(list(params), lr=0.05, momentum=0.9)


OPTIMIZERS = {"adamw": adamw_two_groups, "sgd": sgd_momentum}


def batch(step: int, rank: int, micro: int = 0, rows: int = 4):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(rows, 7, generator=g)
    y = torch.randn(rows, 5, generator=g)
    return x, y


def loss_fn(out, y):
    return (out.float() - y).pow(2).mean()


def mlp_loss(model, step, rank, dtype=torch.float32):
    x, y = batch(step, rank)
    return loss_fn(model(x.to(dtype)), y)


def train_reference(model_fn, opt_fn, dtype, rank, steps=STEPS, clip=None, loss_of=mlp_loss, set_to_none=True,
                    trace=None, **ddp_kwargs):
    """torch DDP + the same optimizer; for bf16/fp16, DDP over a low-precision copy with
    an fp32 master updated by the optimizer (the mixed-precision recipe zerodp follows).
    `trace` (parity.StepTrace) records the gradients and parameters of every step."""
    torch.manual_seed(0)
    model = model_fn()
    losses, norms = [], []
    if dtype == torch.float32:
        ddp, master_params = DDP(model, **ddp_kwargs), None
        opt = opt_fn(model.parameters())
    else:
        compute = copy.deepcopy(model)
        with torch.no_grad():  # parameters take the compute dtype, buffers keep theirs
            for p in compute.parameters():
                p.data = p.data.to(dtype)
        ddp = DDP(compute, **ddp_kwargs)
        master_params = [p for p in model.parameters() if p.requires_grad]
        opt = opt_fn(master_params)
    for step in range(steps):
        loss = loss_of(ddp, step, rank, dtype)
        loss.backward()
        if master_params is not None:
            trainable = [p for p in ddp.module.parameters() if p.requires_grad]
            for m, c in zip(master_params, trainable):
                m.grad = None if c.grad is None else c.grad.float()
        if trace is not None:
            trace.record_grads(ddp.module)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(
                master_params if master_params is not None else ddp.module.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        ddp.module.zero_grad(set_to_none=set_to_none)
        if master_params is not None:
            with torch.no_grad():
                for m, c in zip(master_params, [p for p in ddp.module.parameters() if p.requires_grad]):
                    c.copy_(m)
        losses.append(float(loss.detach()))
        if trace is not None:
            trace.record_step(ddp.module, losses[-1])
    return ddp.module, losses, norms


def train_zerodp(model_fn, opt_fn, cfg, rank, steps=STEPS, clip=None, micro_batches=1, loss_of=None, trace=None):
    torch.manual_seed(0)
    with zerodp.init(cfg) if getattr(model_fn, "born_sharded", False) else _nothing():
        model = model_fn()
    model, opt = zerodp.initialize(model, opt_fn, cfg)
    losses, norms, volumes = [], [], []
    for step in range(steps):
        total = 0.0
        for micro in range(micro_batches):
            if loss_of is not None:
                loss = (loss_of(model, step, rank) if micro_batches == 1
                        else loss_of(model, step, rank, micro=micro, micro_batches=micro_batches))
                opt.backward(loss)
                total += float(loss.detach())
                continue
            x, y = batch(step, rank)
            if micro_batches > 1:  # the step's batch, cut into micro-batches
                x, y = x[micro::micro_batches], y[micro::micro_batches]
            loss = loss_fn(model(x), y)
            opt.backward(loss)
            total += float(loss.detach()) / micro_batches
        if trace is not None:  # only stage 0's .grad is the whole reduced gradient (parity.py)
            trace.record_grads(model, exposed=cfg.stage == 0)
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
        if trace is not None:
            trace.record_step(model, total)
        volumes.append(opt.comm.ledger.summary())
    return model, opt, losses, norms, volumes


def _nothing():
    return contextlib.nullcontext()


def max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest |a-b| / (1 + |b|) over every element of every parameter, by name, in fp32:
    relative for elements above 1, absolute below. Purely relative error is meaningless
    for elements near 0 (zero-initialised biases, whose Adam steps follow gradients that
    are rounding noise), and absolute error for large ones."""
    worst = 0.0
    theirs = dict(b.named_parameters())
    for n, p in a.named_parameters():
        q = theirs[n].detach().float()
        worst = max(worst, float(((p.detach().float() - q).abs() / (1 + q.abs())).max()))
    return worst


PARITY_GRID = [(stage, precision, opt) for stage in (0, 1, 2) for precision in ("fp32", "bf16")
               for opt in OPTIMIZERS]


def parity_case(rank, world_size, stage, precision, opt_name):
    """One stage x dtype x optimizer against DDP, compared at every step (parity.py)."""
    cfg = zerodp.Config(stage=stage, mixed_precision=precision, bucket_bytes=SMALL_BUCKET)
    ref_trace, trace = StepTrace(), StepTrace()
    train_reference(Net, OPTIMIZERS[opt_name], cfg.compute_dtype, rank, trace=ref_trace)
    model, opt, _, _, volumes = train_zerodp(Net, OPTIMIZERS[opt_name], cfg, rank, trace=trace)
    return {"per_step": trace.compare(ref_trace), "volume": volumes[-1]["volume_numel"],
            "by_op": volumes[-1]["by_op"], "memory": opt.memory_report().as_dict(),
            "names": list(model.state_dict().keys())}


def frozen_case(rank, world_size):
    """Frozen parameters: left alone (not sharded, not updated), the rest equal DDP."""
    cfg = zerodp.Config(stage=2, bucket_bytes=SMALL_BUCKET)
    frozen_model = lambda: Net(frozen=True)  # noqa: E731
    ref, _, _ = train_reference(frozen_model, adamw_two_groups, torch.float32, rank)
    model, opt, *_ = train_zerodp(frozen_model, adamw_two_groups, cfg, rank)
    torch.manual_seed(0)
    initial_frozen = Net(frozen=True).frozen.weight.detach().clone()
    return {"rel_diff": max_rel_diff(model, ref),
            "frozen_unchanged": bool(torch.equal(model.frozen.weight, initial_frozen)),
            "numel": opt.memory_report().numel}


def tiny_case(rank, world_size, stage):
    """A model with fewer elements than ranks."""
    ref_trace, trace = StepTrace(), StepTrace()
    train_reference(Tiny, sgd_momentum, torch.float32, rank, trace=ref_trace)
    train_zerodp(Tiny, sgd_momentum, zerodp.Config(stage=stage), rank, trace=trace)
    return trace.compare(ref_trace)


ACCUMULATION_GRID = [(0, True), (1, True), (2, True), (2, False)]


def accumulation_case(rank, world_size, stage, each):
    """Accumulation over 2 micro-batches equals one step on the whole batch; stage 2 either
    reduces each micro-batch (default) or keeps unsharded gradients until the boundary."""
    cfg = zerodp.Config(stage=stage, grad_accumulation_steps=2, bucket_bytes=SMALL_BUCKET,
                        reduce_each_micro_batch=each)
    ref, *_ = train_reference(Net, adamw_two_groups, torch.float32, rank)
    model, opt, _, _, volumes = train_zerodp(Net, adamw_two_groups, cfg, rank, micro_batches=2)
    return {"rel_diff": max_rel_diff(model, ref), "volume": volumes[-1]["volume_numel"],
            "by_op": volumes[-1]["by_op"]}


def clip_case(rank, world_size, stage):
    """Clipping: the same total norm as clip_grad_norm_ on DDP, and the same parameters."""
    cfg = zerodp.Config(stage=stage, bucket_bytes=SMALL_BUCKET)
    ref, _, ref_norms = train_reference(Net, adamw_two_groups, torch.float32, rank, clip=0.05)
    model, _, _, norms, _ = train_zerodp(Net, adamw_two_groups, cfg, rank, clip=0.05)
    return {"norms": norms, "ref_norms": ref_norms, "rel_diff": max_rel_diff(model, ref)}


def reduce_fp32_case(rank, world_size, stage):
    """Reducing bf16 gradients in fp32 (reduce_dtype): the same result within bf16 rounding,
    and the stage-2 gradient shard held in fp32 (4 bytes per element)."""
    cfg = zerodp.Config(stage=stage, mixed_precision="bf16", reduce_dtype="fp32", bucket_bytes=SMALL_BUCKET)
    ref, *_ = train_reference(Net, adamw_two_groups, torch.bfloat16, rank)
    model, opt, *_ = train_zerodp(Net, adamw_two_groups, cfg, rank)
    rep = opt.memory_report()
    return {"rel_diff": max_rel_diff(model, ref), "grads": rep.grads, "padded": rep.padded_numel}


def scheduler_case(rank, world_size):
    """An LR scheduler drives the returned optimizer; a step before any backward is refused."""
    model, opt = zerodp.initialize(Net(), torch.optim.SGD, zerodp.Config(stage=1), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = batch(0, rank)
    opt.backward(loss_fn(model(x), y))
    opt.step()
    sched.step()
    return {"lr_after_sched": opt.param_groups[0]["lr"], "step_without_backward": _error_of(lambda: opt.step())}


def chunked_step_case(rank, world_size):
    """The user's optimizer steps a bucket's worth of master at a time (its temporaries stay
    bucket-sized), and after the first step its states live in one buffer per shard and key."""
    cfg = zerodp.Config(stage=2, bucket_bytes=SMALL_BUCKET)
    model, opt, *_ = train_zerodp(Net, lambda ps: CountingAdamW(list(ps), lr=1e-3), cfg, rank, steps=1)
    CountingAdamW.calls.clear()
    x, y = batch(1, rank)
    opt.backward(loss_fn(model(x), y))
    opt.step()
    calls = list(CountingAdamW.calls)
    # Step hooks, global ones too, run once per step however many buckets the step takes.
    model, opt, *_ = train_zerodp(Net, lambda ps: torch.optim.AdamW(list(ps), lr=1e-3), cfg, rank, steps=1)
    outer_calls = []
    handles = [opt.register_step_pre_hook(lambda *args: outer_calls.append("pre")),
               opt.register_step_post_hook(lambda *args: outer_calls.append("post")),
               register_optimizer_step_pre_hook(lambda *args: outer_calls.append("global pre")),
               register_optimizer_step_post_hook(lambda *args: outer_calls.append("global post"))]
    x, y = batch(1, rank)
    opt.backward(loss_fn(model(x), y))
    opt.step()
    for h in handles:
        h.remove()
    masters = [t for g in opt.inner.param_groups for t in g["params"]]
    return {
        "inner_calls": len(calls), "pieces": len(masters), "hooks": outer_calls,
        "master_bytes": sum(t.numel() * t.element_size() for t in masters),
        "state_storages": {k: len({opt.state[t][k].untyped_storage().data_ptr() for t in masters})
                           for k in ("exp_avg", "exp_avg_sq")},
        "shards": sum(len(g) for g in opt.stepper.shards)}


def fp16_overflow(rank, world_size):
    """A forced inf on one rank skips the step on every rank and halves the scale."""
    cfg = zerodp.Config(stage=2, mixed_precision="fp16", initial_loss_scale=1024.0, loss_scale_growth_interval=2)
    torch.manual_seed(0)
    model, opt = zerodp.initialize(Net(), adamw_two_groups, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batch(0, rank)
    loss = loss_fn(model(x), y)
    if rank == world_size - 1:
        loss = loss * float("inf")
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    scale_after_skip = opt.scaler.scale
    losses = []
    for step in range(1, 5):
        x, y = batch(step, rank)
        loss = loss_fn(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    return {"unchanged_after_skip": unchanged, "scale_after_skip": scale_after_skip,
            "scale_end": opt.scaler.scale, "changed_later": changed, "losses": losses,
            "skipped": opt.scaler.skipped_steps}


MEMORY_GRID = [(precision, stage) for precision in ("bf16", "fp32") for stage in (0, 1, 2)]


def memory_case(rank, world_size, precision, stage):
    """The memory ledger against the stage formula, AdamW."""
    pbytes, master, states = {"bf16": (2, 4, 8), "fp32": (4, 0, 8)}[precision]
    cfg = zerodp.Config(stage=stage, mixed_precision=precision, bucket_bytes=SMALL_BUCKET)
    model, opt, *_ = train_zerodp(Net, lambda ps: torch.optim.AdamW(list(ps), lr=1e-3), cfg, rank, steps=1)
    rep = opt.memory_report()
    expect = formula_bytes(stage, rep.padded_numel, world_size, pbytes, pbytes, master, states)
    return {"got": {k: getattr(rep, k) for k in expect}, "expect": expect, "numel": rep.numel,
            "padded": rep.padded_numel}


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # the test asserts on the type and message
        return f"{type(e).__name__}: {e}"
    return None
