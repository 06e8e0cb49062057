"""Between zerodp's flat shards and the row shards of torch's sharded state dicts.

[Note: row shards]
torch.distributed.checkpoint, `get_state_dict` and FSDP2 describe a sharded tensor as a
DTensor on a mesh: along the shard axis each rank holds one block of rows (dim 0, cut as
torch.chunk cuts it: ceil(d0/N) rows each, the last ranks possibly fewer or none), along the
replicate axis every row of the mesh holds the same. zerodp's shards are runs of a flat
buffer ([Note: flat layout] in memory/layout.py) that cut parameters anywhere, so they are
not DTensors; but a rank's rows of a contiguous parameter are one run of its flattened
elements too, and converting is moving runs:

- to rows: segment by segment, all-gather the flat chunks along the shard axis and keep
  the run each rank wants (its rows; or everything, for a full state dict);
- from rows: put the rank's rows in a zero segment and reduce-scatter it; every element is
  non-zero on exactly one rank, so the sum is exact in any dtype (x + 0 = x).

Only one segment is whole at a time (a unit at stage 3, a bucket at stages 1-2). A 0-d
parameter has no rows: it is replicated, and only shard rank 0 contributes it. Values
given in full need no collective: each rank copies out the elements it owns.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..distributed import Comm
from ..distributed.collectives import Collectives
from ..memory.layout import FlatLayout

__all__ = ["RowSharding", "gather_runs", "scatter_runs", "copy_owned"]


class RowSharding:
    """How a sharded state dict cuts every parameter of one mesh into rows."""

    def __init__(self, comm: Comm, sharded: bool):
        # Unsharded (stage 0, one rank on the shard axis, no process group): plain tensors,
        # which torch's checkpointing treats as replicated.
        self.comm, self.topology = comm, comm.topology
        self.collectives = comm.collectives("shard")
        self.sharded = sharded and self.topology.mesh is not None and self.topology.shard_size > 1
        self.rank, self.size = self.topology.shard_rank, self.topology.shard_size

    def refuse_tensor_parallel(self, what: str) -> None:
        """The rows are DTensors over the data-parallel mesh only: under tensor parallelism
        each tensor-parallel rank would describe its own slice under the parameter's name as
        if it were the whole, and torch.distributed.checkpoint would keep one of them."""
        tp = self.topology.tp_size
        if tp > 1:
            raise RuntimeError(f"{what} with Config.tensor_parallel_size={tp} is not supported: its DTensors span "
                               f"the data-parallel ranks only. zerodp.save / zerodp.load checkpoint the model and "
                               f"optimizer under tensor parallelism (loadable at any layout), and "
                               f"zerodp.full_state_dict gives the whole model")

    def row_range(self, shape: Sequence[int], rank: Optional[int] = None) -> tuple[int, int]:
        """The elements [lo, hi) of the flattened parameter that `rank` holds as a DTensor."""
        numel = math.prod(shape)
        if not self.sharded or len(shape) == 0:
            return 0, numel
        rank = self.rank if rank is None else rank
        rows, inner = shape[0], math.prod(shape[1:])
        per = -(-rows // self.size)
        return min(rank * per, rows) * inner, min((rank + 1) * per, rows) * inner

    def contribution(self, shape: Sequence[int]) -> tuple[int, int]:
        """What this rank puts into a reduce-scatter from rows: its rows; a replicated
        (0-d) parameter from shard rank 0 only, so that the sum counts it once."""
        if self.sharded and len(shape) == 0 and self.rank != 0:
            return 0, 0
        return self.row_range(shape)

    def _placements(self, shape) -> list:
        axis = [Shard(0)] if len(shape) else [Replicate()]
        return [Replicate()] + axis if self.topology.replicate_size > 1 else axis

    def wrap(self, rows: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """This rank's rows (flat) as the state dict's value: a DTensor when sharded."""
        if not self.sharded:
            return rows.view(tuple(shape))
        lo, hi = self.row_range(shape)
        local_shape = (hi - lo) // max(1, math.prod(shape[1:])) if len(shape) else None
        local = rows.view((local_shape, *shape[1:]) if len(shape) else ())
        stride = torch.empty(tuple(shape), device="meta").stride()
        return DTensor.from_local(local, self.topology.mesh, self._placements(shape), run_check=False,
                                  shape=torch.Size(shape), stride=stride)

    def whole(self, value: torch.Tensor, name: str) -> torch.Tensor:
        """A state dict value whole: a DTensor cut as `wrap` cuts it is all-gathered along the
        shard axis (padded rows, equal chunks), any other DTensor gathered by torch."""
        shape = tuple(value.shape)
        kind, flat = self.unwrap(value, shape, name)
        if kind == "full":
            return flat.view(shape)
        rows, inner = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        per = -(-rows // self.size) * inner
        mine = torch.zeros(per, dtype=flat.dtype, device=flat.device)
        mine[: flat.numel()].copy_(flat)
        out = torch.empty(per * self.size, dtype=flat.dtype, device=flat.device)
        self.collectives.all_gather(out, mine, "checkpoint", label=name)
        return out[: math.prod(shape)].view(shape)

    def into_shard(self, layout: FlatLayout, found: dict, collectives: Collectives, dtype: torch.dtype,
                   device: torch.device, label: str = "") -> torch.Tensor:
        """A shard (shard_numel elements) holding, at this rank's positions, the values of
        `found` = {slot: `unwrap`'s (kind, value)}: rows through one reduce-scatter per
        segment (collective when any is rows: the same slots on every rank), full values
        copied. Positions of other slots are zero."""
        by_rows = {}
        for i, (kind, v) in found.items():
            if kind == "rows":
                shape = layout.slots[i].shape
                by_rows[i] = (self.row_range(shape)[0], v if self.contribution(shape)[1] else v[:0])
        shard = scatter_runs(layout, by_rows, collectives, dtype, device, "checkpoint", label) if by_rows else \
            torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        for i, (kind, v) in found.items():
            if kind == "full":
                copy_owned(layout, collectives.rank, i, v.to(dtype), shard)
        return shard

    def unwrap(self, value: torch.Tensor, shape: Sequence[int], name: str) -> tuple[str, torch.Tensor]:
        """("rows", this rank's rows, flat) for a DTensor cut as `wrap` cuts it, else
        ("full", the whole flat value); raises naming `name` when the shape is wrong."""
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{name}: the state dict holds shape {tuple(value.shape)}, the model's parameter is "
                             f"{tuple(shape)}: load a state dict of this model")
        if isinstance(value, DTensor):
            if self.sharded and value.device_mesh == self.topology.mesh and \
                    tuple(value.placements) == tuple(self._placements(shape)):
                local = value.to_local().detach().reshape(-1)
                lo, hi = self.row_range(shape)
                if local.numel() != hi - lo:
                    raise ValueError(f"{name}: the DTensor holds {local.numel()} elements on this rank, "
                                     f"its rows are {hi - lo}")
                return "rows", local
            value = value.full_tensor()  # cut another way (e.g. another mesh): whole, then ours
        return "full", value.detach().reshape(-1)


def _overlap(a: int, b: int, c: int, d: int) -> tuple[int, int]:
    return max(a, c), min(b, d)


def _needed_segments(layout: FlatLayout, slots: Sequence[int]) -> list[int]:
    """Segments that hold any element of `slots` (the same on every rank)."""
    return sorted({k for i in slots for k in layout.segments_of(i)})


def gather_runs(layout: FlatLayout, shard: torch.Tensor, collectives: Collectives,
                wanted: dict[int, tuple[int, int]], phase: str, label: str = "") -> dict[int, torch.Tensor]:
    """For each slot i of `wanted`, the elements [lo, hi) of that flattened parameter,
    assembled from every rank's `shard` ([Note: row shards]). Collective over the shard
    axis; every rank passes the same slots (ranges may differ)."""
    out = {i: torch.empty(hi - lo, dtype=shard.dtype, device=shard.device) for i, (lo, hi) in wanted.items()}
    for k in _needed_segments(layout, list(wanted)):
        seg, chunk = layout.segments[k], layout.chunk(k, collectives.rank)
        full = torch.empty(seg.numel, dtype=shard.dtype, device=shard.device)
        collectives.all_gather(full, shard[chunk.shard_start: chunk.shard_start + chunk.numel], phase,
                               label=label or f"segment {k}")
        for i, (lo, hi) in wanted.items():
            off = layout.slots[i].offset
            a, b = _overlap(off + lo, off + hi, seg.start, seg.end)
            if a < b:
                out[i][a - off - lo: b - off - lo].copy_(full[a - seg.start: b - seg.start])
    return out


def scatter_runs(layout: FlatLayout, runs: dict[int, tuple[int, torch.Tensor]], collectives: Collectives,
                 dtype: torch.dtype, device: torch.device, phase: str, label: str = "") -> torch.Tensor:
    """A shard (shard_numel elements) holding, at this rank's positions, the values every
    rank contributed: runs[i] = (lo, values) puts `values` at element lo of slot i
    ([Note: row shards]). Elements of slots nobody contributed are zero."""
    shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
    for k in _needed_segments(layout, list(runs)):
        seg, chunk = layout.segments[k], layout.chunk(k, collectives.rank)
        full = torch.zeros(seg.numel, dtype=dtype, device=device)
        for i, (lo, values) in runs.items():
            off = layout.slots[i].offset
            a, b = _overlap(off + lo, off + lo + values.numel(), seg.start, seg.end)
            if a < b:
                full[a - seg.start: b - seg.start].copy_(values[a - off - lo: b - off - lo])
        collectives.reduce_scatter(shard[chunk.shard_start: chunk.shard_start + chunk.numel], full, phase,
                                   label=label or f"segment {k}")
    return shard


def copy_owned(layout: FlatLayout, rank: int, slot: int, full: torch.Tensor, shard: torch.Tensor) -> None:
    """The elements of slot `slot` that `rank` owns, from the whole flat value `full`, into
    their places in `shard`: no collective."""
    for start, shard_start, numel in layout.slot_pieces(slot, rank):
        shard[shard_start: shard_start + numel].copy_(full[start: start + numel])
