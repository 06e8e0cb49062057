"""Gradient clearing against torch DDP (issue 22: items 1, 2, 9, 11, 14, 17), a case per test in
the session's worlds (test_grad_clearing.py). Each case returns plain numbers.

Every way a loop clears gradients, and not clearing at all, must give DDP's results:

    opt_none   optimizer.zero_grad()                 (set_to_none=True, torch's default)
    opt_zero   optimizer.zero_grad(set_to_none=False)
    model      model.zero_grad()                     (what Hugging Face's Trainer calls)
    grad_none  p.grad = None on every parameter
    keep       nothing: torch adds the next step's gradient to the last one

The model has an "expert" that only step 0 uses. After a clearing that leaves DDP's .grad
None, torch's optimizer does not touch it again (no weight decay, no momentum, no Adam
step); after set_to_none=False it steps it with a zero gradient; with `keep` it steps it
with its stale gradient again.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import zerodp

STEPS = 3
BUCKET = 256  # bytes: several buckets, and pieces of the shard that span two parameters
CLEARINGS = ("opt_none", "opt_zero", "model", "grad_none", "keep")
EPS = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8}  # unit roundoff
SGD = dict(lr=0.1, momentum=0.9, weight_decay=0.1)  # decay moves a wrongly stepped parameter


def sgd(params):
    return torch.optim.SGD(list(params), **SGD)


def adamw(params):
    return torch.optim.AdamW(list(params), lr=0.01, weight_decay=0.1)


OPTIMIZERS = {"sgd": sgd, "adamw": adamw}


class Net(nn.Module):
    """233 trainable elements (not a multiple of 2 or 4: padded); an expert used at step 0 only."""

    def __init__(self, empty: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh())
        self.head = nn.Linear(9, 4)
        self.expert = nn.Linear(9, 4)
        # Item 14: a trainable parameter with no elements (a LoRA of rank 0, an empty table).
        self.empty = nn.Parameter(torch.zeros(0)) if empty else None

    def forward(self, x, expert: bool = True):
        h = self.body(x)
        y = self.head(h)
        if expert:
            y = y + self.expert(h)
        if self.empty is not None:
            y = y + self.empty.sum()  # adds an exact 0: the other parameters train as without it
        return y


def batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4, 6, generator=g), torch.randn(4, 4, generator=g)


def loss_of(model, step, rank, micro, dtype):
    x, y = batch(step, rank, micro)
    return (model(x.to(dtype), expert=step == 0).float() - y).pow(2).mean()


@dataclass(frozen=True)
class Case:
    stage: int
    precision: str = "fp32"
    clearing: str = "model"
    accumulation: int = 1
    each: bool = True  # Config.reduce_each_micro_batch
    opt: str = "sgd"
    offload: str = "none"  # Config.offload_optimizer

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.precision == "fp32" else torch.bfloat16

    @property
    def reduces_each(self) -> bool:
        """Whether the engine reduces every micro-batch (stages 0-1 never do)."""
        return self.stage >= 2 and self.each and self.accumulation > 1

    def reference(self) -> "Case":
        """What the DDP reference depends on."""
        native = self.stage == 0
        return replace(self, stage=0 if native else 1, each=self.reduces_each, offload="none")


# -- torch DDP --------------------------------------------------------------------------------
def _add(a, b):
    return b if a is None else a if b is None else a + b


def train_ddp(case: Case, rank: int, world_size: int, track_local: bool = False, fp32_sum: bool = False) -> dict:
    """torch DDP (find_unused_parameters=True: the expert) with the same optimizer; bf16: DDP
    over a bf16 copy, the optimizer on fp32 masters, as zerodp computes.

    Sums in another order round differently; so that results can be compared bit for bit,
    the reference adds in the engine's order, which DDP's semantics leave free: `stage=0`
    (zerodp's stage 0 is DDP) accumulates as DDP does, the step's gradient into .grad as it
    is; otherwise the step's reduced gradient is added to .grad afterwards, micro-batch by
    micro-batch where the engine reduces each (`each`). Each step's parameters and masters
    ("steps"), after its clearing."""
    torch.manual_seed(0)
    model = Net()
    if case.dtype == torch.float32:
        compute, masters = model, None
    else:
        compute = copy.deepcopy(model)
        for p in compute.parameters():
            p.data = p.data.to(case.dtype)
        masters = list(model.parameters())
    ddp = DDP(compute, find_unused_parameters=True)
    params = list(compute.parameters())
    opt = OPTIMIZERS[case.opt](masters if masters is not None else params)
    k, losses, local_max, steps = case.accumulation, [], [], []
    names = [n for n, _ in model.named_parameters()]
    for step in range(STEPS):
        prev = [p.grad for p in params]  # DDP's .grad when the step begins
        if case.stage != 0:
            for p in params:
                p.grad = None
        acc = prev
        biggest = 0.0
        for micro in range(k):
            last = micro == k - 1
            sync = (last or case.each) and not fp32_sum
            with (contextlib.nullcontext() if sync else ddp.no_sync()):
                if track_local:  # the largest local gradient, for the N=4 rounding bound
                    local = torch.autograd.grad(loss_of(compute, step, rank, micro, case.dtype), params,
                                                allow_unused=True)
                    biggest = max([biggest] + [float(g.abs().max()) for g in local if g is not None and g.numel()])
                loss = loss_of(ddp, step, rank, micro, case.dtype)
                (loss * (1.0 / k)).backward()
            losses.append(float(loss.detach()))
            if case.stage != 0 and (sync or (fp32_sum and last)):
                acc = [_add(a, p.grad) for a, p in zip(acc, params)]
                for p in params:
                    p.grad = None
        if case.stage != 0:
            for p, a in zip(params, acc):
                p.grad = a
        local_max.append(biggest)
        if masters is not None:
            for m, p in zip(masters, params):
                m.grad = None if p.grad is None else p.grad.float()
                if fp32_sum and m.grad is not None:
                    dist.all_reduce(m.grad.div_(world_size))
        opt.step()
        if masters is not None:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
                    m.grad = None
        if case.clearing == "opt_zero":
            compute.zero_grad(set_to_none=False)
        elif case.clearing != "keep":
            compute.zero_grad(set_to_none=True)
        steps.append({"params": {n: p.detach().float().clone() for n, p in zip(names, params)},
                      "masters": {n: m.detach().clone() for n, m in zip(names, masters or params)}})
    out = {**steps[-1], "steps": steps, "losses": losses}
    if track_local:
        t = torch.tensor(local_max, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out["local_max"] = t.tolist()
    return out


# The DDP runs, kept by each rank's process of the session's world (which lives as long as the
# session): many cases share one reference. Every rank runs the same cases in the same order,
# so every rank finds (or computes, with its collectives) the same ones.
_REFERENCES: dict = {}


def ddp_reference(case: Case, rank: int, world_size: int, track_local: bool = False, fp32_sum: bool = False) -> dict:
    """train_ddp, once per process for the same arguments."""
    key = (case, world_size, track_local, fp32_sum)
    if key not in _REFERENCES:
        _REFERENCES[key] = train_ddp(case, rank, world_size, track_local=track_local, fp32_sum=fp32_sum)
    return _REFERENCES[key]


# -- zerodp ----------------------------------------------------------------------------------
def config(case: Case, **extra) -> zerodp.Config:
    return zerodp.Config(stage=case.stage, mixed_precision=case.precision, bucket_bytes=BUCKET,
                         grad_accumulation_steps=case.accumulation,
                         reduce_each_micro_batch=case.each or case.stage < 2,  # stages 0-1 reduce once anyway
                         offload_optimizer=case.offload, unit_modules=[nn.Linear] if case.stage == 3 else [],
                         **extra)


def clear(clearing: str, model: nn.Module, opt) -> None:
    if clearing == "opt_none":
        opt.zero_grad()
    elif clearing == "opt_zero":
        opt.zero_grad(set_to_none=False)
    elif clearing == "model":
        model.zero_grad()
    elif clearing == "grad_none":
        for p in model.parameters():
            p.grad = None


def train_zerodp(case: Case, rank: int, make=Net, cfg=None) -> dict:
    torch.manual_seed(0)
    model = make()
    model, opt = zerodp.initialize(model, OPTIMIZERS[case.opt], cfg or config(case))
    losses, steps = [], []
    for step in range(STEPS):
        for micro in range(case.accumulation):
            loss = loss_of(model, step, rank, micro, case.dtype)
            opt.backward(loss)
            losses.append(float(loss.detach()))
        opt.step()
        clear(case.clearing, model, opt)
        steps.append(snapshot(model, opt))
    return {**steps[-1], "steps": steps, "losses": losses}


def snapshot(model, opt) -> dict:
    with zerodp.gathered_parameters(model):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    masters = [(s.name, s.start, s.master.detach().clone()) for s in opt.owned_slices()]
    return {"params": params, "masters": masters}


def compare(got: dict, ref: dict) -> dict:
    """Largest absolute difference of the compute parameters, the fp32 masters (this rank's
    slices) and the expert's parameters, after each step (lists, one per step); and of the
    losses (every micro-batch's)."""
    per_step = [_compare_step(g, r) for g, r in zip(got["steps"], ref["steps"], strict=True)]
    losses = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    return {**{k: [d[k] for d in per_step] for k in ("params", "masters", "expert")}, "losses": losses}


def _compare_step(got: dict, ref: dict) -> dict:
    params = max(_largest(got["params"][n] - ref["params"][n]) for n in ref["params"])
    masters = max([0.0] + [_largest(m - ref["masters"][n].reshape(-1)[s: s + m.numel()]) for n, s, m in got["masters"]])
    expert = max(_largest(got["params"][n] - ref["params"][n]) for n in ref["params"] if n.startswith("expert"))
    return {"params": params, "masters": masters, "expert": expert}


def _largest(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the tests assert on it
        return f"{type(e).__name__}: {e}"
    return None


def _guarded(fn):
    """A case that raises reports its error instead of ending the world (today's main)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


# -- the cases (test_grad_clearing.py sends one per test) --------------------------------------
def contract_cases(world_size: int) -> list[Case]:
    """Every clearing x stage x window, fp32 and bf16, SGD, at N=2 (the one-micro-batch window
    in fp32 only); AdamW and the optimizer on the host on some; at N=4 fp32 accumulation."""
    out = []
    wide = world_size <= 2
    for precision in ("fp32", "bf16") if wide else ("fp32",):
        for stage in (0, 1, 2, 3):
            windows = [(2, False)] + ([(2, True)] if stage >= 2 else [])
            if wide and precision == "fp32":
                windows.insert(0, (1, True))
            for k, each in windows:
                # p.grad = None is model.zero_grad()'s own mechanism: fp32 is enough for it.
                chosen = CLEARINGS if wide else ("opt_none", "model", "keep")
                for clearing in [c for c in chosen if precision == "fp32" or c != "grad_none"]:
                    out.append(Case(stage, precision, clearing, k, each))
    if wide:
        # AdamW (a skipped parameter keeps its own step count), and the optimizer on the host.
        for stage in (0, 1, 2, 3):
            for clearing in ("opt_none", "model", "keep"):
                out.append(Case(stage, "bf16", clearing, 2, False, opt="adamw"))
                if stage > 0:  # stage 0 keeps no shard to offload
                    out.append(Case(stage, "bf16", clearing, 2, stage >= 2, offload="host"))
    return out


def contract_case(rank: int, world_size: int, case: Case) -> dict:
    """One clearing against DDP, compared after every step; at N > 2 with the largest local
    gradient of each step, for the rounding bound."""
    track = world_size > 2
    ref = ddp_reference(case.reference(), rank, world_size, track_local=track)
    got = _guarded(lambda: train_zerodp(case, rank))
    return got if "error" in got else {**compare(got, ref), "local_max": ref.get("local_max")}


# Stages 0-1 keep an fp32 copy of the owned gradient when they reduce in fp32; the host
# keeps the master and its gradient at stages 1-3.
_PLACEMENTS = {0: [("none", None), ("none", "fp32")], 1: [("none", None), ("none", "fp32"), ("host", None)],
               2: [("none", None), ("host", None)], 3: [("none", None), ("host", None)]}
MEMORY_PLACEMENTS = [(stage, offload, reduce_dtype) for stage, kinds in _PLACEMENTS.items()
                     for offload, reduce_dtype in kinds]


def memory_case(rank: int, world_size: int, stage: int, offload: str, reduce_dtype) -> dict:
    """Item 11: the ledger after step + model.zero_grad() against step + optimizer.zero_grad(),
    and right after the step ("reports"); how many fp32 copies of a gradient outlive the step
    ("master_grads")."""
    case = Case(stage, "bf16", "model", 2, False, offload=offload)
    reports, master_grads = {}, None
    for clearing in ("model", "opt_none", "step"):
        torch.manual_seed(0)
        model, opt = zerodp.initialize(Net(), sgd, config(case, reduce_dtype=reduce_dtype))
        for step in range(2):
            for micro in range(2):
                opt.backward(loss_of(model, step, rank, micro, case.dtype))
            opt.step()
            if clearing != "step":
                clear(clearing, model, opt)
        reports[clearing] = opt.memory_report().as_dict()
        if clearing == "step":
            master_grads = sum(m.grad is not None for s in opt.stepper.all_shards() for m in s.master_tensors)
    return {"reports": reports, "master_grads": master_grads}


def fp32_reduce_case(rank: int, world_size: int, stage: int, clearing: str) -> dict:
    """Item 9: bf16 with reduce_dtype="fp32": every stage must step on the fp32 average of the
    bf16 gradients, as the reference does (each rank's bf16 gradient, upcast, divided by N and
    summed in fp32). At N=2 a sum is order-free, so the results are equal bit for bit."""
    ref = ddp_reference(Case(1, "bf16", clearing), rank, world_size, fp32_sum=True)
    case = Case(stage, "bf16", clearing)
    got = _guarded(lambda: train_zerodp(case, rank, cfg=config(case, reduce_dtype="fp32")))
    return got if "error" in got else compare(got, ref)


def empty_case(rank: int, world_size: int, stage: int, k: int, each: bool) -> dict:
    """Item 14: a trainable parameter with no elements trains at every stage, as DDP without it."""
    case = Case(stage, "fp32", "model", k, each)
    ref = ddp_reference(case.reference(), rank, world_size)
    got = _guarded(lambda: train_zerodp(case, rank, make=lambda: Net(empty=True)))
    if "error" in got:
        return got
    for snap in got["steps"]:
        snap["params"].pop("empty")
        snap["masters"] = [m for m in snap["masters"] if m[0] != "empty"]
    return compare(got, ref)


# -- item 17: the loop calls the model's submodules and checkpoints the last one (reentrant) --
def _segments():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Linear(9, 9), nn.Linear(9, 4))


def _segments_ddp(rank: int, k: int) -> list:
    """DDP running the same model whole; the parameters after each step."""
    model = _segments()
    ddp = DDP(model)
    opt = sgd(model.parameters())
    steps = []
    for step in range(STEPS):
        for micro in range(k):
            x, y = batch(step, rank, micro)
            with (ddp.no_sync() if micro < k - 1 else contextlib.nullcontext()):
                ((ddp(x) - y).pow(2).mean() * (1.0 / k)).backward()
        opt.step()
        model.zero_grad()
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return steps


def _segments_zerodp(rank: int, stage: int, k: int, via_optimizer: bool) -> list:
    # Reducing once per window, as the reference does (the order of sums is DDP's).
    model, opt = zerodp.initialize(_segments(), sgd, zerodp.Config(stage=stage, bucket_bytes=BUCKET,
                                                                   grad_accumulation_steps=k,
                                                                   reduce_each_micro_batch=stage < 2,
                                                                   unit_modules=[nn.Linear] if stage == 3
                                                                   else []))
    steps = []
    for step in range(STEPS):
        for micro in range(k):
            x, y = batch(step, rank, micro)
            h = model[1](model[0](x))
            loss = (checkpoint(model[2], h, use_reentrant=True) - y).pow(2).mean()
            if via_optimizer:
                opt.backward(loss)
            else:
                (loss * (1.0 / k)).backward()
        opt.step()
        model.zero_grad()
        with zerodp.gathered_parameters(model):
            steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return steps


REENTRANT_GRID = [(stage, k, via_optimizer) for k in (1, 2) for stage in (0, 1, 2, 3)
                  for via_optimizer in ((True, False) if k == 1 else (True,))]


def reentrant_case(rank: int, world_size: int, stage: int, k: int, via_optimizer: bool):
    """Item 17: against DDP running the same model whole (recomputation is exact); the largest
    parameter difference after each step (a list), or {"error": ...}."""
    key = ("segments", k, world_size)
    if key not in _REFERENCES:
        _REFERENCES[key] = _segments_ddp(rank, k)
    ref = _REFERENCES[key]
    got = _guarded(lambda: {"steps": _segments_zerodp(rank, stage, k, via_optimizer)})
    if "error" in got:
        return got
    return [max(_largest(g[n] - r[n]) for n in r) for g, r in zip(got["steps"], ref, strict=True)]


BEFORE_STEP_GRID = [(stage, clearing) for stage in (0, 1, 2, 3) for clearing in ("model", "grad_none", "opt_zero")]


def before_step_case(rank: int, world_size: int, stage: int, clearing: str) -> tuple:
    """backward, then a clearing, then step(): DDP's optimizer finds every .grad None (or zero)
    and changes nothing (or steps zeros); returns how far each parameter moved."""
    torch.manual_seed(0)
    model, opt = zerodp.initialize(Net(), sgd, config(Case(stage)))
    before = snapshot(model, opt)["params"]
    opt.backward(loss_of(model, 0, rank, 0, torch.float32))
    clear(clearing, model, opt)
    opt.step()
    after = snapshot(model, opt)["params"]
    # SGD on a zero gradient still decays the weights: lr * decay * |p| per element.
    moved = max(_largest(after[n] - before[n]) for n in before)
    largest = max(_largest(before[n]) for n in before)
    return (moved, SGD["lr"] * SGD["weight_decay"] * largest, largest)
