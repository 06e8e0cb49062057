"""Hybrid sharding (Config.replicate_size=2 at world size 4: 2 rows x 2 shards), inside one
spawned world (test_hybrid.py)."""
from __future__ import annotations

import json
import os

import torch

import zerodp
from core_cases import OPTIMIZERS, SMALL_BUCKET, Net, max_rel_diff, train_reference, train_zerodp
from zerodp.memory import formula_bytes

STATE_BYTES = {"sgd": 4, "adamw": 8}  # momentum; exp_avg + exp_avg_sq (fp32)


def as_two_nodes(rank: int) -> None:
    """What torchrun would say for 2 nodes of 2 ranks (the harness starts no torchrun)."""
    os.environ.update({"LOCAL_WORLD_SIZE": "2", "RANK": str(rank), "GROUP_RANK": str(rank // 2)})


def hybrid_world(rank: int, world_size: int, root: str) -> dict:
    as_two_nodes(rank)
    out: dict = {}
    for stage in (1, 2, 3):
        for name, opt_fn in OPTIMIZERS.items():
            cfg = zerodp.Config(stage=stage, replicate_size=2, bucket_bytes=SMALL_BUCKET,
                                **({"unit_min_params": 10} if stage == 3 else {}))
            ref, ref_losses, _ = train_reference(Net, opt_fn, torch.float32, rank)
            model, opt, losses, _, volumes = train_zerodp(Net, opt_fn, cfg, rank)
            with zerodp.gathered_parameters(model):
                diff = max_rel_diff(model, ref)
            mem = opt.memory_report()
            formula = formula_bytes(stage, mem.padded_numel, 2, 4, 4, 0, STATE_BYTES[name])
            out[(stage, name)] = {
                "diff": diff, "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "topology": (opt.comm.shard_size, opt.comm.topology.replicate_size),
                "memory": {k: getattr(mem, k) for k in formula}, "formula": formula,
                "by_axis": volumes[-1]["nbytes_by_axis"], "by_link": volumes[-1]["nbytes_by_link"],
                "padded_numel": mem.padded_numel,
                "padding_state_nbytes": (mem.padded_numel - mem.numel) * STATE_BYTES[name]}
    # Stage 3 without hybrid sharding over the same 2 nodes: its one axis spans them.
    model, opt, _, _, volumes = train_zerodp(Net, OPTIMIZERS["sgd"], zerodp.Config(stage=3, unit_min_params=10), rank)
    out["flat_stage3"] = {"by_axis": volumes[-1]["nbytes_by_axis"], "by_link": volumes[-1]["nbytes_by_link"],
                          "padded_numel": opt.memory_report().padded_numel}
    # bf16 and fp16 (AdamW, stages 2 and 3): the rows' all-reduce of the 16-bit shard too.
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for stage in (2, 3):
            cfg = zerodp.Config(stage=stage, replicate_size=2, mixed_precision=precision, bucket_bytes=SMALL_BUCKET,
                                **({"unit_min_params": 10} if stage == 3 else {}))
            ref, ref_losses, _ = train_reference(Net, OPTIMIZERS["adamw"], dtype, rank)
            model, opt, losses, _, _ = train_zerodp(Net, OPTIMIZERS["adamw"], cfg, rank)
            with zerodp.gathered_parameters(model):
                out[(precision, stage)] = {"diff": max_rel_diff(model, ref), "skipped": opt.skipped_steps,
                                           "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses))}
    # Accumulation over 2 micro-batches at stage 2, reduced per micro-batch.
    cfg = zerodp.Config(stage=2, replicate_size=2, bucket_bytes=SMALL_BUCKET, grad_accumulation_steps=2)
    ref, _, _ = train_reference(Net, OPTIMIZERS["sgd"], torch.float32, rank)
    model, opt, _, _, _ = train_zerodp(Net, OPTIMIZERS["sgd"], cfg, rank, micro_batches=2)
    out["accumulation"] = max_rel_diff(model, ref)
    # A checkpoint saved with hybrid sharding: written by row 0 only, loads without it.
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
