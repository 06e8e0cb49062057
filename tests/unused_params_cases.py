"""Parameters that one rank's backward reaches and another's does not, at stage 3, against
torch DDP(find_unused_parameters=True) (test_unused_params.py), a case per test in the
session's worlds (worldpool.py).

DDP's rule: a parameter no op of this rank's backward reached contributes zero on this rank,
and the gradient is still the mean over every rank; one reached by no rank has none (the
optimizer skips it). The models route each token to one expert named by the batch (hash
routing, so that which expert a rank reaches is fixed by its data, not by a router's
rounding), scaled by a router's gate, so the router trains too:

    within_unit   an expert Linear inside the unit `Branchy`, run on rank 0 only
    moe           experts in an nn.ModuleList inside the unit `Block`; one idle on rank 1
    own_unit      each expert a unit of its own (Config.unit_modules), idle on some ranks only
    accumulation  2 micro-batches per step, reaching different experts on each rank

Every case compares the loss and every parameter after each step with DDP's, with SGD
(scale-sensitive: a gradient averaged over the wrong count moves every update) and AdamW.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from parity import StepTrace

import zerodp

STEPS = 4
WIDTH = 8
TOKENS = 6  # per rank and micro-batch
# A rank left waiting in a collective the others never run fails after this many seconds
# (zerodp's own groups): a mismatch shows as an error, not as a hang of the suite.
TIMEOUT_S = 30.0
SGD = dict(lr=0.1, momentum=0.9)
ADAMW = dict(lr=1e-2, weight_decay=0.0)


def sgd(params):
    return torch.optim.SGD(list(params), **SGD)


def adamw(params):
    return torch.optim.AdamW(list(params), **ADAMW)


OPTIMIZERS = {"sgd": sgd, "adamw": adamw}


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class MoE(nn.Module):
    """Top-1 routing: each token goes to the one expert `route` names, times its gate."""

    def __init__(self, experts: int):
        super().__init__()
        self.router = nn.Linear(WIDTH, experts, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x, route):
        gates = F.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx = (route == i).nonzero().squeeze(1)
            if idx.numel():  # an expert no token reached does not run
                out = out.index_add(0, idx, expert(x[idx]) * gates[idx, i:i + 1])
        return out


class Block(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.moe = MoE(experts)

    def forward(self, x, route):
        return x + self.moe(self.norm(x), route)


class MoENet(nn.Module):
    def __init__(self, experts: int = 3, layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(experts) for _ in range(layers))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, routes):
        h = self.inp(x)
        for block, route in zip(self.blocks, routes):
            h = block(h, route)
        return self.out(h)


class Branchy(nn.Module):
    """A unit with two Linear layers, the second run only for a batch that asks for it."""

    def __init__(self):
        super().__init__()
        self.main = nn.Linear(WIDTH, WIDTH)
        self.extra = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, use_extra):
        h = torch.tanh(self.main(x))
        if bool(use_extra):
            h = h + torch.tanh(self.extra(x))
        return x + h


class BranchyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Branchy() for _ in range(3))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, flags):
        h = self.inp(x)
        for block, flag in zip(self.blocks, flags):
            h = block(h, flag)
        return self.out(h)


# Which experts (or branches) each rank's data reaches: rank -> layer -> allowed experts.
# Rank 0 reaches everything; other ranks leave some idle, at every step.
def moe_reach(rank: int, experts: int, layers: int) -> list[list[int]]:
    if rank == 0:
        return [list(range(experts))] * layers
    idle = rank % experts if experts > 1 else None
    return [[e for e in range(experts) if e != (idle + layer) % experts] for layer in range(layers)]


def moe_batch(step: int, rank: int, micro: int, reach: list[list[int]]):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(TOKENS, WIDTH, generator=g)
    y = torch.randn(TOKENS, WIDTH, generator=g)
    routes = []
    for allowed in reach:
        # Every allowed expert gets a token: what a rank reaches is exactly `reach`.
        pick = torch.cat([torch.arange(len(allowed)), torch.randint(0, len(allowed), (TOKENS - len(allowed),),
                                                                    generator=g)])
        routes.append(torch.tensor(allowed)[pick[torch.randperm(TOKENS, generator=g)]])
    return x, y, torch.stack(routes)


def branchy_batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(TOKENS, WIDTH, generator=g)
    y = torch.randn(TOKENS, WIDTH, generator=g)
    flags = torch.tensor([rank == 0, rank == 0, True])  # the first two blocks' extra: rank 0 only
    return x, y, flags


def mse(out, y):
    return (out - y).pow(2).mean()


def _micro_batches(batch_of, step, rank, k):
    return [batch_of(step, rank, micro) for micro in range(k)]


def train_ddp(model_fn, opt_fn, batch_of, rank, k, trace):
    """DDP(find_unused_parameters=True) over the step's whole batch (the k micro-batches
    concatenated; tokens are independent, so one forward over all of them is the same mean)."""
    torch.manual_seed(0)
    ddp = DDP(model_fn(), find_unused_parameters=True)
    opt = opt_fn(ddp.module.parameters())
    for step in range(STEPS):
        parts = _micro_batches(batch_of, step, rank, k)
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        routing = torch.cat([p[2] for p in parts], dim=-1) if parts[0][2].dim() > 1 else parts[0][2]
        loss = mse(ddp(x, routing), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        trace.record_step(ddp.module, float(loss.detach()))
    return ddp.module


def train_stage3(model_fn, opt_fn, batch_of, rank, k, trace, unit_modules, each=True):
    torch.manual_seed(0)
    cfg = zerodp.Config(stage=3, unit_modules=unit_modules, grad_accumulation_steps=k, reduce_each_micro_batch=each,
                        collective_timeout_s=TIMEOUT_S)
    model, opt = zerodp.initialize(model_fn(), opt_fn, cfg)
    for step in range(STEPS):
        total = 0.0
        for x, y, routing in _micro_batches(batch_of, step, rank, k):
            loss = mse(model(x, routing), y)
            opt.backward(loss)
            total += float(loss.detach()) / k
        opt.step()
        opt.zero_grad()
        trace.record_step(model, total)
    return model, opt


def local_grad_max(model_fn, batch_of, rank, k) -> float:
    """The largest element of this rank's own gradient at the initial weights, over the first
    step's micro-batches: the bound the SGD tolerance is derived from (test_unused_params.py)."""
    torch.manual_seed(0)
    model = model_fn()
    worst = 0.0
    for x, y, routing in _micro_batches(batch_of, 0, rank, k):
        model.zero_grad()
        mse(model(x, routing), y).backward()
        worst = max([worst] + [float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None])
    return worst


def _case(model_fn, batch_of, unit_modules, opt_name, rank, k=1, each=True):
    opt_fn = OPTIMIZERS[opt_name]
    ref_trace, trace = StepTrace(), StepTrace()
    ref = train_ddp(model_fn, opt_fn, batch_of, rank, k, ref_trace)
    model, opt = train_stage3(model_fn, opt_fn, batch_of, rank, k, trace, unit_modules, each)
    per_step = trace.compare(ref_trace)
    with zerodp.gathered_parameters(model):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)
    init = {n: p.detach().clone() for n, p in model_fn().named_parameters()}
    want = {n: p.detach() for n, p in ref.named_parameters()}
    # The last step's collectives (the per-step snapshots' checkpoint gathers apart).
    records = [r for r in opt.comm.ledger.last_step if r.phase != "checkpoint"]
    return {
        "per_step": per_step,
        "collectives": [(r.op, r.phase, r.label, r.numel) for r in records],
        "by_op": opt.comm.ledger.summary(records)["by_op"],
        "padded": opt.memory_report().padded_numel,
        "local_grad_max": local_grad_max(model_fn, batch_of, rank, k),
        # Parameters no rank reached in any step: untouched, as under DDP (no gradient, not stepped).
        "untouched": sorted(n for n in got if torch.equal(want[n], init[n])),
        "untouched_here": sorted(n for n in got if torch.equal(got[n], init[n])),
        "units": [u.name for u in opt.stage3.units],
        "all_freed": all(u.full is None and u.grad_full is None for u in opt.stage3.units),
    }


def within_unit_case(rank, world_size, opt_name):
    """(a) A parameter of a unit reached on rank 0 only."""
    return _case(BranchyNet, branchy_batch, (Branchy,), opt_name, rank)


def moe_case(rank, world_size, opt_name, experts=3):
    """(c) Experts in an nn.ModuleList inside the unit; one idle on each rank but rank 0."""
    reach = moe_reach(rank, experts, 2)
    batch_of = lambda step, r, micro: moe_batch(step, r, micro, reach)  # noqa: E731
    return _case(lambda: MoENet(experts), batch_of, (Block,), opt_name, rank)


def own_unit_case(rank, world_size, opt_name, nested):
    """(b) Each expert a unit of its own, idle on some ranks: its forward and backward run
    there only. `nested`: the block is a unit too, enclosing its experts; else the experts'
    enclosing unit is the root."""
    reach = moe_reach(rank, 3, 2)
    batch_of = lambda step, r, micro: moe_batch(step, r, micro, reach)  # noqa: E731
    units = (Expert, Block) if nested else (Expert,)
    return _case(MoENet, batch_of, units, opt_name, rank)


def accumulation_case(rank, world_size, opt_name, each):
    """(d) Two micro-batches per step that reach different experts on each rank. In layers 1
    and 2 each micro-batch reaches every expert on one rank and not on the other (three
    layers: with two, prefetching the next unit hides a mismatch); expert 2 of layer 0 is
    reached by no rank and no micro-batch."""
    reach = {  # rank -> layer -> micro-batch -> experts reached
        0: [[[0], [0, 1]], [[0, 1, 2], [1]], [[0, 1, 2], [1]]],
        1: [[[1], [0]], [[0], [0, 1, 2]], [[0], [0, 1, 2]]],
    }

    def batch_of(step, r, micro):
        return moe_batch(step, r, micro, [reach[r][layer][micro] for layer in range(3)])
    return _case(lambda: MoENet(3, layers=3), batch_of, (Block,), opt_name, rank, k=2, each=each)
