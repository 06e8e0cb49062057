"""Hybrid sharding (Config.replicate_size=2 at world size 4: 2 rows x 2 shards), a case per
test in the session's world of 4 (test_hybrid.py, worldpool.py).

Each case returns plain numbers; the tests assert on them in the parent process. Parity
with DDP is compared at every step (parity.StepTrace): every parameter and the loss.
"""
from __future__ import annotations

import json
import os

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import zerodp
from core_cases import OPTIMIZERS, SMALL_BUCKET, Net, max_rel_diff, train_reference, train_zerodp
from parity import StepTrace
from zerodp.memory import formula_bytes

STATE_BYTES = {"sgd": 4, "adamw": 8}  # momentum; exp_avg + exp_avg_sq (fp32)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def as_two_nodes(rank: int) -> None:
    """What torchrun would say for 2 nodes of 2 ranks (the harness starts no torchrun).
    The world restores os.environ after each case (worldpool.py)."""
    os.environ.update({"LOCAL_WORLD_SIZE": "2", "RANK": str(rank), "GROUP_RANK": str(rank // 2)})


def step_bytes(opt) -> dict:
    """The ledger's summary of the last training step without the snapshots a trace takes
    between steps: at stage 3 they gather each unit through its own collectives (phase
    "checkpoint"), which land in the next step's records. No training step communicates in
    that phase."""
    ledger = opt.comm.ledger
    return ledger.summary([r for r in ledger.last_step if r.phase != "checkpoint"])


class UnitTrace(StepTrace):
    """A StepTrace whose snapshots are zerodp.full_state_dict: at stage 3 one gather per unit
    (phase "checkpoint", which step_bytes leaves out) instead of the sharded state dict's
    gather per unit and then an all-gather per parameter (DTensor.full_tensor); the same
    values under the same names. The optimizer it needs is the one that last stepped
    (`traced_run` registers the hook that tells it)."""

    optimizer = None

    def saw_step(self, optimizer, args, kwargs) -> None:
        if isinstance(optimizer, zerodp.ZeroOptimizer):
            self.optimizer = optimizer

    def record_step(self, model, loss) -> None:
        self.losses.append(float(loss))
        self.params.append({n: v.detach().float().clone()
                            for n, v in zerodp.full_state_dict(model, self.optimizer, cpu_offload=False).items()
                            if v.is_floating_point()})


def traced_run(model_fn, opt_fn, cfg, rank, **kwargs):
    """train_zerodp traced at every step (UnitTrace); (model, opt, losses, norms, trace)."""
    trace = UnitTrace()
    handle = register_optimizer_step_post_hook(trace.saw_step)
    try:
        model, opt, losses, norms, _ = train_zerodp(model_fn, opt_fn, cfg, rank, trace=trace, **kwargs)
    finally:
        handle.remove()
    return model, opt, losses, norms, trace


def hybrid_config(stage: int, **fields) -> zerodp.Config:
    return zerodp.Config(stage=stage, replicate_size=2, bucket_bytes=SMALL_BUCKET,
                         **({"unit_min_params": 10} if stage == 3 else {}), **fields)


# This worker's DDP runs of core_cases.Net, by (rank, optimizer, precision, clip): the world of
# 4 lives for the session (worldpool.py) and one DDP run serves every case of the same
# optimizer and dtype here and in zeropp_cases (DDP does not read the two-node environment).
# Every rank runs the same cases in the same order, so every rank has the same keys (DDP's
# construction is collective).
_REFERENCES: dict = {}


def reference(rank: int, opt_name: str, precision: str = "fp32", clip=None) -> tuple:
    """(model, losses, clipped norms, StepTrace) of DDP on Net, STEPS steps."""
    key = (rank, opt_name, precision, clip)
    if key not in _REFERENCES:
        trace = StepTrace()
        ref, losses, norms = train_reference(Net, OPTIMIZERS[opt_name], DTYPES[precision], rank, clip=clip,
                                             trace=trace)
        _REFERENCES[key] = (ref, losses, norms, trace)
    return _REFERENCES[key]


def _against_ddp(rank: int, opt_name: str, cfg: zerodp.Config, precision: str = "fp32", micro_batches: int = 1):
    """DDP and zerodp on the same batches, each traced at every step; the final parameters
    compared as a whole too (gathered)."""
    ref, ref_losses, _, ref_trace = reference(rank, opt_name, precision)
    model, opt, losses, _, trace = traced_run(Net, OPTIMIZERS[opt_name], cfg, rank, micro_batches=micro_batches)
    with zerodp.gathered_parameters(model):
        diff = max_rel_diff(model, ref)
    return model, opt, {
        "per_step": trace.compare(ref_trace), "diff": diff,
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses))}


def parity_case(rank: int, world_size: int, stage: int, opt_name: str) -> dict:
    """fp32, stage 1-3, one optimizer: parity with DDP, the stage formula over a row and the
    bytes per axis and link."""
    as_two_nodes(rank)
    _, opt, out = _against_ddp(rank, opt_name, hybrid_config(stage))
    volume = step_bytes(opt)
    mem = opt.memory_report()
    formula = formula_bytes(stage, mem.padded_numel, 2, 4, 4, 0, STATE_BYTES[opt_name])
    out.update({
        "topology": (opt.comm.shard_size, opt.comm.topology.replicate_size),
        "memory": {k: getattr(mem, k) for k in formula}, "formula": formula,
        "by_axis": volume["nbytes_by_axis"], "by_link": volume["nbytes_by_link"],
        "padded_numel": mem.padded_numel,
        "padding_state_nbytes": (mem.padded_numel - mem.numel) * STATE_BYTES[opt_name]})
    return out


def flat_stage3_case(rank: int, world_size: int) -> dict:
    """Stage 3 without hybrid sharding over the same 2 nodes: its one axis spans them."""
    as_two_nodes(rank)
    model, opt, _, _, volumes = train_zerodp(Net, OPTIMIZERS["sgd"], zerodp.Config(stage=3, unit_min_params=10), rank)
    return {"by_axis": volumes[-1]["nbytes_by_axis"], "by_link": volumes[-1]["nbytes_by_link"],
            "padded_numel": opt.memory_report().padded_numel}


def low_precision_case(rank: int, world_size: int, precision: str, stage: int) -> dict:
    """bf16 or fp16, AdamW, stage 2 or 3: the rows' all-reduce of the 16-bit shard too."""
    as_two_nodes(rank)
    _, opt, out = _against_ddp(rank, "adamw", hybrid_config(stage, mixed_precision=precision), precision)
    out["skipped"] = opt.skipped_steps
    return out


def accumulation_and_checkpoint_case(rank: int, world_size: int, root: str) -> dict:
    """Accumulation over 2 micro-batches at stage 2, reduced per micro-batch, against DDP on
    the whole batch; then a checkpoint of that run: written by row 0 only, loads without
    hybrid sharding."""
    as_two_nodes(rank)
    cfg = hybrid_config(2, grad_accumulation_steps=2)
    model, opt, out = _against_ddp(rank, "sgd", cfg, micro_batches=2)
    path = os.path.join(root, "hybrid")
    zerodp.save(path, model, opt)
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    out["writers"] = sorted({r for p in meta["params"].values() for r, _, _ in p["pieces"]})
    torch.manual_seed(1)
    flat_model, flat_opt = zerodp.initialize(Net(), OPTIMIZERS["sgd"], zerodp.Config(stage=2))
    zerodp.load(path, flat_model, flat_opt)
    out["loaded"] = max_rel_diff(flat_model, model)
    return out
