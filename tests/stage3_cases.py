"""Stage 3 cases, run inside one spawned world per world size (see test_stage3.py)."""
from __future__ import annotations

import resource

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from parity import StepTrace

import zerodp
from core_cases import max_rel_diff, train_reference, train_zerodp
from zerodp.memory import formula_bytes
from zerodp.demo.models import GPT, Block, GPTConfig
from zerodp.sharding.flat_unit import UnitState

STEPS = 4


def gpt_tiny():
    return GPT("tiny")


def gpt_loss(model, step, rank, dtype=torch.float32, micro=0, micro_batches=1):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, 256, (2, 16), generator=g)[micro::micro_batches]
    _, loss = model(x, x)
    return loss


def adamw(params):
    params = list(params)
    return torch.optim.AdamW([
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ], lr=1e-3)


def adamw_no_decay(params):
    # A parameter no forward uses has grad None under DDP (AdamW skips it) and a zero
    # gradient in a flat shard (AdamW still decays it); without decay both leave it be.
    return torch.optim.AdamW(list(params), lr=1e-2, weight_decay=0.0)


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class HardBlock(nn.Module):
    """Nested unit, frozen parameters, an unused parameter, activation checkpointing, a buffer."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(8, 8)
        self.inner = Inner()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(8, 8)
        self.ckpt = nn.Linear(8, 8)
        self.register_buffer("running", torch.zeros(8))

    def forward(self, x):
        h = torch.tanh(self.lin1(x))
        h = self.inner(h)
        h = self.frozen(h)
        h = checkpoint(self.ckpt, h, use_reentrant=False)
        if self.training:
            with torch.no_grad():
                self.running.mul_(0.9).add_(0.1 * h.mean(0).float())
        return h


class HardNet(nn.Module):
    """Tied weights, a block called twice in one forward, nested units."""

    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(8, 8, bias=False)
        self.blocks = nn.ModuleList([HardBlock(), HardBlock()])
        self.proj_out = nn.Linear(8, 8, bias=False)
        self.proj_out.weight = self.proj_in.weight  # tied, HF style
        self.skip_block1 = False

    def forward(self, x):
        h = self.proj_in(x)
        h = self.blocks[0](h)
        if not self.skip_block1:
            h = self.blocks[1](h)
        h = self.blocks[0](h)  # the same unit again
        return self.proj_out(h)


def hard_loss(model, step, rank, dtype=torch.float32):
    """Two forward passes before one backward (halves of the batch)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(6, 8, generator=g)
    y = torch.randn(6, 8, generator=g)
    if isinstance(model, nn.parallel.DistributedDataParallel):  # DDP: one forward on both halves
        out = model(x.to(dtype)).float()
        return F.mse_loss(out[:3], y[:3]) + F.mse_loss(out[3:], y[3:])
    return F.mse_loss(model(x[:3]).float(), y[:3]) + F.mse_loss(model(x[3:]).float(), y[3:])


def branch_loss(model, step, rank, dtype=torch.float32):
    """Step 2 skips a block on every rank: units run in another order than recorded."""
    (model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model).skip_block1 = step == 2
    return hard_loss(model, step, rank, dtype)


HARD_UNITS = (HardBlock, "Inner")


def full_params(model, opt=None):
    """Every parameter's full value, by name (gathered at stage 3)."""
    with zerodp.gathered_parameters(model):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


class _Frozen(nn.Module):
    def __init__(self, values):
        super().__init__()
        for i, (n, v) in enumerate(values.items()):
            self.register_parameter(f"p{i}", nn.Parameter(v))


def rel(a: dict, b: dict) -> float:
    return max_rel_diff(_Frozen(a), _Frozen(b))


def gpt_case(rank, world_size, precision):
    """The tiny GPT at stage 3 against DDP and stage 2."""
    cfg3 = zerodp.Config(stage=3, mixed_precision=precision, unit_modules=[Block])
    dtype = cfg3.compute_dtype
    ref_trace, trace = StepTrace(), StepTrace()
    ref, *_ = train_reference(gpt_tiny, adamw, dtype, rank, steps=STEPS, loss_of=gpt_loss, trace=ref_trace)
    model, opt, losses, _, volumes = train_zerodp(gpt_tiny, adamw, cfg3, rank, steps=STEPS, loss_of=gpt_loss,
                                                  trace=trace)
    got = full_params(model)
    want = {n: p.detach().float() for n, p in ref.named_parameters()}
    cfg2 = zerodp.Config(stage=2, mixed_precision=precision)
    m2, opt2, *_ = train_zerodp(gpt_tiny, adamw, cfg2, rank, steps=STEPS, loss_of=gpt_loss)
    stage2 = {n: p.detach().float() for n, p in m2.named_parameters()}
    rep = opt.memory_report()
    units = opt.stage3.units
    return {
        "vs_ddp": rel(got, want), "vs_stage2": rel(got, stage2), "per_step": trace.compare(ref_trace),
        "volume": volumes[-1]["volume_numel"], "by_op": volumes[-1]["by_op"],
        "padded": rep.padded_numel, "numel": rep.numel,
        "memory": {k: getattr(rep, k) for k in ("params", "grads", "master", "optimizer_states")},
        "expect": formula_bytes(3, rep.padded_numel, world_size, dtype.itemsize, dtype.itemsize,
                                0 if precision == "fp32" else 4, 8),
        "peak": rep.gathered_params_peak,
        "root_nbytes": units[-1].full_nbytes, "max_unit_nbytes": max(u.full_nbytes for u in units[:-1]),
        "unit_names": [u.name for u in units],
        "local_numel": sum(p.numel() for p in model.parameters()),
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        # The tied embedding is laid out (and reduced, and updated) once at stage 2.
        "stage2_numel": opt2.memory_report().numel,
        "stage2_tied": m2.lm_head.weight is m2.transformer.wte.weight,
        "distinct_numel": sum(p.numel() for p in gpt_tiny().parameters()),
    }


def accumulation_case(rank, world_size, each):
    """Accumulation over 2 micro-batches equals one step on both; by default each micro-batch
    is reduce-scattered into the shard, with reduce_each_micro_batch=False only the last."""
    ref, *_ = train_reference(gpt_tiny, adamw, torch.float32, rank, steps=STEPS, loss_of=gpt_loss)
    cfg = zerodp.Config(stage=3, unit_modules=[Block], grad_accumulation_steps=2, reduce_each_micro_batch=each)
    model, opt, _, _, volumes = train_zerodp(gpt_tiny, adamw, cfg, rank, steps=STEPS, loss_of=gpt_loss,
                                             micro_batches=2)
    return {"vs_ddp": rel(full_params(model), {n: p.detach().float() for n, p in ref.named_parameters()}),
            "reduce_scatter": volumes[-1]["by_op"].get("reduce_scatter/backward"),
            "padded": opt.memory_report().padded_numel}


def no_reshard_case(rank, world_size):
    """reshard_after_forward=False: the forward's gathers stay until backward: 2Ψ."""
    cfg = zerodp.Config(stage=3, unit_modules=[Block], reshard_after_forward=False)
    model, opt, _, _, volumes = train_zerodp(gpt_tiny, adamw, cfg, rank, steps=2, loss_of=gpt_loss)
    return {"volume": volumes[-1]["volume_numel"], "padded": opt.memory_report().padded_numel}


def hard_case(rank, world_size, precision):
    """Unused, frozen and tied parameters, a buffer, nested units, eval: against DDP."""
    cfg = zerodp.Config(stage=3, mixed_precision=precision, unit_modules=HARD_UNITS)
    dtype = cfg.compute_dtype
    ref, *_ = train_reference(HardNet, adamw_no_decay, dtype, rank, steps=STEPS, loss_of=hard_loss,
                              find_unused_parameters=True)
    model, opt, *_ = train_zerodp(HardNet, adamw_no_decay, cfg, rank, steps=STEPS, loss_of=hard_loss)
    got = full_params(model)
    want = {n: p.detach().float() for n, p in ref.named_parameters()}
    torch.manual_seed(0)
    init = {n: p.detach().float() for n, p in HardNet().named_parameters()}
    # eval + no_grad: same outputs as the reference, no gradients, every unit freed after.
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    model.eval()
    ref.eval()
    with torch.no_grad():
        y = model(x)
        y_ref = ref(x.to(dtype))
    return {
        "vs_ddp": rel(got, want),
        "unused_unchanged": bool(torch.equal(got["blocks.0.unused.weight"],
                                             init["blocks.0.unused.weight"].to(dtype).float())),
        "frozen_unchanged": bool(torch.equal(got["blocks.1.frozen.weight"].to(dtype).float(),
                                             init["blocks.1.frozen.weight"].to(dtype).float())),
        "eval_rel": float((y.float() - y_ref.float()).norm() / y_ref.float().norm()),
        # Every gathered buffer went back to the pool; parameters are 1-D shard views again.
        "all_freed": all(u.state is UnitState.SHARDED and u.full is None for u in opt.stage3.units)
        and all(p.ndim == 1 for p in model.parameters() if p.requires_grad)
        and sum(b.numel() * b.element_size() for b in opt.stage3.pool.free) == opt.stage3.pool.allocated_nbytes,
        "no_grads": all(p.grad is None for p in model.parameters()),
        # Buffers stay replicated, full and updated in place by forward.
        "buffer_ok": tuple(model.blocks[0].running.shape) == (8,) and bool(model.blocks[0].running.abs().sum() > 0),
        "units": [u.name for u in opt.stage3.units],
        "outer": [u.outer for u in opt.stage3.units],
        "tied": model.proj_out.weight is model.proj_in.weight,
    }


def branch_case(rank, world_size):
    # A later step takes another branch than the recorded order: prefetch follows the record,
    # the result still equals DDP's, and nothing hangs. A unit skipped in a step has no
    # gradient and is not stepped, as DDP's after zero_grad() (set_to_none=True).
    cfg = zerodp.Config(stage=3, unit_modules=HARD_UNITS)
    ref, *_ = train_reference(HardNet, adamw_no_decay, torch.float32, rank, steps=STEPS, loss_of=branch_loss,
                              find_unused_parameters=True)
    model, opt, *_ = train_zerodp(HardNet, adamw_no_decay, cfg, rank, steps=STEPS, loss_of=branch_loss)
    return rel(full_params(model), {n: p.detach().float() for n, p in ref.named_parameters()})


def gathered_and_born(rank, world_size):
    out = {}
    # Born sharded: the same initial values as eager construction with the same seed.
    torch.manual_seed(0)
    eager = GPT("tiny")
    cfg = zerodp.Config(stage=3, unit_modules=[Block])
    torch.manual_seed(0)
    with zerodp.init(cfg):
        meta = GPT("tiny")
    out["meta_before"] = all(p.is_meta for p in meta.parameters())
    model, opt = zerodp.initialize(meta, torch.optim.SGD, cfg, lr=0.1)
    got = full_params(model)
    out["born_equal"] = all(torch.equal(got[n], p.detach()) for n, p in eager.named_parameters())
    out["born_tied"] = model.lm_head.weight is model.transformer.wte.weight
    # gathered_parameters(modify=True): a custom init written back to the shards.
    with zerodp.gathered_parameters(model.transformer.h[0], modify=True, optimizer=opt):
        full_shape = tuple(model.transformer.h[0].mlp.c_fc.weight.shape)
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight.fill_(0.25 + rank)  # rank 0's value wins
    got = full_params(model)
    out["modify_full_shape"] = full_shape
    out["modify_applied"] = bool((got["transformer.h.0.mlp.c_fc.weight"] == 0.25).all())
    out["shard_shape_after"] = tuple(model.transformer.h[0].mlp.c_fc.weight.shape)
    return out


def debug_divergence(rank, world_size):
    """Ranks run different units: debug mode names the unit and the ranks instead of hanging."""
    cfg = zerodp.Config(stage=3, unit_modules=HARD_UNITS, debug=True)
    torch.manual_seed(0)
    model, opt = zerodp.initialize(HardNet(), adamw_no_decay, cfg)
    model.skip_block1 = rank == world_size - 1
    try:
        loss = hard_loss(model, 0, rank)
        opt.backward(loss)
    except RuntimeError as e:
        return str(e)
    return None


def outer_unit_buffers(rank, world_size):
    """A GPT whose root (a large tied embedding) dwarfs its blocks: the root's gradients
    come at both ends of backward, so they are taken when it is done, into the buffer its
    gathered parameters just gave back, rather than a second root-sized buffer held
    through the whole backward."""
    big_vocab = lambda: GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=2, n_head=2, n_embd=32))  # noqa: E731

    def loss_of(model, step, rank, dtype=torch.float32):
        x = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
        return model(x, x)[1]

    cfg = zerodp.Config(stage=3, unit_modules=[Block])
    ref, *_ = train_reference(big_vocab, adamw, torch.float32, rank, steps=2, loss_of=loss_of)
    model, opt, *_ = train_zerodp(big_vocab, adamw, cfg, rank, steps=2, loss_of=loss_of)
    units = opt.stage3.units
    return {"vs_ddp": rel(full_params(model), {n: p.detach().float() for n, p in ref.named_parameters()}),
            "outer": [u.outer for u in units], "pool_nbytes": opt.stage3.pool.allocated_nbytes,
            "root_nbytes": units[-1].full_nbytes, "max_unit_nbytes": max(u.full_nbytes for u in units[:-1])}


class Wide(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.inp = nn.Linear(width, width, bias=False)
        self.layers = nn.ModuleList([nn.Linear(width, width, bias=False) for _ in range(layers)])


def big_model_world(rank, world_size, width, layers):
    """A model of >= 0.75 GiB of fp32 weights, born sharded: what building it adds to a rank's
    peak RSS stays far below the model (the interpreter and torch come before: `base`)."""
    cfg = zerodp.Config(stage=3, unit_modules=[nn.Linear])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    with zerodp.init(cfg):
        model = Wide(width, layers)
    full_nbytes = sum(p.numel() * 4 for p in model.parameters())
    model, opt = zerodp.initialize(model, torch.optim.SGD, cfg, lr=0.1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"full_nbytes": full_nbytes, "peak_rss": peak, "base_rss": base, "shard_nbytes": opt.memory_report().params}
