"""Topology and collective-strategy cases, run inside one spawned world (test_topology.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import zerodp
from zerodp.distributed import Comm, Topology
from zerodp.distributed.collectives import GlooCollectives


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return ""


class HalfOnTheWire(GlooCollectives):
    """Moves the same bytes as gloo's strategy but says it sent half, and counts its calls:
    what a quantized strategy would look like to the ledger."""

    calls = 0

    def wire_nbytes(self, full: torch.Tensor) -> int:
        HalfOnTheWire.calls += 1
        return full.numel() * full.element_size() // 2


def topology_world(rank: int, world_size: int) -> dict:
    out: dict = {}
    flat = Topology.build(None, torch.device("cpu"))
    out["flat"] = {"names": flat.mesh.mesh_dim_names, "shape": tuple(flat.mesh.shape),
                   "shard": (flat.shard_size, flat.shard_rank), "replicate": (flat.replicate_size, flat.replicate_rank),
                   "rank": flat.rank, "shard_group_is_world": flat.shard_group is dist.group.WORLD,
                   "cached": Topology.build(None, torch.device("cpu")).mesh is flat.mesh}

    grid = Topology.build(None, torch.device("cpu"), replicate_size=2)
    comm = Comm(topology=grid)
    row = torch.zeros(grid.shard_size)
    comm.collectives("shard").all_gather(row, torch.tensor([float(rank)]), "forward")
    col = torch.tensor([float(rank)])
    comm.all_reduce(col, "step", axis="replicate")
    both = torch.tensor([float(rank)])
    comm.all_reduce(both, "step")
    comm.ledger.end_step()
    out["grid"] = {"shard": (grid.shard_size, grid.shard_rank), "replicate": (grid.replicate_size, grid.replicate_rank),
                   "rank": grid.rank, "row": row.tolist(), "col_sum": col.item(), "all_sum": both.item(),
                   "by_axis": comm.ledger.summary()["nbytes_by_axis"]}
    out["not_a_divisor"] = error_of(lambda: Topology.build(None, torch.device("cpu"), replicate_size=3))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    out["hybrid_not_a_divisor"] = error_of(lambda: zerodp.initialize(model, torch.optim.SGD,
                                                                     zerodp.Config(stage=3, replicate_size=3), lr=0.1))

    # A strategy handed to a unit is the one its gathers and reduce-scatters go through,
    # and the ledger records the bytes it says it sent.
    results = {}
    for strategy in ("default", "half"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        model, opt = zerodp.initialize(model, torch.optim.SGD, zerodp.Config(stage=3, unit_min_params=10), lr=0.1)
        if strategy == "half":
            for unit in opt.stage3.units:  # training's strategy (checkpoints keep the exact one)
                unit.transfer = HalfOnTheWire(unit.collectives.group, "shard", unit.collectives.size,
                                              unit.collectives.rank, opt.comm.ledger, opt.comm.device)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        opt.backward(model(x).square().mean())
        opt.step()
        calls = HalfOnTheWire.calls
        with zerodp.gathered_parameters(model):
            params = [p.detach().clone() for p in model.parameters()]
        results[strategy] = {"shard_nbytes": opt.comm.ledger.summary()["nbytes_by_axis"].get("shard", 0),
                             "params": params, "calls": calls}
    out["strategy"] = {"calls": results["half"]["calls"],
                       "nbytes": (results["default"]["shard_nbytes"], results["half"]["shard_nbytes"]),
                       "same_result": all(torch.equal(a, b) for a, b in zip(results["default"]["params"],
                                                                              results["half"]["params"]))}
    return out
