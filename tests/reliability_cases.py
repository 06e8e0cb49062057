"""Ranks that part ways, run inside one spawned world of 2 (test_reliability.py). Each case
uses a short collective timeout, so a hang costs seconds, and a fresh zerodp process
group (`forget_meshes`): a case leaves its group broken on purpose."""
from __future__ import annotations

import os
import pickle
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import zerodp
from zerodp.distributed.topology import forget_meshes

# Every failure below waits out one timeout (and as long again for the peers' reports:
# distributed/failure.py), so it is short; the healthy collectives between are of a few
# hundred elements between two processes, milliseconds apart.
TIMEOUT_S = 2.0
PEER_DIES_TIMEOUT_S = 30.0


class Blocks(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


class Tapered(nn.Module):
    """Units of three sizes: a gather on one rank alone meets a gather of another size."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(8, 16)])

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def build(stage: int, accumulation: int = 1, model: nn.Module = None, timeout_s: float = TIMEOUT_S):
    # The previous case may have left one rank seconds behind the other (it was waiting out a
    # timeout); creating the next zerodp group waits for its peers only that long, so the
    # ranks meet first at a plain torch barrier (the default group, the harness's timeout).
    dist.barrier()
    forget_meshes()
    torch.manual_seed(0)
    cfg = zerodp.Config(stage=stage, collective_timeout_s=timeout_s, unit_modules=(nn.Linear,) if stage == 3 else (),
                        bucket_bytes=1024, grad_accumulation_steps=accumulation)
    return zerodp.initialize(Blocks() if model is None else model, torch.optim.SGD, cfg, lr=0.1)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * rank + step))


def train_step(model, opt, rank: int, step: int) -> None:
    opt.backward(model(batch(rank, step)).square().mean())
    opt.step()
    opt.zero_grad()


def timed(fn) -> dict:
    """What `fn` raised (type and message) and how long it took to raise."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and message are what the tests check
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"type": None, "message": "", "seconds": time.monotonic() - start}


def reliability_world(rank: int, world_size: int, root: str) -> dict:
    out: dict = {}

    # A rank that raises on its own (and leaves zerodp's collectives) fails the other at its
    # next collective, within the timeout, with a message naming the rank that did not come.
    for stage in (2, 3):
        model, opt = build(stage)
        train_step(model, opt, rank, 0)

        def one_rank_raises():
            if rank == 1:
                raise ValueError("a bad batch on rank 1")
            train_step(model, opt, rank, 1)
        out[("raises", stage)] = timed(one_rank_raises)

    # The DDP habit `if rank == 0: save(...)`: both ranks raise, and the message says that
    # every rank must call it; nothing is left that `latest()` would trust.
    model, opt = build(2)
    train_step(model, opt, rank, 0)
    path = os.path.join(root, "one_rank_save")

    def save_on_rank0_only():
        if rank == 0:
            zerodp.save(path, model, opt)
        else:
            train_step(model, opt, rank, 1)
    out["save_one_rank"] = timed(save_on_rank0_only)
    out["save_one_rank_latest"] = zerodp.latest(root)

    # Collectives that pair up across ranks although they are different calls (NCCL pairs
    # equal-sized ones silently): caught by the step fingerprint before the weights change
    # ([Note: step fingerprint]). On gloo a real one is refused before it runs ([Note: gloo
    # pairing]), so a ledger record on its own stands for the pairing here.
    model, opt = build(2)
    before = [p.detach().clone() for p in model.parameters()]

    def mismatched_but_paired():
        opt.backward(model(batch(rank, 0)).square().mean())
        opt.comm.ledger.record("all_reduce", 4, 16, "forward" if rank == 0 else "backward", label="user's own")
        opt.step()
    out["fingerprint"] = timed(mismatched_but_paired)
    out["fingerprint_untouched"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    model, opt = build(2)
    before = [p.detach().clone() for p in model.parameters()]

    def mismatched_collectives():
        opt.backward(model(batch(rank, 0)).square().mean())
        opt.comm.all_reduce(torch.zeros(4), "forward" if rank == 0 else "backward", label="user's own")
        opt.step()
    out["refused"] = timed(mismatched_collectives)
    out["refused_untouched"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    # Rank 0 logs its weights under `if rank == 0` at stage 3 (a gather the other rank never
    # makes): both ranks raise instead of training on mixed-up parameters.
    model, opt = build(3)
    train_step(model, opt, rank, 0)

    def gathers_on_one_rank():
        if rank == 0:
            with zerodp.gathered_parameters(model):
                pass
        for step in (1, 2):
            train_step(model, opt, rank, step)
    out["gather_one_rank"] = timed(gathers_on_one_rank)

    # The same with units of different sizes ([Note: gloo pairing] in distributed/collectives.py):
    # rank 0's gathers used to pair with rank 1's gathers of other sizes, and gloo aborted
    # rank 1's process from its I/O thread (no error, no report). Now they never pair: both
    # ranks time out and name each other's collective.
    def log_weights(model):
        with zerodp.gathered_parameters(model):
            pass

    def eval_forward(model):
        model.eval()
        with torch.no_grad():
            model(batch(rank, 99))
        model.train()

    for name, alone in (("gathered_parameters", log_weights), ("eval", eval_forward)):
        torch.manual_seed(0)
        model, opt = build(3, model=Tapered())
        train_step(model, opt, rank, 0)

        def on_rank0_only():
            if rank == 0:
                alone(model)
            for step in (1, 2):
                train_step(model, opt, rank, step)
        out[("rank0_only", name)] = timed(on_rank0_only)

    # Other collectives of different sizes (a clip on one rank against the other's step
    # agreement) are caught before they run, by the agreement each is preceded by on gloo.
    model, opt = build(2)

    def clip_on_rank0_only():
        opt.backward(model(batch(rank, 0)).square().mean())
        if rank == 0:
            opt.clip_grad_norm_(1.0)
        opt.step()
    out["clip_one_rank"] = timed(clip_on_rank0_only)

    # One rank takes an extra micro-batch: it raises at once, naming the boundary; the other
    # raises at its next collective, naming it.
    model, opt = build(2, accumulation=2)  # stage 2: its forward has no collective of its own

    def extra_micro_batch():
        for micro in range(3 if rank == 1 else 2):
            opt.backward(model(batch(rank, micro)).square().mean())
        opt.step()
    out["extra_micro_batch"] = timed(extra_micro_batch)

    # Ranks that load different checkpoints (a latest() that raced a save on a shared
    # filesystem) are refused on every rank before anything changes.
    model, opt = build(2)
    train_step(model, opt, rank, 0)
    zerodp.save(os.path.join(root, "agree", "a"), model, opt)
    train_step(model, opt, rank, 1)
    zerodp.save(os.path.join(root, "agree", "b"), model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    out["load_differs"] = timed(lambda: zerodp.load(os.path.join(root, "agree", "a" if rank == 0 else "b"), model, opt))
    out["load_differs_untouched"] = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    # Healthy training pays one 24-byte agreement per step.
    model, opt = build(2)
    train_step(model, opt, rank, 0)
    out["agreements_per_step"] = sum(1 for r in opt.comm.ledger.last_step if r.label == "step agreement")
    forget_meshes()
    return out


def peer_dies_world(rank: int, world_size: int, result_path: str) -> None:
    """Rank 1's process ends outright after a step (an OOM kill, a segfault); rank 0's next
    collective fails at once. Rank 0 writes what it raised to `result_path` itself: with a
    rank gone, the harness returns no results."""
    from zerodp.distributed import failure

    failure.REPORT_WAIT_S = 1.0  # the only peer that could report is gone: no use waiting 5 s for it
    # Nothing here waits out a timeout: a long one, so that freshly started processes are
    # never failed by it, and a failure well inside it was not one.
    model, opt = build(2, timeout_s=PEER_DIES_TIMEOUT_S)
    train_step(model, opt, rank, 0)
    if rank == 1:
        os._exit(0)
    result = timed(lambda: train_step(model, opt, rank, 1))
    with open(result_path, "wb") as f:
        pickle.dump(result, f)
