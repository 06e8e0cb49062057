"""Tensor parallelism's random streams ([Note: tensor-parallel random streams]) and input check
([Note: tensor-parallel input fingerprint]), run inside the edge world of
test_tensor_parallel_edges.py (DP x TP = 2 x 2): dropout in the split region and in the
replicated region, with and without activation checkpointing, the random state saved and
restored as a zerodp checkpoint does it; a rank that feeds its tensor-parallel partner
another batch; the demo's training job (`zerodp train --config` with tensor_parallel_size)."""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn as nn

import zerodp
from tp_edge_cases import LR, STEPS, TP, gpt_batch, gpt_loss, gpt_zero, local_params, two_batch, two_input_net
from tp_slices import error_of
from zerodp.checkpoint.rng import rng_state, set_rng_state

INNER_P = 0.5  # dropout in the split region (between the column- and the row-parallel layer)
OUTER_P = 0.2  # dropout in the replicated region (the embedding's, each layer's output)


def _record_masks(model: nn.Module, log: dict) -> None:
    """Every dropout's mask, each time it runs, tagged with the loop's phase and step (calls
    during backward are recomputations of checkpointed layers)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.register_forward_hook(
                lambda mod, args, out, name=name: log["calls"].append((log["phase"], log["step"], name, out == 0)))


def region_run(rank: int, reentrant) -> dict:
    """Stage 3 at 2 x 2, every layer checkpointed (`reentrant` False / True) or not (None), every
    rank seeded by its rank (initialize shares tensor-parallel rank 0's random state). Two
    training steps; then the random state is taken as zerodp.save takes it, and the next
    forward runs twice, the state put back in between."""
    model = two_input_net(seed=rank, dropout=OUTER_P, reentrant=reentrant, inner_dropout=INNER_P)
    cfg = zerodp.Config(stage=3, tensor_parallel_size=TP, unit_min_params=50)
    model, opt = zerodp.initialize(model, torch.optim.SGD, cfg, lr=LR)
    log = {"calls": [], "phase": "", "step": 0}
    _record_masks(model, log)
    losses = []
    for step in range(STEPS):
        log.update(phase="forward", step=step)
        loss = model(*two_batch(step, opt.comm.rank))
        log["phase"] = "backward"
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    saved = rng_state()
    for again in ("first", "restored"):
        if again == "restored":
            set_rng_state(saved)
        log.update(phase=again, step=STEPS)
        with torch.no_grad():
            model(*two_batch(STEPS, opt.comm.rank))
    return {"losses": losses, "params": local_params(model), "calls": log["calls"]}


def input_check(rank: int) -> dict:
    """Stage 2 at 2 x 2: a clean step (its forward's fingerprint collectives read from the
    ledger), then rank 1 feeds its partner rank 0 the batch of data-parallel rank 1."""
    model, opt = gpt_zero(rank, 2)
    loss = gpt_loss(model, gpt_batch(0, opt.comm.rank))
    records = [(r.op, r.numel, r.nbytes, r.phase, r.axis) for r in opt.comm.ledger.current
               if r.label == "input fingerprint"]
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    wrong = gpt_batch(1, 1 - opt.comm.rank if rank == 1 else opt.comm.rank)
    return {"records": records, "error": error_of(lambda: gpt_loss(model, wrong))}


DEMO_BATCH = 2  # sequences per data-parallel rank without tensor parallelism


def demo_run(rank: int, root: str, tp: int) -> dict:
    """`zerodp train` on this world (the job itself, in-process): the tiny GPT at stage 2, two
    steps; with tensor_parallel_size 2 from a --config file, each data-parallel rank reading
    twice the batch, so that the global batch is the plain run's."""
    from zerodp.demo.train import Job, add_arguments

    out = os.path.join(root, f"demo-tp{tp}")
    argv = ["--model", "tiny", "--stage", "2", "--steps", "2", "--eval-every", "2", "--sample-tokens", "0",
            "--batch-size", str(DEMO_BATCH * tp), "--out", out]
    if tp > 1:
        config = os.path.join(root, "tp.json")
        if rank == 0:
            with open(config, "w") as f:
                json.dump({"tensor_parallel_size": tp}, f)
        torch.distributed.barrier()
        argv += ["--config", config]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    job = Job(parser.parse_args(argv))
    summary = job.run()
    return {"losses": [loss for _, loss in summary["losses"]], "val": summary["val_losses"],
            "data": (job.data_rank, job.data_size), "tokens_per_second": summary["tokens_per_second"]}
