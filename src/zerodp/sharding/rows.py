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

Under tensor parallelism a rank holds its slice of a split parameter ([Note:
tensor-parallel split] in tensor_parallel/split.py), and the DTensors live on a mesh of
every process with the ``tp`` axis outermost (`Topology.tensor_parallel_mesh`):
[Shard(dim) along tp, then the data axes as above], shape the original's. DTensor cuts
along its mesh axes in order, so this is exactly "the slice, then the slice's rows": DCP
writes each block once by its global offsets and reshards it to any layout, tensor
parallelism or not. An unsplit parameter is Replicate() along tp (written once). A slice
that is no block of the original (packed projections: GPT-2's q, k, v cut projection by
projection) cannot be a DTensor: the state dict holds that parameter whole on every rank
(its slice gathered over the data ranks, then the slices over the tensor-parallel ranks),
which DCP treats as replicated; loading cuts any whole value back to the rank's slice.

Under expert parallelism a bank is cut the same way over other axes: by expert over ``ep``
([Note: expert split] in expert_parallel/plan.py), then the rank's experts into rows over the
expert-data-parallel ranks, which ZeRO shards it over. Its DTensors live on the
("ep", "shard") mesh of those ranks (`Topology.expert_parallel_mesh`), placements (Shard(0),
Shard(0)); a second RowSharding cuts the banks (`of` picks it by parameter name), whose
flat groups and units hold banks only.
"""
from __future__ import annotations

import math
import sys
from typing import Mapping, Optional, Sequence

import torch

from ..distributed import Comm
from ..distributed.collectives import Collectives
from ..memory.layout import FlatLayout
from ..tensor_parallel.split import TensorSplit

__all__ = ["RowSharding", "copy_owned", "gather_runs", "gather_split", "is_dtensor", "scatter_runs"]


def is_dtensor(value) -> bool:
    """[Note: DTensor imported on use]
    `isinstance(value, DTensor)` without importing torch.distributed.tensor, which pulls in
    sympy and symbolic shapes: 0.8 s of the 2.6 s `import zerodp` took on a 2-core CPU, in
    every process a launch starts, most of which never make a DTensor. Until that module is
    imported no DTensor can exist; the code that makes them imports it where it does."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


class RowSharding:
    """How a sharded state dict cuts every parameter of one mesh into rows."""

    def __init__(self, comm: Comm, sharded: bool, splits: Optional[Mapping[str, TensorSplit]] = None, *,
                 split_axis: str = "tp", shard_comm: Optional[Comm] = None):
        """`splits` cut parameters over `comm`'s `split_axis` (``tp``; ``ep`` for expert banks);
        the rows are cut over the shard axis of `shard_comm` (default `comm`; for the banks,
        the expert-data-parallel ranks: [Note: expert-parallel axes] in distributed/topology.py)."""
        # Unsharded (stage 0, one rank on the shard axis, no process group): plain tensors,
        # which torch's checkpointing treats as replicated.
        shard_comm = comm if shard_comm is None else shard_comm
        self.comm, self.topology, self.split_axis = comm, shard_comm.topology, split_axis
        self.collectives = shard_comm.collectives("shard")
        self.sharded = sharded and self.topology.mesh is not None and self.topology.shard_size > 1
        self.rank, self.size = self.topology.shard_rank, self.topology.shard_size
        self.split_size = comm.topology.size(split_axis)
        self.split_rank = comm.topology.rank_on(split_axis)
        self.splits = dict(splits or {}) if self.split_size > 1 else {}
        self.banks: Optional[RowSharding] = None

    def with_banks(self, banks: "RowSharding") -> "RowSharding":
        """This sharding, handing the expert banks `banks.splits` names to `banks` (`of`)."""
        self.banks = banks
        return self

    def of(self, param: Optional[str]) -> "RowSharding":
        """The sharding that cuts parameter `param`: an expert bank's under expert
        parallelism ([Note: row shards]), else this one."""
        return self.banks if self.banks is not None and param in self.banks.splits else self

    def of_storage(self, names: Sequence[str]) -> "RowSharding":
        """The sharding of a flat group's or unit's parameters `names`: banks only or none ([Note:
        row shards]), so its first parameter's."""
        return self.of(names[0]) if len(names) else self

    def is_split(self, param: Optional[str]) -> bool:
        """Whether `param` is held as a slice of the original (tensor-parallel or a bank's experts)."""
        return param is not None and param in self.of(param).splits

    def _split(self, param: Optional[str]) -> Optional[TensorSplit]:
        return self.splits.get(param) if param is not None else None

    def _joined(self, split: Optional[TensorSplit]) -> bool:
        """Whether a state dict holds the parameter whole on every rank: packed projections
        (GPT-2's q, k, v) under tensor parallelism, whose slice is no block of the original."""
        return split is not None and split.parts > 1

    def row_range(self, shape: Sequence[int], rank: Optional[int] = None) -> tuple[int, int]:
        """The elements [lo, hi) of the flattened parameter that `rank` holds as a DTensor."""
        numel = math.prod(shape)
        if not self.sharded or len(shape) == 0:
            return 0, numel
        rank = self.rank if rank is None else rank
        rows, inner = shape[0], math.prod(shape[1:])
        per = -(-rows // self.size)
        return min(rank * per, rows) * inner, min((rank + 1) * per, rows) * inner

    def range_of(self, shape: Sequence[int], param: Optional[str] = None) -> tuple[int, int]:
        """What `wrap` needs of this rank's (slice of the) parameter: its rows, or all of it
        for a parameter the state dict holds whole."""
        return (0, math.prod(shape)) if self._joined(self._split(param)) else self.row_range(shape)

    def contribution(self, shape: Sequence[int]) -> tuple[int, int]:
        """What this rank puts into a reduce-scatter from rows: its rows; a replicated
        (0-d) parameter from shard rank 0 only, so that the sum counts it once."""
        if self.sharded and len(shape) == 0 and self.rank != 0:
            return 0, 0
        return self.row_range(shape)

    def _placements(self, shape, split: Optional[TensorSplit] = None, rows: bool = True) -> list:
        """A DTensor's placements: under tensor parallelism the ``tp`` axis first (the slice),
        then the data-parallel axes: rows along ``shard`` (`rows`, when sharded), else replicated."""
        from torch.distributed.tensor import Replicate, Shard  # [Note: DTensor imported on use]

        axis = [Shard(0)] if len(shape) and rows and self.sharded else [Replicate()]
        data = [Replicate()] + axis if self.topology.replicate_size > 1 else axis
        if self.split_size == 1:
            return data
        return [Shard(split.dim) if split is not None else Replicate()] + \
            (data if self.topology.mesh is not None else [])

    def _mesh(self):
        if self.split_size == 1:
            return self.topology.mesh
        if self.split_axis == "ep":
            return self.comm.topology.expert_parallel_mesh(self.topology)
        return self.topology.tensor_parallel_mesh()

    def wrap(self, rows: torch.Tensor, shape: Sequence[int], param: Optional[str] = None) -> torch.Tensor:
        """This rank's rows (flat, `range_of`) of parameter `param` (its tensor-parallel slice
        of shape `shape`) as the state dict's value: a DTensor when sharded or split, with the
        original's shape; a packed projection under tensor parallelism whole (collective over
        the tensor-parallel ranks)."""
        return self._wrap(rows, shape, param, rows=True)

    def wrap_slice(self, value: torch.Tensor, param: str) -> torch.Tensor:
        """A parameter every data-parallel rank holds whole (stages 0-2), under tensor
        parallelism: its slice `value` as a DTensor of the original's shape (or whole)."""
        return self._wrap(value.reshape(-1), tuple(value.shape), param, rows=False)

    def _wrap(self, flat: torch.Tensor, shape: Sequence[int], param: Optional[str], rows: bool) -> torch.Tensor:
        split = self._split(param)
        if self._joined(split):
            return self._join(flat, shape, split, param)
        if self.split_size == 1 and not (self.sharded and rows):
            return flat.view(tuple(shape))
        lo, hi = self.row_range(shape) if rows else (0, math.prod(shape))
        local_rows = (hi - lo) // max(1, math.prod(shape[1:])) if len(shape) else None
        local = flat.view((local_rows, *shape[1:]) if len(shape) else ())
        full = tuple(split.global_shape(shape)) if split is not None else tuple(shape)
        stride = torch.empty(full, device="meta").stride()
        from torch.distributed.tensor import DTensor  # [Note: DTensor imported on use]

        return DTensor.from_local(local, self._mesh(), self._placements(shape, split, rows), run_check=False,
                                  shape=torch.Size(full), stride=stride)

    def _join(self, flat: torch.Tensor, shape: Sequence[int], split: TensorSplit, param: str) -> torch.Tensor:
        return gather_split(self.comm, flat.view(tuple(shape)), split, label=param, axis=self.split_axis)

    def whole(self, value: torch.Tensor, name: str, shape: Optional[Sequence[int]] = None,
              param: Optional[str] = None) -> torch.Tensor:
        """A state dict value whole (this rank's tensor-parallel slice `shape` of parameter
        `param`, when split): a DTensor cut as `wrap` cuts it is all-gathered along the shard
        axis (padded rows, equal chunks), any other DTensor gathered by torch."""
        shape = tuple(value.shape) if shape is None else tuple(shape)
        kind, flat = self.unwrap(value, shape, name, param)
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

    def unwrap(self, value: torch.Tensor, shape: Sequence[int], name: str,
               param: Optional[str] = None) -> tuple[str, torch.Tensor]:
        """("rows", this rank's rows, flat) for a DTensor cut as `wrap` cuts it, else
        ("full", the whole flat value of this rank's slice `shape` of parameter `param`);
        raises naming `name` when the shape is not the original's."""
        split = self._split(param)
        full_shape = tuple(split.global_shape(shape)) if split is not None else tuple(shape)
        if tuple(value.shape) != full_shape:
            raise ValueError(f"{name}: the state dict holds shape {tuple(value.shape)}, the model's parameter is "
                             f"{full_shape}: load a state dict of this model")
        if is_dtensor(value):
            ours = value.device_mesh == self._mesh() and not self._joined(split)
            placements = tuple(value.placements)
            if ours and self.sharded and placements == tuple(self._placements(shape, split, rows=True)):
                local = value.to_local().detach().reshape(-1)
                lo, hi = self.row_range(shape)
                if local.numel() != hi - lo:
                    raise ValueError(f"{name}: the DTensor holds {local.numel()} elements on this rank, "
                                     f"its rows are {hi - lo}")
                return "rows", local
            if ours and placements == tuple(self._placements(shape, split, rows=False)):
                return "full", value.to_local().detach().reshape(-1)  # this rank's whole slice
            value = value.full_tensor()  # cut another way (e.g. another mesh): whole, then ours
        value = value.detach()
        if split is not None:
            value = split.cut(value.reshape(full_shape), self.split_rank)
        return "full", value.reshape(-1)


def gather_split(comm: Comm, local: torch.Tensor, split: TensorSplit, label: str = "",
                 axis: str = "tp") -> torch.Tensor:
    """The original parameter from every tensor-parallel rank's slice `local` (collective over
    the ``tp`` axis; an expert bank's over ``ep``), on `local`'s device: an offloaded slice on
    the host is gathered on the comm's device and comes back home."""
    home = local.device
    flat = local.reshape(-1).to(comm.device).contiguous()
    gathered = torch.empty((split.size, flat.numel()), dtype=flat.dtype, device=flat.device)
    comm.collectives(axis).all_gather(gathered.view(-1), flat, "checkpoint", label=label)
    return split.join([g.view(local.shape) for g in gathered]).to(home)


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
