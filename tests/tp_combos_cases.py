"""Tensor parallelism beside the rest of zerodp (test_tp_combos.py): offload of the optimizer
(host, disk) and of the parameters, and hybrid sharding, at 2 x 2, each against one process on the global batch,
as tp_cases.train runs it."""
from __future__ import annotations

import torch

import zerodp
from tp_cases import build, reference, train

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
