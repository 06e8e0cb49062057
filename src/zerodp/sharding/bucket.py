"""Stages 0-2: a bucket, one segment of a `FlatParamGroup`, and the reduction of its gradients.

A bucket knows the parameters that overlap its segment and how many of them still await
their gradient in this backward (picotron's bucket); the reducer (schedule/reducer.py)
counts them down from backward hooks and its queue launches the bucket's reduction.
The bucket owns both of its collectives, as a stage-3 unit does: the reduce-scatter (the
all-reduce at stage 0) and, under hybrid sharding, the rank's reduced chunk for the
replicate axis; then it lands the chunk where the group keeps it.

Where gradients live:
- stage 0/1: a full flat gradient buffer; parameters' `.grad` are views of it, so
  autograd accumulates in place (DDP's gradient_as_bucket_view). Stage 0 all-reduces a
  segment in place; stage 1 reduce-scatters it in place, so the owned chunk holds the
  averaged gradient and the rest of the buffer is stale.
- stage 2: parameters keep autograd's own `.grad` until their bucket is launched; then the
  overlapping gradients are copied into a pooled bucket buffer (a gradient is freed once
  all its buckets are), and the bucket is reduce-scattered into a gradient shard of
  `shard_numel` elements (a later micro-batch reduces in place and adds its chunk). Only
  buckets in flight hold a buffer.

Between steps the gradients stay where they are until the loop clears them ([Note:
gradient clearing] in schedule/base.py): a window that starts with gradients adds to them.
Stage 0 adds in place, as DDP does; stage 1 keeps the owned chunks aside for the window
(`FlatParamGroup.carry_over`) and adds them back once reduced; stage 2 adds the reduced
chunk to the shard rather than overwriting it. Reducing in a wider dtype than the
gradients (Config.reduce_dtype), stages 0-1 keep the owned reduced gradient in that dtype
until the step (`FlatParamGroup.grad_owned`), as stage 2 keeps its shard.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..distributed import Comm
from ..memory.layout import Piece, Segment
from ..memory.pool import BufferPool
from .flat_group import FlatParamGroup

__all__ = ["Bucket"]


class Bucket:
    """One segment of a flat param group: its gradients are reduced with one collective once
    every parameter overlapping it has its gradient."""

    def __init__(self, group: FlatParamGroup, seg_index: int, comm: Comm, pool: BufferPool):
        self.group, self.seg_index, self.comm, self.pool = group, seg_index, comm, pool
        self.params: list[int] = []  # indices in the group of the parameters overlapping the segment
        self.shared: list[list[Bucket]] = []  # for each of them, every bucket it overlaps
        self.label = f"bucket {seg_index}"
        self.storage_part = (group, seg_index)  # [Note: gradient streaming] in optim/streaming.py
        # A reduce-scatter over the shard axis (stages 1-2); stage 0 all-reduces over all ranks.
        self.scattered = group.stage > 0
        self.pending = 0  # parameters whose gradient is not in yet, in this backward
        self.launched = False  # its reduction was issued in this backward
        self.buffer: Optional[torch.Tensor] = None  # pooled staging, in the reduce dtype, when one is needed

    @classmethod
    def of_group(cls, group: FlatParamGroup, comm: Comm, pool: BufferPool) -> list["Bucket"]:
        """One bucket per segment of `group`'s layout, by segment."""
        buckets = [cls(group, si, comm, pool) for si in range(len(group.layout.segments))]
        for pi in range(len(group.params)):
            overlapped = [buckets[si] for si in group.layout.segments_of(pi)]  # none without elements
            for b in overlapped:
                b.params.append(pi)
                b.shared.append(overlapped)
        for b in buckets:
            b.reset()
        return buckets

    def reset(self) -> None:
        """Before a backward: every overlapping parameter's gradient awaited, nothing launched."""
        self.pending, self.launched, self.buffer = len(self.params), False, None

    @property
    def ready_to_reduce(self) -> bool:
        return self.pending == 0

    @property
    def accumulates(self) -> bool:
        """Stage 2: the shard's chunk holds a gradient to keep (an earlier micro-batch's, or one
        not cleared since the last step), so the reduction runs in place and is added."""
        return self.group.grad_shard is not None and not self.group.fresh[self.seg_index]

    def _where(self) -> tuple[Segment, Piece, int]:
        """The segment, the rank's chunk of it, and the chunk's offset in the segment."""
        g = self.group
        seg, chunk = g.layout.segments[self.seg_index], g.layout.chunk(self.seg_index, g.rank)
        return seg, chunk, chunk.flat_start - seg.start

    def _fill(self) -> None:
        """Stage 2: copy the bucket's part of each overlapping gradient into a pooled buffer,
        taken only now so that just the buckets in flight hold one; a parameter's own
        gradient is freed once its last bucket is filled."""
        g = self.group
        seg = g.layout.segments[self.seg_index]
        self.buffer = self.pool.get(seg.numel, g.reduce_dtype, g.flat.device)
        self.buffer.zero_()
        for pi, overlapped in zip(self.params, self.shared):
            p, slot = g.params[pi], g.layout.slots[pi]
            if p.grad is not None:
                lo, hi = max(slot.offset, seg.start), min(slot.offset + slot.numel, seg.end)
                self.buffer[lo - seg.start: hi - seg.start].copy_(
                    p.grad.reshape(-1)[lo - slot.offset: hi - slot.offset])
            if all(b.launched for b in overlapped):
                p.grad = None

    def launch_reduce(self, accumulate: bool, async_op: bool):
        """Average the segment's gradients over the data-parallel ranks: reduce-scatter them
        (stages 1-2), all-reduce them (stage 0). With `accumulate`, in place, to be added by
        `finish_reduce`."""
        self.launched = True
        g = self.group
        seg, c, local = self._where()
        n = self.comm.world_size
        if g.grad_shard is not None:  # stage 2: bucket buffer -> gradient shard
            self._fill()
            self.buffer.div_(n)
            out = (self.buffer[local: local + c.numel] if accumulate
                   else g.grad_shard[c.shard_start: c.shard_start + c.numel])
            return g.collectives.reduce_scatter(out, self.buffer, "backward", async_op=async_op, label=self.label)
        grads = g.grad_flat[seg.start: seg.end]
        if g.reduce_dtype != grads.dtype:
            self.buffer = self.pool.get(seg.numel, g.reduce_dtype, grads.device)
            self.buffer.copy_(grads)
            target = self.buffer
        else:
            target = grads
        # Divide before summing, as DDP does, so fp16/bf16 sums stay in range.
        target.div_(n)
        if g.stage == 0:
            return self.comm.all_reduce(target, "backward", async_op=async_op, label=self.label)
        return g.collectives.reduce_scatter(target[local: local + c.numel], target, "backward",
                                            async_op=async_op, label=self.label)

    def reduced_chunk(self, accumulate: bool) -> torch.Tensor:
        """Where the reduction put the rank's chunk, before `finish_reduce` (stages 1-2): the
        gradient shard, or the staging buffer, or in place in the flat gradient."""
        g = self.group
        seg, c, local = self._where()
        if g.grad_shard is not None:  # stage 2
            return (self.buffer[local: local + c.numel] if accumulate
                    else g.grad_shard[c.shard_start: c.shard_start + c.numel])
        source = self.buffer if self.buffer is not None else g.grad_flat[seg.start: seg.end]
        return source[local: local + c.numel]

    def finish_reduce(self, accumulate: bool) -> None:
        """After the reduction completed: keep the reduced chunk where the group keeps it
        (the gradient shard at stage 2, the flat gradient at stages 0-1, and in the reduce
        dtype when it is wider, `grad_owned`), and give the staging buffer back."""
        g = self.group
        seg, c, local = self._where()
        if g.grad_shard is not None:
            if accumulate:
                g.grad_shard[c.shard_start: c.shard_start + c.numel].add_(self.buffer[local: local + c.numel])
            g.fresh[self.seg_index] = False
        elif g.stage == 0:
            if self.buffer is not None:  # reduced in a wider dtype: kept in it, and in the gradients' own
                g.owned_grad_buffer()[seg.start: seg.end].copy_(self.buffer)
                g.grad_flat[seg.start: seg.end].copy_(self.buffer)
        else:
            source = self.buffer[local: local + c.numel] if self.buffer is not None else None
            chunk = source if source is not None else g.grad_flat[c.flat_start: c.flat_start + c.numel]
            g.add_carried(self.seg_index, chunk)
            if source is not None:
                g.owned_grad_buffer()[c.shard_start: c.shard_start + c.numel].copy_(source)
                g.grad_flat[c.flat_start: c.flat_start + c.numel].copy_(source)
        if self.buffer is not None:
            self.pool.put(self.buffer)
            self.buffer = None
