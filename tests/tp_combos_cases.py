"""Tensor parallelism beside the rest of zerodp (test_tp_combos.py): offload of the optimizer
(host, disk) and of the parameters, and hybrid sharding, at 2 x 2, each against one process on the global batch,
as tp_cases.train runs it."""
from __future__ import annotations

import torch

import zerodp
from tp_cases import (BATCH, CLIP, GPT_CFG, OPTIMIZERS, STEPS, build, global_batch, local_params, loss_of, reference,
                      train)
from zerodp.demo.models import GPT

COMBOS = {
    "offload host, stage 1": (1, {"offload_optimizer": "host"}),
    "offload host, stage 3": (3, {"offload_optimizer": "host"}),
    "offload disk + params disk, stage 3": (3, {"offload_optimizer": "disk", "offload_params": "disk"}),
    # Hybrid sharding over the 2 data-parallel ranks: 2 rows of 1 (all a world of 4 allows).
    "hybrid replicate_size=2, stage 3": (3, {"replicate_size": 2}),
    "hybrid replicate_size=2 + offload host, stage 2": (2, {"replicate_size": 2, "offload_optimizer": "host"}),
}


def combo_case(rank: int, world_size: int, name: str, offload_dir: str) -> dict:
    stage, fields = COMBOS[name]
    if "disk" in fields.values():
        fields = {**fields, "offload_dir": offload_dir}
    ref = reference("gpt", "sgd", 2) if rank == 0 else None
    mesh_only = {k: v for k, v in fields.items() if k == "replicate_size"}  # an offload dir takes one run
    _, opt = zerodp.initialize(build("gpt"), torch.optim.SGD, zerodp.Config(stage=stage, tensor_parallel_size=2,
                                                                            **mesh_only), lr=0.1)
    t = opt.comm.topology
    mesh = {"tp": t.tp_size, "replicate": t.replicate_size, "shard": t.shard_size}
    return {**train("gpt", "sgd", 2, 2, stage, rank, **fields), "ref": ref, "mesh": mesh}


def meta_case(rank: int, world_size: int, stage: int) -> dict:
    """The GPT built under zerodp.init (seeded as tp_cases.build seeds it: rank 0's is the
    reference's weights), then tp_cases' run at 2 x 2."""
    torch.manual_seed(rank)
    with zerodp.init():
        model = GPT(GPT_CFG)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, opt = zerodp.initialize(model.train(), torch.optim.SGD, zerodp.Config(stage=stage, tensor_parallel_size=2),
                                   **OPTIMIZERS["sgd"][1])
    dp_rank, losses = rank // 2, []
    for step in range(STEPS):
        loss = loss_of("gpt", model, global_batch(step, 2)[dp_rank * BATCH:(dp_rank + 1) * BATCH])
        opt.backward(loss)
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"params": local_params(model), "losses": losses, "ref": reference("gpt", "sgd", 2) if rank == 0 else None}


QWZ_BLOCK = 64


def qwz_case(rank: int, world_size: int) -> dict:
    """tp_cases' run at 2 x 2 stage 3, plain and with qwZ (quantized weight gathers)."""
    return {"plain": train("gpt", "sgd", 2, 2, 3, rank),
            "qwz": train("gpt", "sgd", 2, 2, 3, rank, quantize_weights=True, quantize_block_size=QWZ_BLOCK)}
