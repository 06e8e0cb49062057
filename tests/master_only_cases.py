"""Master-only work from DDP scripts (test_master_only.py): calls that are collective at some
stages, made on rank 0 alone, fail on every rank within seconds naming the call and the fix
([Note: sync points] in distributed/sync_points.py); what is local at a stage stays local."""
from __future__ import annotations

import copy
import os
import pickle
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp
from zerodp.distributed.topology import forget_meshes

# Long enough that a call waiting out the timeout cannot pass for a refused one.
TIMEOUT_S = 30.0


class Blocks(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def build(stage: int, timeout_s: float = TIMEOUT_S, model: nn.Module = None):
    # A case may have left zerodp's groups with a collective one rank abandoned: fresh groups,
    # once both ranks are here (a plain barrier on the default group).
    dist.barrier()
    forget_meshes()
    torch.manual_seed(0)
    cfg = zerodp.Config(stage=stage, collective_timeout_s=timeout_s,
                        unit_modules=(nn.Linear,) if stage == 3 else (), bucket_bytes=1024)
    return zerodp.initialize(Blocks() if model is None else model, torch.optim.AdamW, cfg, lr=1e-2)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * rank + step))


def train_step(model, opt, rank: int, step: int) -> None:
    opt.backward(model(batch(rank, step)).square().mean())
    opt.step()
    opt.zero_grad()


def evaluate(model, rank: int, forwards: int = 2) -> float:
    """nanoGPT's estimate_loss: eval mode, forwards under no_grad, back to train mode."""
    model.eval()
    with torch.no_grad():
        loss = sum(float(model(batch(rank, 100 + k)).square().mean()) for k in range(forwards))
    model.train()
    return loss


def timed(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and message are what the tests check
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"type": None, "message": "", "seconds": time.monotonic() - start}


# -- a call on rank 0 only -------------------------------------------------------------------
def rank0_only(rank: int, world_size: int, stage: int, call: str) -> dict:
    """One step on every rank, then rank 0 makes `call` alone while rank 1 trains on."""
    model, opt = build(stage)
    train_step(model, opt, rank, 0)
    alone = {"optimizer.state_dict": opt.state_dict, "model.state_dict": model.state_dict,
             "eval": lambda: evaluate(model, rank)}[call]
    return timed(lambda: alone() if rank == 0 else train_step(model, opt, rank, 1))


def load_on_rank0_only(rank: int, world_size: int) -> dict:
    """Every rank takes the state dict; rank 0 alone loads it back, rank 1 trains on."""
    model, opt = build(1)
    train_step(model, opt, rank, 0)
    sd = opt.state_dict()
    return timed(lambda: opt.load_state_dict(sd) if rank == 0 else train_step(model, opt, rank, 1))


def inside_gathered_parameters(rank: int, world_size: int) -> dict:
    """The advice that does not work: every rank enters gathered_parameters, rank 0 evaluates
    inside. Its first forward needs no gather; the units are freed after it, so the second
    gathers on rank 0 alone."""
    model, opt = build(3)
    train_step(model, opt, rank, 0)
    first = []

    def run():
        with zerodp.gathered_parameters(model):
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    first.append(float(model(batch(rank, 100)).square().mean()))
                    model(batch(rank, 101))
                model.train()
        train_step(model, opt, rank, 1)
    out = timed(run)
    out["first_forward_ran"] = bool(first)
    return out


def called_late(rank: int, world_size: int) -> dict:
    """Rank 0 evaluates for longer than a training point waits (it is local at stage 1), then
    takes the state dict alone: rank 1 went on into its reduction before rank 0 got there."""
    from zerodp.distributed import failure

    failure.REPORT_WAIT_S = 1.0
    model, opt = build(1, timeout_s=4.0)  # a training point waits min(1 s, 4 s / 8)
    train_step(model, opt, rank, 0)

    def run():
        if rank == 0:
            time.sleep(2.0)
            opt.state_dict()
        else:
            train_step(model, opt, rank, 1)
    out = timed(run)
    failure.REPORT_WAIT_S = 5.0
    return out


def called_too_late(rank: int, world_size: int) -> dict:
    """Both ranks take the state dict, rank 1 later than the collective timeout."""
    model, opt = build(1, timeout_s=2.0)
    train_step(model, opt, rank, 0)
    if rank == 1:
        time.sleep(3.0)
    return timed(opt.state_dict)


# -- the same calls on every rank --------------------------------------------------------------
def every_rank(rank: int, world_size: int, stage: int) -> dict:
    """The calls on every rank, between steps: they work, and training goes on."""
    model, opt = build(stage)
    train_step(model, opt, rank, 0)
    sd = opt.state_dict()
    msd = model.state_dict()
    losses = [evaluate(model, rank)]
    opt.load_state_dict(sd)
    train_step(model, opt, rank, 1)
    losses.append(evaluate(model, rank))
    train_step(model, opt, rank, 2)
    return {"state_keys": sorted(sd["state"]), "model_keys": sorted(msd), "losses": losses,
            "points_on": opt.comm.sync_points.enabled, "points": opt.comm.sync_points.point}


def single_process(rank: int, world_size: int) -> dict:
    """A world of one: no sync point at all."""
    model, opt = build(3)
    train_step(model, opt, rank, 0)
    opt.state_dict()
    model.state_dict()
    evaluate(model, rank)
    train_step(model, opt, rank, 1)
    return {"points_on": opt.comm.sync_points.enabled, "points": opt.comm.sync_points.point}


# -- what is local stays local ---------------------------------------------------------------
def _snapshot(sd: dict) -> dict:
    """An optimizer state dict's tensors by (parameter number, state name), or a model's."""
    if "state" in sd:
        return {(i, k): torch.as_tensor(v).detach().clone().float() for i, st in sd["state"].items()
                for k, v in st.items()}
    return {k: v.detach().clone().float() for k, v in sd.items()}


def local_on_rank0(rank: int, world_size: int, stage: int) -> dict:
    """Rank 0 alone takes the model's state dict (and at stage 0 the optimizer's) while rank 1
    trains on; at stage 0 both equal DDP's after the same steps."""
    torch.manual_seed(0)
    plain = Blocks()
    ddp = DDP(copy.deepcopy(plain))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    model, opt = build(stage, model=copy.deepcopy(plain))
    for step in range(2):
        train_step(model, opt, rank, step)
        ddp(batch(rank, step)).square().mean().backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
    taken: dict = {}

    def run():
        if rank == 0:
            taken["model"] = _snapshot(model.state_dict())
            if stage == 0:
                taken["optimizer"] = _snapshot(opt.state_dict())
        train_step(model, opt, rank, 2)
    out = timed(run)
    if rank == 0:
        out["model"] = taken.get("model")
        out["ddp_model"] = _snapshot(ddp.module.state_dict())
        out["optimizer"] = taken.get("optimizer")
        out["ddp_optimizer"] = _snapshot(ddp_opt.state_dict())
    return out


# -- leaving ---------------------------------------------------------------------------------
def leaves_while_other_waits(rank: int, world_size: int, out_dir: str) -> None:
    """Rank 0 takes the state dict alone; rank 1 ends its script (shutdown_distributed) once
    rank 0 waits. Each rank writes what it raised to `out_dir` (the group is torn down)."""
    model, opt = build(1)
    train_step(model, opt, rank, 0)
    if rank == 0:
        result = timed(opt.state_dict)
    else:
        time.sleep(0.5)
        result = timed(zerodp.shutdown_distributed)
        if dist.is_initialized():  # it raised before tearing the group down
            dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if rank == 0:
        dist.barrier()  # rank 1's, after it raised


def step_overhead(rank: int, world_size: int, stage: int, steps: int = 40) -> dict:
    """Seconds per step of a small model, and the sync points' share of them (timed
    around each point)."""
    from zerodp.distributed.sync_points import SyncPoints

    model, opt = build(stage)
    spent = [0.0]
    inner = SyncPoints._arrive

    def timed_arrive(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    for step in range(3):
        train_step(model, opt, rank, step)
    SyncPoints._arrive = timed_arrive
    try:
        points = opt.comm.sync_points.point
        start = time.perf_counter()
        for step in range(steps):
            train_step(model, opt, rank, step)
        total = time.perf_counter() - start
    finally:
        SyncPoints._arrive = inner
    return {"step_s": total / steps, "points_s": spent[0] / steps,
            "points_per_step": (opt.comm.sync_points.point - points) / steps}
