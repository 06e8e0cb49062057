"""One stage-3 unit's sharded storage: its shard, its gather buffer and its gradients.

[Note: unit storage]
A unit's trainable parameters are laid out in one flat buffer (flat.py) with a single
segment, so the unit is gathered and reduced with one collective each. Between uses a
rank keeps only `shard` (its 1/N chunk, compute dtype), and each parameter's `.data` is a
1-D view of the rank's part of it in `shard` (possibly empty), so `model.parameters()`
shows only owned elements. Gathering takes a buffer from a `BufferPool`, all-gathers into
it and points `.data` at full-shape views of it; freeing gives the buffer back to the
pool, where the next unit of the same size reuses it. Nothing is freed to the C
allocator, so resident memory stays at the few buffers in flight (the paper's MD).
Autograd would keep views of a buffer that forward saved for backward, and by then the
buffer may hold another unit; so while a stage-3 model runs forward, saved tensors that
lie in a unit's buffer are packed as (unit, offset, shape, stride) and unpacked from the
unit's buffer of the moment, which backward has gathered again (stage3.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..distributed import Comm
from ..distributed.collectives import Collectives
from ..memory import hostmem
from ..memory.layout import FlatLayout, Piece
from ..memory.pool import BufferPool
from ..memory.placement import Placement
from .frozen import ONE_SEGMENT, FrozenPart, StagedShard, fingerprint, frozen_dtype

__all__ = ["ONE_SEGMENT", "FlatUnit", "SecondaryPartition", "TrainingState", "UnitGroupView", "UnitState"]


@dataclass(frozen=True)
class SecondaryPartition:
    """hpZ (ZeRO++): where a unit keeps its parameters between a training forward and its
    backward, sharded over the node's ranks: the node axis's strategy and the pool of
    those pieces (the ledger's `secondary_params`)."""

    collectives: Collectives
    pool: BufferPool


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather launched, not yet waited for
    GATHERED = "gathered"


class TrainingState(enum.Enum):
    """Where a unit is in a training step (FSDP2's TrainingState); stage3.py's hooks move it."""
    IDLE = "idle"
    FORWARD = "forward"  # it ran in the model's current forward
    PRE_BACKWARD = "pre_backward"  # its backward began: gathered again, gradients accumulating
    POST_BACKWARD = "post_backward"  # every gradient is in: freed, its reduction may launch


class FlatUnit(StagedShard):
    """One unit's sharded parameters, its gather buffer and its gradient shard."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter], names: list[str], comm: Comm,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype, pool: BufferPool,
                 sync_from_rank0: bool = True, transfer: Optional[Collectives] = None,
                 secondary: Optional[SecondaryPartition] = None, placement: Optional[Placement] = None,
                 frozen: tuple = (), whole: Sequence[bool] = (), grad_divisor: Optional[int] = None):
        self.name, self.module, self.params, self.names = name or "<root>", module, params, names
        self.label = f"unit {self.name}"  # the comm ledger's
        self.storage_part = (self, None)  # [Note: gradient streaming] in optim/streaming.py
        # Sharded over the mesh's shard axis; gradients averaged over every data-parallel rank.
        # `collectives` move exact values (checkpoints, state dicts); `transfer` is what
        # training's gathers and reduce-scatters use (ZeRO++'s quantized ones, or the same).
        self.comm = comm  # its ranks: the data-parallel ones, or an expert bank's (ExpertShards in shard.py)
        self.collectives = comm.collectives("shard")
        self.transfer = transfer if transfer is not None else self.collectives
        # On one node the node axis is the shard axis: a secondary copy would be the shard again.
        self.secondary = secondary if secondary is not None and secondary.collectives.size < comm.shard_size else None
        self.secondary_shard: Optional[torch.Tensor] = None  # hpZ: this rank's node piece of the last forward's gather
        self.exact = True  # the gathered buffer holds the stored values (not a quantized transfer's)
        # `grad_divisor`: the data-parallel ranks the gradient is averaged over, when they are
        # more than this unit's own (an expert bank's: ExpertShards in shard.py).
        self.rank, self.data_size = comm.shard_rank, grad_divisor or comm.world_size
        # `whole`: parameters stepped whole ([Note: whole-parameter alignment] in memory/layout.py).
        self.layout = FlatLayout([p.shape for p in params], comm.shard_size, ONE_SEGMENT, whole)
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        # A unit may own no trainable parameter (a root whose parameters all live in units):
        # it keeps its hooks, which begin and end each pass, and never communicates.
        self.empty = not params
        self.scattered = not self.empty  # its reduction is a reduce-scatter over the shard axis
        device = params[0].device if params else next(
            (t.device for t in [p for _, p in frozen] + list(module.parameters()) + list(module.buffers())
             if not t.is_meta), torch.device("cpu"))
        full_fp32 = self.layout.flatten(params, torch.float32, device)
        if sync_from_rank0 and not self.empty:  # every rank starts from rank 0's values, as DDP does
            comm.broadcast(full_fp32, 0, "init", label=self.label)
        # Born sharded, each rank initialised the unit from its own generator: a fingerprint of
        # the full values lets `check_same_initialisation` (meta_init.py) compare the ranks.
        own = self.own_chunk(full_fp32)
        # Where the shards live between uses: [Note: placement] in memory/placement.py.
        self.placement = placement if placement is not None else Placement()
        by_dtype: dict = {}
        for fname, p in frozen:
            by_dtype.setdefault(frozen_dtype(p, compute_dtype), []).append((fname, p))
        self.frozen = [FrozenPart(self.label, [p for _, p in group], [n for n, _ in group], dtype, comm, device, pool,
                                  self.placement, sync_from_rank0) for dtype, group in by_dtype.items()]
        self.init_fingerprint = None if sync_from_rank0 else (
            fingerprint(full_fp32) + tuple(x for part in self.frozen for x in part.init_fingerprint))
        self.device = device  # where the unit computes: gathers and reductions happen here
        # Long-lived, so outside the C heap: [Note: long-lived host buffers] in memory/hostmem.py.
        self._initial_fp32: Optional[torch.Tensor] = hostmem.copy_of(own) if compute_dtype != torch.float32 else None
        self.shard = self.placement.copy_of(own, compute_dtype, arena="params")
        self.full: Optional[torch.Tensor] = None  # the gathered buffer, from the pool, while in use
        self.full_nbytes = (self.layout.padded_numel * self.shard.element_size() if params else 0) + sum(
            part.full_nbytes for part in self.frozen)
        # Allocated at the first backward: a model that is only built or evaluated holds none.
        self.grad_shard: Optional[torch.Tensor] = None
        self.grad_full: Optional[torch.Tensor] = None  # accumulated unsharded gradients, during backward
        self.pool = pool
        # An outer unit (one enclosing other units, e.g. the root holding a tied embedding
        # and output head) gets gradients at both ends of backward; a gradient buffer
        # attached at its start would be held through the whole backward, so its
        # gradients are copied in when it is done instead (`accumulate_grads`).
        self.outer = False
        self.work = None
        # Run on some ranks only in this backward's forwards: reduced when the backward ends
        # ([Note: units run on some ranks] in schedule/stage3.py).
        self.held = False
        self._staged: Optional[torch.Tensor] = None  # an offloaded shard's device copy, while gathering
        # The gradient shard holds nothing to keep: its next reduction overwrites it rather than
        # adding ([Note: gradient clearing] in schedule/base.py). On disk, zeroing would write
        # the file: a fresh shard there is stale bytes that read as zero until overwritten.
        self.grad_fresh = True
        for p, view in zip(self.params, self.shard_views()):
            p.data = view
        self.state = UnitState.SHARDED
        self.training_state = TrainingState.IDLE

    # -- gather / free (see [Note: unit storage]) ----------------------------------------
    def unshard(self, phase: str, async_op: bool, exact: bool = False) -> None:
        """Gather the unit's parameters: with `exact`, their stored values (never quantized:
        for gathered_parameters, which may write them back)."""
        if self.state is not UnitState.SHARDED:
            return
        for part in self.frozen:
            part.unshard(phase, async_op)
        if self.empty:
            self.state = UnitState.GATHERING if self.frozen else UnitState.GATHERED
            return
        self.full = self.pool.get(self.layout.padded_numel, self.compute_dtype, self.device)
        # Whether `full` will hold the stored values exactly (not a quantized transfer's).
        self.exact = exact or self.transfer is self.collectives or (self.secondary_shard is not None
                                                                     and phase == "backward" and self.exact)
        if self.secondary_shard is not None and phase == "backward":  # hpZ: inside the node only
            self.work = self.secondary.collectives.all_gather(self.full, self.secondary_shard, phase,
                                                              async_op=async_op, label=self.label)
        else:
            strategy = self.collectives if exact else self.transfer
            self.work = strategy.all_gather(self.full, self.gather_source(), phase, async_op=async_op,
                                            label=self.label)
        self.state = UnitState.GATHERING

    def make_exact(self) -> None:
        """A gathered unit whose values came through a quantized transfer (qwZ) gets the
        stored values instead, gathered again into the same buffer."""
        if self.state is UnitState.SHARDED or self.empty or self.exact:
            return
        self.wait()
        self.collectives.all_gather(self.full, self.gather_source(), "forward", label=self.label)
        self.release_staged()
        self.exact = True

    def warm(self) -> None:
        """This unit is gathered soon: an offloaded shard on disk starts being read now
        (asynchronous), so that its gather's copy finds it in memory."""
        if self.state is UnitState.SHARDED and self.placement.offloaded:
            self.placement.prefetch([self.shard, *(part.shard for part in self.frozen)])

    def wait(self) -> None:
        if self.state is UnitState.GATHERING:
            self.land_gather()
            for part in self.frozen:
                part.land_gather()
            self.state = UnitState.GATHERED

    def reshard(self, keep_secondary: bool = False) -> None:
        """Free the gathered parameters. With `keep_secondary` (after a training forward,
        under hpZ) first keep this rank's piece of them over its node, for backward's
        gather; otherwise drop any such piece."""
        if not keep_secondary:
            self.drop_secondary()
        if self.state is UnitState.SHARDED:
            return
        self.wait()
        if keep_secondary and self.secondary is not None and self.full is not None:
            node = self.secondary.collectives
            piece = self.full.view(node.size, -1)[node.rank]
            if self.secondary_shard is None:
                self.secondary_shard = self.secondary.pool.get(piece.numel(), piece.dtype, piece.device)
            self.secondary_shard.copy_(piece)  # this forward's values, the ones its backward needs
        for p, view in zip(self.params, self.shard_views()):
            p.data = view
        if self.full is not None:
            self.pool.put(self.full)
            self.full = None
        for part in self.frozen:
            part.reshard()
        self.state = UnitState.SHARDED

    def parts(self) -> list:
        """The unit's storages of parameters: itself (the trainable ones) and its frozen parts."""
        return ([self] if not self.empty else []) + self.frozen

    def all_params(self) -> list[nn.Parameter]:
        return [*self.params, *(p for part in self.frozen for p in part.params)]

    def gathered_buffers(self) -> list:
        """(index, buffer) of each gathered buffer: 0 the trainable one, 1 + i frozen part i's."""
        out = [(0, self.full)] if self.full is not None else []
        return out + [(1 + i, part.full) for i, part in enumerate(self.frozen) if part.full is not None]

    def buffer(self, index: int) -> Optional[torch.Tensor]:
        return self.full if index == 0 else self.frozen[index - 1].full

    def drop_secondary(self) -> None:
        if self.secondary_shard is not None:
            self.secondary.pool.put(self.secondary_shard)
            self.secondary_shard = None

    # -- gradients -------------------------------------------------------------------------
    def attach_grad_views(self) -> None:
        """Before the unit's backward: make each parameter's `.grad` a view of `grad_full`,
        so autograd accumulates into it in place (no per-parameter gradient tensors, no
        copy), as DDP's gradient_as_bucket_view. Only when the reduce dtype is the
        parameters' dtype and the unit is not outer; otherwise `accumulate_grads` copies."""
        if self.empty or self.outer or self.reduce_dtype != self.compute_dtype:
            return
        if self.grad_full is None:
            self._new_grad_full()
        for p, view in zip(self.params, self.layout.views(self.grad_full)):
            if p.grad is None:
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.add_(p.grad)
                p.grad = view

    def accumulate_grads(self) -> None:
        """Move the parameters' unsharded gradients into `grad_full` and free them."""
        if self.grad_full is None:
            self._new_grad_full()
        for p, slot in zip(self.params, self.layout.slots):
            if p.grad is not None:
                part = self.grad_full[slot.offset: slot.offset + slot.numel]
                if p.grad.data_ptr() != part.data_ptr():  # not a view attached before backward
                    part.add_(p.grad.reshape(-1))
                p.grad = None

    @property
    def ready_to_reduce(self) -> bool:
        return self.training_state is TrainingState.POST_BACKWARD and not self.held

    @property
    def accumulates(self) -> bool:
        """The gradient shard holds a gradient to keep: the reduction is added to it."""
        return not self.grad_fresh

    def launch_reduce(self, accumulate: bool, async_op: bool):
        """Reduce-scatter the accumulated gradients into the owned gradient shard; with
        `accumulate` (a later micro-batch), in place, to be added by `finish_reduce`."""
        if self.empty:
            return None
        if self.grad_full is None:  # no parameter of the unit was used: its gradient is zero
            self._new_grad_full()
        self.grad_full.div_(self.data_size)  # average, dividing first as DDP does
        out = self.reduced_chunk(accumulate)
        return self.transfer.reduce_scatter(out, self.grad_full, "backward", async_op=async_op,
                                            label=self.label)

    def finish_reduce(self, accumulate: bool) -> None:
        """After the reduce-scatter has completed: add it to the shard, free the buffer."""
        if self.grad_full is not None and self.placement.offloaded:  # [Note: placement]
            self.placement.land(self.ensure_grad_shard(), self.own_chunk(self.grad_full), add=accumulate)
        elif accumulate and self.grad_full is not None:
            self.ensure_grad_shard().add_(self.own_chunk(self.grad_full))
        if not self.empty:
            self.grad_fresh = False
        self.free_grads()

    def reduced_chunk(self, accumulate: bool) -> torch.Tensor:
        """Where the last reduce-scatter put this rank's chunk, before `finish_reduce`: the
        gradient shard itself, unless it accumulates or lives off the device."""
        if accumulate or self.placement.offloaded:
            return self.own_chunk(self.grad_full)
        return self.ensure_grad_shard()

    def own_chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a full, flat buffer of the unit."""
        c = self.layout.chunk(0, self.rank)
        return full[c.flat_start: c.flat_start + c.numel]

    def discard_grads(self) -> None:
        """Drop unreduced gradients (after a backward that raised)."""
        for p in self.params:
            p.grad = None
        self.free_grads()

    def ensure_grad_shard(self) -> torch.Tensor:
        if self.grad_shard is None:
            self.grad_shard = self.placement.zeros(self.layout.shard_numel, self.reduce_dtype, self.device, arena="grads")
        return self.grad_shard

    def zero_grad_shard(self, readable: bool = False) -> None:
        """`readable`: the zeros may be read before a reduction overwrites them (a step right
        after zero_grad(set_to_none=False)), so a shard on disk is written too."""
        self.grad_fresh = True
        if self.grad_shard is not None and (self.placement.kind != "disk" or readable):  # on disk: see `grad_fresh`
            self.grad_shard.zero_()

    def clear_grads(self, indices: list[int]) -> None:
        """Zero what the unit holds of these parameters' gradients (they were cleared):
        their pieces of the gradient shard, and of an unreduced buffer kept between
        micro-batches."""
        if len(indices) == len(self.params):
            self.zero_grad_shard()
        elif self.grad_shard is not None:
            if self.grad_fresh and self.placement.kind == "disk":  # stale bytes: make them the zeros they stand for
                self.grad_shard.zero_()
                self.grad_fresh = False
            for i in indices:
                for _, start, n in self.layout.slot_pieces(i, self.rank):
                    self.grad_shard[start: start + n].zero_()
        if self.grad_full is not None:
            for i in indices:
                slot = self.layout.slots[i]
                self.grad_full[slot.offset: slot.offset + slot.numel].zero_()

    def _new_grad_full(self) -> None:
        self.grad_full = self.pool.get(self.layout.padded_numel, self.reduce_dtype, self.device)
        self.grad_full.zero_()

    def free_grads(self) -> None:
        if self.grad_full is not None:
            self.pool.put(self.grad_full)
            self.grad_full = None

    # -- what the optimizer sees -----------------------------------------------------------
    def initial_fp32(self) -> torch.Tensor:
        """The shard's exact initial values, for the optimizer's fp32 master."""
        return self._initial_fp32 if self._initial_fp32 is not None else self.shard

    def drop_initial_fp32(self) -> None:
        """Once the master is built the fp32 copy is garbage: 4Ψ/N bytes the formula has no room for."""
        self._initial_fp32 = None

    def owned_pieces(self, indices=None) -> list[Piece]:
        """One piece per owned run of a parameter, in shard order."""
        out = []
        chunk = self.layout.chunk(0, self.rank)
        for i in (range(len(self.params)) if indices is None else indices):
            for _, s, n in self.layout.slot_pieces(i, self.rank):
                out.append(Piece(chunk.flat_start + s, s, n))
        return out

    def held_tensors(self) -> dict:
        """What this unit holds, by ledger category ([Note: measured ledger] in memory/ledger.py).
        The gathered buffer is the pool's (communication buffers); an unsharded gradient
        buffer still held between micro-batches is gradient memory."""
        return {"params": [self.shard],
                "grads": [self.grad_shard, self.grad_full, *(p.grad for p in self.params)],
                "secondary_params": [self.secondary_shard],
                "frozen_params": [part.shard for part in self.frozen]}

    def offloaded_tensors(self) -> dict:
        """The shards kept off the device, by placement ("host" or "disk")."""
        return ({self.placement.kind: [self.shard, self.grad_shard, *(part.shard for part in self.frozen)]}
                if self.placement.offloaded else {})


class UnitGroupView:
    """The part of one unit that belongs to one optimizer param group (ShardStorage)."""

    def __init__(self, unit: FlatUnit, param_indices: list[int]):
        self.unit, self.indices = unit, param_indices
        self.layout, self.names, self.rank = unit.layout, unit.names, unit.rank
        self.collectives = unit.collectives
        self.pieces = unit.owned_pieces(param_indices)
        # The parameter of each piece (one piece per owned run of a parameter).
        self._piece_params = [unit.params[i] for i in param_indices for _ in unit.layout.slot_pieces(i, unit.rank)]

    def owned_pieces(self) -> list[Piece]:
        return self.pieces

    def piece_params(self) -> list[nn.Parameter]:
        return self._piece_params

    def release_step_grads(self) -> None:
        """Nothing to release: the reduced gradient stays in the unit's gradient shard."""

    def owned_params(self) -> list[torch.Tensor]:
        return [self.unit.shard[p.shard_start: p.shard_start + p.numel] for p in self.pieces]

    def owned_grads(self) -> list[torch.Tensor]:
        grads = self.unit.ensure_grad_shard()
        return [grads[p.shard_start: p.shard_start + p.numel] for p in self.pieces]

    def owned_fp32(self) -> list[torch.Tensor]:
        src = self.unit.initial_fp32()
        return [src[p.shard_start: p.shard_start + p.numel].float().clone() for p in self.pieces]

    def drop_initial_fp32(self) -> None:
        self.unit.drop_initial_fp32()

    def publish(self, phase: str = "step") -> None:
        """Nothing to publish: stage 3 gathers parameters when a unit next runs. A copy hpZ
        kept of the old values is dropped; offloaded pieces just written and read leave RAM."""
        self.unit.drop_secondary()
        if self.unit.placement.offloaded:
            grads = self.owned_grads() if self.unit.grad_shard is not None else []
            self.unit.placement.release([*self.owned_params(), *grads])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.unit.zero_grad_shard(readable=not set_to_none)

    def held_tensors(self) -> dict:
        return self.unit.held_tensors()

    def offloaded_tensors(self) -> dict:
        return self.unit.offloaded_tensors()

    @property
    def offloaded(self) -> bool:
        """The shards live off the device ([Note: placement]): their own fp32 master can stay there."""
        return self.unit.placement.offloaded
