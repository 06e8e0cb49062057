"""Paths real training loops take, each against DDP (or a stated error): run inside one
spawned world per world size (see test_trust.py). Cases return plain data."""
from __future__ import annotations

import dataclasses
import gc

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.checkpoint import checkpoint

import zerodp
from core_cases import SMALL_BUCKET, Net, _error_of, batch, loss_fn, max_rel_diff, train_reference, train_zerodp
from stage3_cases import full_params, gpt_loss, gpt_tiny, rel
from zerodp.memory import Census, formula_bytes, live_tensor_storages, walk_tensors
from zerodp.demo.models import Block

STEPS = 4


def sgd(params):
    # Plain SGD: its step is proportional to the gradient, so a wrong scale (a missing /N or
    # /k, a loss scale not undone) moves parameters by as much as the step itself.
    return torch.optim.SGD(list(params), lr=0.05)


def adamw(params):
    return torch.optim.AdamW(list(params), lr=1e-2, weight_decay=0.1)


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in backward")


class Blk(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Stack(nn.Module):
    """Blocks with a point where backward can be made to raise halfway through."""

    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(7, width)
        self.blocks = nn.ModuleList([Blk(width) for _ in range(depth)])
        self.out = nn.Linear(width, 5)
        self.fail = False
        self.reentrant = None  # None: no checkpointing; True/False: use_reentrant of the middle blocks

    def forward(self, x):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            if self.reentrant is not None and 0 < i < len(self.blocks) - 1:
                h = checkpoint(b, h, use_reentrant=self.reentrant)
            else:
                h = b(h)
            if self.fail and i == len(self.blocks) // 2:
                h = _Raise.apply(h)  # the blocks after it have their gradients, those before do not
        return self.out(h)


def stack_cfg(stage: int, **kw) -> zerodp.Config:
    return zerodp.Config(stage=stage, bucket_bytes=SMALL_BUCKET, unit_modules=(Blk,) if stage == 3 else (), **kw)


def failed_backward(rank, world_size):
    """Step 1's backward raises halfway; the loop catches it, calls zero_grad and goes on.
    The result equals DDP that skipped batch 1; the engine holds nothing of the failed pass."""
    out = {}
    # AdamW at N = 2 only: SGD, the scale-sensitive one, carries the check at N = 4.
    optimizers = (("sgd", sgd), ("adamw", adamw)) if world_size <= 2 else (("sgd", sgd),)
    for stage in (0, 1, 2, 3):
        for opt_name, opt_fn in optimizers:
            ref = _reference_skipping(opt_fn, rank, skip=1)
            torch.manual_seed(0)
            model, opt = zerodp.initialize(Stack(), opt_fn, stack_cfg(stage))
            caught, forgot = None, None
            for step in range(STEPS):
                x, y = batch(step, rank)
                model.fail = step == 1
                loss = loss_fn(model(x), y)
                try:
                    opt.backward(loss)
                except RuntimeError as e:
                    caught = str(e)
                    model.fail = False
                    # Forgetting zero_grad is named, not silently mixed into the next step.
                    forgot = _error_of(lambda: model(x))
                    opt.zero_grad()
                    continue
                opt.step()
                opt.zero_grad()
            rec = {"caught": caught, "forgot": forgot, "vs_ddp": vs(model, ref)}
            if stage == 3:
                pool = opt.stage3.pool
                rec["all_freed"] = (all(u.full is None and u.grad_full is None for u in opt.stage3.units)
                                    and sum(b.numel() * b.element_size() for b in pool.free) == pool.allocated_nbytes)
            out[(stage, opt_name)] = rec
    return out


def _reference_skipping(opt_fn, rank, skip):
    """DDP's side of failed_backward: batch `skip` is dropped, with no step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Stack()
    ddp = DDP(model)
    opt = opt_fn(model.parameters())
    for step in range(STEPS):
        if step == skip:
            continue
        x, y = batch(step, rank)
        loss_fn(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def vs(model, ref) -> float:
    """max_rel_diff of a zerodp model's full parameters (gathered at stage 3) and a reference's."""
    return rel(full_params(model), {n: p.detach().float() for n, p in ref.named_parameters()})


def reentrant_checkpointing(rank, world_size):
    """torch.utils.checkpoint with use_reentrant=True runs a nested backward; both modes equal
    DDP without checkpointing (recomputation gives the same values)."""
    out = {}
    ref, *_ = train_reference(Stack, sgd, torch.float32, rank, steps=3)
    for stage in (0, 1, 2, 3):
        for reentrant in (True, False):
            def build(reentrant=reentrant):
                m = Stack()
                m.reentrant = reentrant
                return m
            model, opt, *_ = train_zerodp(build, sgd, stack_cfg(stage), rank, steps=3)
            out[(stage, reentrant)] = vs(model, ref)
    return out


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.tensor([1.001, 0.5]))

    def forward(self, x):
        return self.lin(x) * self.inv_freq[0]


def dtype_policy(rank, world_size):
    out = {}
    for stage in (2, 3):
        model, opt = zerodp.initialize(WithBuffer(), torch.optim.SGD, zerodp.Config(stage=stage, mixed_precision="bf16"),
                                       lr=0.1)
        out[f"buffer_stage{stage}"] = (str(model.inv_freq.dtype), float(model.inv_freq[0]))
        model.lin.bias.requires_grad_(False)  # frozen after initialize
        opt.backward(model(torch.ones(2, 4)).float().sum())
        out[f"frozen_late_stage{stage}"] = _error_of(opt.step)
    wide = WithBuffer()
    wide.lin.weight.data = wide.lin.weight.data.double()
    out["float64"] = _error_of(lambda: zerodp.initialize(wide, torch.optim.SGD, zerodp.Config(stage=2), lr=0.1))
    model, opt = zerodp.initialize(Net(), torch.optim.SGD, zerodp.Config(stage=2), lr=0.1)
    out["add_param_group"] = _error_of(lambda: opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]}))
    return out


def optimizer_probe(rank, world_size):
    """Which optimizers are accepted: by behaviour (elementwise or not), or by their declaration
    that they step whole parameters (Muon, Adafactor)."""
    out = {}
    candidates = {
        "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
        "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
        "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
        "LBFGS": lambda ps: torch.optim.LBFGS(ps),
        "Adafactor": lambda ps: torch.optim.Adafactor(ps),
        "Muon": lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2]),
    }
    for name, make in candidates.items():
        def build(make=make):
            model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
            if name == "Muon":  # Muon takes 2-D matrices only: biases frozen
                for m in model:
                    m.bias.requires_grad_(False)
            return zerodp.initialize(model, make, zerodp.Config(stage=2))
        out[name] = _error_of(build)
    return out


class Reversed(nn.Module):
    """Layers registered in the reverse of the order they run: the input layer last."""

    def __init__(self, depth: int = 12, width: int = 64):
        super().__init__()
        self.width = width
        for i in reversed(range(depth)):
            self.add_module(f"layer{i}", Blk(width))
        self.depth = depth

    def forward(self, x):
        for i in range(self.depth):
            x = getattr(self, f"layer{i}")(x)
        return x


def registration_order(rank, world_size):
    """Reductions follow the order backward really finishes, not registration order: the
    stage-3 pool stays a few units large instead of holding every unit's gradients."""
    out = {}
    width = 64

    def loss_of(model, step, r, dtype=torch.float32):
        g = torch.Generator().manual_seed(10 * step + r)
        return model(torch.randn(4, width, generator=g)).pow(2).mean()

    ref, *_ = train_reference(Reversed, sgd, torch.float32, rank, steps=3, loss_of=loss_of)
    model, opt, *_ = train_zerodp(Reversed, sgd, zerodp.Config(stage=3, unit_modules=(Blk,)), rank, steps=3,
                                  loss_of=loss_of)
    unit = opt.stage3.units[0]
    pool = opt.stage3.pool.allocated_nbytes  # before vs() gathers every unit at once
    out["stage3"] = {"vs_ddp": vs(model, ref), "pool": pool,
                     "unit_nbytes": unit.full_nbytes, "units": len(opt.stage3.units) - 1}
    bucket = (width * width + width) * 4  # one layer per bucket
    model, opt, *_ = train_zerodp(Reversed, sgd, zerodp.Config(stage=2, bucket_bytes=bucket), rank, steps=3,
                                  loss_of=loss_of)
    # Launch order after the first backward: buckets of layer5 (runs last, finishes backward
    # first) ... layer0; the flat layout starts with layer0 (registered last).
    out["stage2"] = {"vs_ddp": max_rel_diff(model, ref),
                     "launch_starts": [b.group.layout.segments[b.seg_index].start for b in opt.grad_sync.buckets]}
    return out


def born_with_rank_seeds(rank, world_size):
    cfg = zerodp.Config(stage=3, unit_modules=[Block])
    torch.manual_seed(1234 + rank)  # the data-loading habit, applied too early
    with zerodp.init(cfg):
        model = gpt_tiny()
    return _error_of(lambda: zerodp.initialize(model, torch.optim.SGD, cfg, lr=0.1))


def fp16_paths(rank, world_size):
    out = {}
    # Plain loss.backward() under a loss scale: refused at step, not divided silently.
    model, opt = zerodp.initialize(Net(), sgd, zerodp.Config(stage=2, mixed_precision="fp16"))
    x, y = batch(0, rank)
    loss_fn(model(x), y).backward()
    out["plain_backward"] = _error_of(opt.step)
    # With a loss scale of 1 there is nothing to undo: plain backward is fine.
    model, opt = zerodp.initialize(Net(), sgd, zerodp.Config(stage=2, mixed_precision="fp16", loss_scale=1.0))
    loss_fn(model(x), y).backward()
    out["plain_backward_scale1"] = _error_of(opt.step)
    # fp16 parity against DDP doing the same fixed-scale recipe by hand.
    for stage in (0, 1, 2, 3):
        cfg = zerodp.Config(stage=stage, mixed_precision="fp16", loss_scale=1024.0, bucket_bytes=SMALL_BUCKET,
                            unit_modules=(nn.Linear,) if stage == 3 else ())
        ref = _fp16_reference(rank)
        model, *_ = train_zerodp(Net, sgd, cfg, rank)
        out[("fp16", stage)] = vs(model, ref)
    return out


def _fp16_reference(rank, scale=1024.0, steps=5):
    """DDP over an fp16 copy, fp32 master, loss multiplied by `scale` and gradients divided;
    returns the fp16 copy (what zerodp's model holds)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    master = Net()
    compute = Net()
    compute.load_state_dict(master.state_dict())
    compute.half()
    ddp = DDP(compute)
    opt = sgd(master.parameters())
    for step in range(steps):
        x, y = batch(step, rank)
        (loss_fn(ddp(x.half()), y) * scale).backward()
        for m, c in zip(master.parameters(), compute.parameters()):
            m.grad = c.grad.float() / scale
        opt.step()
        opt.zero_grad()
        compute.zero_grad()
        with torch.no_grad():
            for m, c in zip(master.parameters(), compute.parameters()):
                c.copy_(m)
    return compute


def sgd_stage3_grid(rank, world_size):
    """Plain SGD at stage 3: accumulation in both modes, and bf16 reduced in fp32."""
    out = {}
    for precision, reduce_dtype in (("fp32", None), ("bf16", "fp32"), ("bf16", None)):
        dtype = zerodp.config.DTYPES[precision]
        ref, *_ = train_reference(gpt_tiny, sgd, dtype, rank, steps=STEPS, loss_of=gpt_loss)
        want = {n: p.detach().float() for n, p in ref.named_parameters()}
        for k, each in ((1, True), (2, True), (2, False)):
            cfg = zerodp.Config(stage=3, unit_modules=[Block], mixed_precision=precision, reduce_dtype=reduce_dtype,
                                grad_accumulation_steps=k, reduce_each_micro_batch=each)
            model, *_ = train_zerodp(gpt_tiny, sgd, cfg, rank, steps=STEPS, loss_of=gpt_loss, micro_batches=k)
            out[(precision, reduce_dtype, k, each)] = rel(full_params(model), want)
    return out


def memory_ledger(rank, world_size):
    """The measured ledger against the formula (at every stage, precision and accumulation
    mode, between micro-batches and after the step) and its total against a census of every
    live tensor in the process made by the garbage collector."""
    out = {}
    # The process's DeviceMesh (its rank tensor) lives for the session once built (cached with
    # its process group): built here first by a throwaway initialize, so that a census run
    # before any other case does not count it as the engine's.
    zerodp.initialize(nn.Linear(2, 2), torch.optim.SGD, zerodp.Config(stage=1), lr=0.1)
    # What existed before is frozen out of the collector: the census walks only what the cases
    # create (a worker that ran the rest of the suite tracks millions of objects, seconds a walk).
    gc.collect()
    gc.freeze()
    try:
        # bf16 at N=2 only: N=4 adds nothing bf16-specific.
        precisions = (("fp32", 4, 0), ("bf16", 2, 4)) if world_size <= 2 else (("fp32", 4, 0),)
        for precision, pbytes, master in precisions:
            for stage in (0, 1, 2, 3):
                # Where gradients live between micro-batches (reduce_each_micro_batch) does not
                # depend on N: both at N = 2, the default at N = 4.
                for each in ((True, False) if stage >= 2 and world_size <= 2 else (True,)):
                    cfg = zerodp.Config(stage=stage, mixed_precision=precision,
                                        unit_modules=[Block] if stage == 3 else [],
                                        grad_accumulation_steps=2, reduce_each_micro_batch=each)
                    out[(precision, stage, each)] = _ledger_and_census(cfg, pbytes, master, world_size)
    finally:
        gc.unfreeze()
    return out


def _ledger_and_census(cfg, pbytes, master, world_size):
    gc.collect()
    model = gpt_tiny()
    # The storages (not the tensors: a parameter's .data is swapped) are held, so no address
    # of theirs can be reused by what initialize allocates.
    baseline: list = []
    before = set(live_tensor_storages(hold=baseline))
    model, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=1e-3)
    _micro_batches(model, opt, steps=1)
    after_step = opt.memory_report()
    _micro_batches(model, opt, steps=0, partial=True)  # micro-batch 1 of 2 of the next step
    mid = opt.memory_report()
    grads = [p.grad for p in model.parameters()]  # autograd's own gradients get a Python tensor
    gc.collect()
    live = {k: v for k, v in live_tensor_storages().items() if k not in before}
    del grads
    held = Census()
    for holder, t in walk_tensors(opt):
        held.claim(holder, [t])
    # For a failure message: what the census found that the engine does not hold, and back.
    unheld = sorted(v for k, v in live.items() if k not in held.owner)
    unseen = sorted((held.owner[k], v) for k, v in held.nbytes.items() if k not in live)
    padded = mid.padded_numel
    expect = formula_bytes(cfg.stage, padded, world_size, pbytes, pbytes, master, 8)
    # reduce_each_micro_batch=False: stage 2 keeps autograd's own gradients (unpadded),
    # stage 3 each unit's padded gradient buffer, until the last micro-batch.
    held_unsharded = (0 if cfg.reduce_each_micro_batch or cfg.stage < 2
                      else (mid.numel if cfg.stage == 2 else padded) * pbytes)
    del baseline
    return {"after_step": {k: getattr(after_step, k) for k in expect}, "expect": expect,
            "mid": {k: getattr(mid, k) for k in expect}, "held_unsharded": held_unsharded,
            "other": dict(mid.other_by_owner), "ledger_total": mid.total, "census_total": sum(live.values()),
            "unheld": unheld[-5:], "unseen": unseen[-5:]}


def _micro_batches(model, opt, steps, partial=False):
    for step in range(steps):
        for micro in range(2):
            opt.backward(gpt_loss(model, step, 0, micro=micro, micro_batches=2))
        opt.step()
        opt.zero_grad()
    if partial:
        opt.backward(gpt_loss(model, 9, 0, micro=0, micro_batches=2))


class Outside(nn.Module):
    """Uses a unit's layer again after the unit's forward has ended."""

    def __init__(self):
        super().__init__()
        self.a = Blk()
        self.b = Blk()

    def forward(self, x):
        return self.a.lin(self.b(self.a(x)))


def sharded_use(rank, world_size):
    model, opt = zerodp.initialize(Outside(), sgd, zerodp.Config(stage=3, unit_modules=(Blk,)))
    return _error_of(lambda: model(torch.ones(2, 16)))


def trust_parts(world_size: int) -> dict:
    """The named parts of this module's grid (worldpool.LazyWorld), each a case of its own."""
    parts = {"failed": failed_backward, "reentrant": reentrant_checkpointing, "dtype": dtype_policy,
             "probe": optimizer_probe, "order": registration_order, "fp16": fp16_paths, "sgd3": sgd_stage3_grid,
             "memory": memory_ledger, "sharded_use": sharded_use, "review": review_cases,
             "reliability": reliability_cases}
    if world_size > 1:
        parts.update(rank_seeds=born_with_rank_seeds, disagree=ranks_that_disagree)
    return parts


class SharedBlocks(Stack):
    """One Blk instance used at two depths (ALBERT-style sharing), and, optionally, held by
    two parents so that it is shared between two units."""

    def __init__(self, checkpointed: bool = False):
        super().__init__(depth=2)
        self.shared = Blk()
        self.blocks[0].extra = self.shared  # a second path to the same module
        self.checkpointed = checkpointed

    def forward(self, x):
        h = self.inp(x)
        for b in (self.blocks[0], self.shared, self.blocks[1], self.shared):
            h = checkpoint(b, h, use_reentrant=True) if self.checkpointed else b(h)
        return self.out(h)


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    note: str = "a dataclass pytree does not know"


class DataclassOut(Stack):
    def forward(self, x):
        return Output(super().forward(x))


def input_grad_then_step(model, step, rank, dtype=torch.float32):
    """FGSM-style: a gradient with respect to the input first (no parameter gets one), then
    the real loss on the perturbed input."""
    x, y = batch(step, rank)
    x = x.to(dtype).requires_grad_()
    (gx,) = torch.autograd.grad(loss_fn(model(x), y), x)
    return loss_fn(model((x + 0.01 * gx.sign()).detach()), y)


def review_cases(rank, world_size):
    out = {}
    # A backward that reaches the outputs but no parameter is not a micro-batch.
    ref, *_ = train_reference(Stack, sgd, torch.float32, rank, steps=3, loss_of=input_grad_then_step)
    for stage in (0, 2, 3):
        model, *_ = train_zerodp(Stack, sgd, stack_cfg(stage), rank, steps=3, loss_of=input_grad_then_step)
        out[("input_grad", stage)] = vs(model, ref)
    # A module shared by two units belongs to the unit enclosing both (here the root).
    ref, *_ = train_reference(SharedBlocks, sgd, torch.float32, rank, steps=3)
    model, opt, *_ = train_zerodp(SharedBlocks, sgd, stack_cfg(3), rank, steps=3)
    out["shared_module"] = vs(model, ref)
    # The same shared block inside two reentrant checkpoints: right, or a named error; never wrong.
    for stage in (0, 2, 3):
        try:
            model, *_ = train_zerodp(lambda: SharedBlocks(checkpointed=True), sgd, stack_cfg(stage), rank, steps=3)
            out[("shared_reentrant", stage)] = vs(model, ref)
        except RuntimeError as e:
            out[("shared_reentrant", stage)] = str(e)
    # Outputs pytree does not know (a dataclass) still end the backward right.
    ref, *_ = train_reference(Stack, sgd, torch.float32, rank, steps=3)
    for stage in (0, 3):
        def build():
            m = DataclassOut()
            m.reentrant = True
            return m
        model, *_ = train_zerodp(build, sgd, stack_cfg(stage), rank, steps=3,
                                 loss_of=lambda m, step, r: loss_fn(m(batch(step, r)[0]).logits, batch(step, r)[1]))
        out[("dataclass_out", stage)] = vs(model, ref)
    # BatchNorm under bf16 needs its running statistics in bf16: cast_buffers.
    bn = lambda: nn.Sequential(nn.Linear(7, 8), nn.BatchNorm1d(8), nn.Linear(8, 5))  # noqa: E731
    model, opt = zerodp.initialize(bn(), sgd, zerodp.Config(stage=2, mixed_precision="bf16", cast_buffers=True))
    x, y = batch(0, rank)
    opt.backward(loss_fn(model(x), y))
    opt.step()
    out["batchnorm_bf16"] = str(model[1].running_mean.dtype)
    # The ledger walks the engine: a stray tensor held by it is reported under `other`.
    for stage in (2, 3):
        model, opt = zerodp.initialize(Stack(), sgd, stack_cfg(stage))
        opt.grad_sync.stray = torch.zeros(1000)
        out[("stray", stage)] = dict(opt.memory_report().other_by_owner)
    # initialize's optimizer probe runs no user-visible step hook.
    fired = []
    handle = register_optimizer_step_pre_hook(lambda *a: fired.append(1))
    zerodp.initialize(Stack(), adamw, stack_cfg(2))
    handle.remove()
    out["probe_hooks"] = len(fired)
    return out


def reliability_cases(rank, world_size):
    out = {}
    # A nan loss on the last rank only, fp32/bf16 (no loss scaler): raise on every rank,
    # skip on every rank, or proceed, per Config.nonfinite_grads.
    for stage in (2, 3):
        for precision in ("fp32", "bf16"):
            for policy in ("raise", "skip", "proceed"):
                torch.manual_seed(0)
                cfg = stack_cfg(stage, mixed_precision=precision, nonfinite_grads=policy)
                model, opt = zerodp.initialize(Stack(), adamw, cfg)
                before = full_params(model)
                x, y = batch(0, rank)
                loss = loss_fn(model(x), y)
                opt.backward(loss * float("nan") if rank == world_size - 1 else loss)
                err = _error_of(opt.step)
                after = full_params(model)
                out[(stage, precision, policy)] = {
                    "error": err, "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                    "any_nan": any(bool(t.isnan().any()) for t in after.values()), "skipped": opt.skipped_steps}
    # zero_grad() between backward and step: the step changes nothing, as torch's does.
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        model, opt = zerodp.initialize(Stack(), adamw, stack_cfg(stage))
        before = full_params(model)
        x, y = batch(0, rank)
        opt.backward(loss_fn(model(x), y))
        opt.zero_grad()
        err = _error_of(opt.step)
        after = full_params(model)
        out[("zero_grad_then_step", stage)] = (err, all(torch.equal(before[n], after[n]) for n in before),
                                               opt.step_count)
    # Misuse named: a second initialize, a DDP-wrapped model, an empty param group.
    model, opt = zerodp.initialize(Stack(), sgd, stack_cfg(2))
    out["second_initialize"] = _error_of(lambda: zerodp.initialize(model, sgd, stack_cfg(2)))
    from torch.nn.parallel import DistributedDataParallel as DDP

    out["ddp_wrapped"] = _error_of(lambda: zerodp.initialize(DDP(Stack()), sgd, stack_cfg(2)))
    out["empty_group"] = _error_of(lambda: zerodp.initialize(
        Stack(), lambda ps: torch.optim.SGD([{"params": list(ps)}, {"params": []}], lr=0.1), stack_cfg(2)))
    return out


def own_error_then_shutdown(rank, world_size):
    """The last rank raises and calls shutdown_distributed() in a finally; the others are
    waiting in a collective. The error surfaces at once instead of hanging in a barrier."""
    import torch.distributed as dist

    if rank == world_size - 1:
        try:
            raise ValueError("this rank's own error")
        finally:
            zerodp.shutdown_distributed()
    dist.all_reduce(torch.zeros(1 << 16))  # the peers: in a training step's collective


def ranks_that_disagree(rank, world_size):
    """The last rank builds something else; every rank gets an error naming the difference."""
    last = rank == world_size - 1
    out = {}
    out["config"] = _error_of(lambda: zerodp.initialize(Stack(), sgd, zerodp.Config(stage=2, bucket_bytes=512 if last
                                                                                    else 256)))
    out["loss_scale"] = _error_of(lambda: zerodp.initialize(
        Stack(), sgd, stack_cfg(2, mixed_precision="fp16", loss_scale=8.0 if last else 1024.0)))
    out["model"] = _error_of(lambda: zerodp.initialize(Stack(depth=5 if last else 4), sgd, stack_cfg(3)))
    out["lr"] = _error_of(lambda: zerodp.initialize(Stack(), torch.optim.SGD, stack_cfg(2), lr=0.2 if last else 0.1))
    # A tensor learning rate that differs below its printed precision is still a difference.
    out["tensor_lr"] = _error_of(lambda: zerodp.initialize(
        Stack(), torch.optim.AdamW, stack_cfg(2), lr=torch.tensor(1.0004e-3 if last else 1e-3)))
    # A rank that fails before the agreement (its model is bf16, Config says fp32) does not
    # leave the others waiting: it raises its own error, they name it.
    out["local_failure"] = _error_of(lambda: zerodp.initialize(
        Stack().to(torch.bfloat16) if last else Stack(), sgd, stack_cfg(2)))
    return out


def handled_error_then_shutdown(rank, world_size):
    """As own_error_then_shutdown, but the failing rank handles its error in an `except`
    first, and says so: shutdown_distributed(wait=False)."""
    import torch.distributed as dist

    if rank == world_size - 1:
        try:
            raise ValueError("this rank's own error")
        except ValueError:
            zerodp.shutdown_distributed(wait=False)
        return "left"
    dist.all_reduce(torch.zeros(1 << 16))


def inf_norm_with_nan(rank, world_size):
    """A nan in the first layer's gradient on the last rank: the inf-norm is nan everywhere."""
    model, opt = zerodp.initialize(Stack(), sgd, stack_cfg(2, nonfinite_grads="proceed"))
    x, y = batch(0, rank)
    opt.backward(loss_fn(model(x), y))
    if rank == world_size - 1:
        opt._prepare_grads()
        opt.stepper.shards[0][0].master_tensors[-1].grad.view(-1)[-1] = float("nan")  # the flat layout's last piece: inp
    return float(opt.clip_grad_norm_(1.0, norm_type=float("inf")))
