"""A stage-3 unit's frozen parameters: their sharded storage, and their runs as a checkpoint sees them.

[Note: frozen parameters]
A unit's frozen parameters (requires_grad=False: a fine-tune's pretrained base) are
sharded too, as DeepSpeed's ZeRO-3 and FSDP2 shard them: a rank keeps 1/N of them between
uses, so a frozen base of Ψ_f elements costs 2Ψ_f/N bytes per rank in 16 bits instead of
2Ψ_f. They live in `FrozenPart`s, one per dtype (a bf16 base beside fp32 adapters in one
unit, which FSDP2 cannot mix), gathered and freed with the unit's trainable parameters,
with their own collective: no gradient buffer, no reduction, no optimizer state, no master.
Their gathers move exact values (never ZeRO++'s quantized transfer nor hpZ's node copy).
A frozen fp32 parameter takes the compute dtype, as a replicated one does at stages 0-2.
The trainable parameters' gradient hooks no longer tell when the unit's backward is over
(a frozen weight is still read by the op that computes its input's gradient), so the
schedule also waits for the gradients of the unit's inputs (stage3.py, `_BackwardDone`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ..distributed import Comm
from ..memory.layout import FlatLayout
from ..memory.placement import Placement
from ..memory.pool import BufferPool

__all__ = ["ONE_SEGMENT", "FrozenPart", "StagedShard", "FrozenSlice", "fingerprint", "frozen_dtype", "frozen_slices"]

# A unit's storage is one segment: gathered (and reduced) with one collective each.
ONE_SEGMENT = 1 << 62


def fingerprint(full: torch.Tensor) -> tuple[float, float]:
    """(sum, norm) of a unit's values in float64, a million elements at a time: an upcast of
    the whole unit would hold twice its bytes at once (measured: +128 MiB per 64 MiB unit)."""
    total, squares = 0.0, 0.0
    for part in full.split(1 << 20):
        part = part.double()
        total += float(part.sum())
        squares += float(torch.linalg.vector_norm(part)) ** 2
    return total, squares ** 0.5


def frozen_dtype(param: torch.Tensor, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a frozen parameter is kept and computed in ([Note: frozen parameters])."""
    return compute_dtype if param.dtype == torch.float32 else param.dtype


class StagedShard:
    """A flat shard of parameters that a gather rebuilds whole: what a unit's trainable
    storage and its frozen parts share. Where the shard is offloaded ([Note: placement]) the
    gather reads a copy staged in a pooled device buffer. Needs `params`, `layout`, `rank`,
    `shard`, `full`, `work`, `placement`, `pool`, `device` and `_staged`."""

    def shard_views(self) -> list[torch.Tensor]:
        """Each parameter's owned elements as a 1-D view of `shard` (empty if none)."""
        out = []
        for i in range(len(self.params)):
            pieces = self.layout.slot_pieces(i, self.rank)
            out.append(self.shard[pieces[0][1]: pieces[0][1] + pieces[0][2]] if pieces else self.shard[:0])
        return out

    def land_gather(self) -> None:
        """The gather in flight is complete: its staged source goes back to the pool and the
        parameters become full-shape views of the gathered buffer."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.release_staged()
        if self.full is not None:
            with torch.no_grad():
                for p, view in zip(self.params, self.layout.views(self.full)):
                    p.data = view

    def gather_source(self) -> torch.Tensor:
        """The shard as a collective's input: itself on the device; an offloaded one copied
        into a pooled device buffer first (given back by `release_staged`)."""
        if not self.placement.offloaded:
            return self.shard
        if self._staged is None:
            self._staged = self.pool.get(self.shard.numel(), self.shard.dtype, self.device)
            self.placement.stage_in(self.shard, self._staged)
        return self._staged

    def release_staged(self) -> None:
        if self._staged is not None:
            self.pool.put(self._staged)
            self._staged = None


class FrozenPart(StagedShard):
    """A unit's frozen parameters of one dtype: sharded, gathered with the unit, never
    reduced nor stepped ([Note: frozen parameters]). It offers the attributes a state dict
    reads of a unit's storage: layout, shard, params, names, rank, collectives, gather_source."""

    def __init__(self, label: str, params: list[nn.Parameter], names: list[str], dtype: torch.dtype, comm: Comm,
                 device: torch.device, pool: BufferPool, placement: Placement, sync_from_rank0: bool):
        self.label, self.params, self.names, self.dtype = label, params, names, dtype
        self.rank, self.collectives = comm.shard_rank, comm.collectives("shard")
        self.layout = FlatLayout([p.shape for p in params], comm.shard_size, ONE_SEGMENT)
        self.device, self.pool, self.placement = device, pool, placement
        full = self.layout.flatten(params, dtype, device)
        if sync_from_rank0:  # every rank starts from rank 0's values, as DDP does
            comm.broadcast(full, 0, "init", label=label)
        self.init_fingerprint = None if sync_from_rank0 else fingerprint(full)
        self.shard = placement.copy_of(self.own_chunk(full), dtype, arena="frozen")
        del full
        self.full: Optional[torch.Tensor] = None
        self.full_nbytes = self.layout.padded_numel * self.shard.element_size()
        self.work = None
        self._staged: Optional[torch.Tensor] = None
        self._point_at_shard()

    def own_chunk(self, full: torch.Tensor) -> torch.Tensor:
        c = self.layout.chunk(0, self.rank)
        return full[c.flat_start: c.flat_start + c.numel]

    def _point_at_shard(self) -> None:
        for p, view in zip(self.params, self.shard_views()):
            p.data = view

    def unshard(self, phase: str, async_op: bool) -> None:
        self.full = self.pool.get(self.layout.padded_numel, self.dtype, self.device)
        self.work = self.collectives.all_gather(self.full, self.gather_source(), phase, async_op=async_op,
                                                label=self.label)

    def reshard(self) -> None:
        self.land_gather()
        self._point_at_shard()
        if self.full is not None:
            self.pool.put(self.full)
            self.full = None

    def write_back(self) -> None:
        """The gathered values (edited in place) become the shard's."""
        self.placement.write(self.shard, self.own_chunk(self.full))


@dataclass(frozen=True)
class FrozenSlice:
    """A run of a frozen parameter's elements that this rank keeps at stage 3, as a
    checkpoint reads and writes it: [start, start + numel) of the flattened parameter."""

    name: str
    shape: tuple
    dtype: torch.dtype
    start: int
    numel: int
    value: torch.Tensor  # a view of the frozen part's shard
    placement: Placement

    def read(self) -> torch.Tensor:
        return self.placement.read(self.value)

    def write(self, value: torch.Tensor) -> None:
        self.placement.write(self.value, value.to(self.dtype))


def frozen_slices(units: list) -> list[FrozenSlice]:
    """Every owned run of every unit's frozen parameters ([Note: frozen parameters])."""
    out = []
    for unit in units:
        for part in unit.frozen:
            for i, slot in enumerate(part.layout.slots):
                for start, s, n in part.layout.slot_pieces(i, part.rank):
                    out.append(FrozenSlice(part.names[i], slot.shape, part.dtype, start, n, part.shard[s: s + n],
                                           part.placement))
    return out
