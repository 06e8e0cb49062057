"""Stages 0-2: parameters in flat buffers and gradients reduced in buckets from backward hooks.

Each optimizer param group becomes one `FlatParamGroup` (sharding/flat_group.py; see
[Note: flat layout] in memory/layout.py). A segment of the flat buffer is the
communication bucket: it is reduced as soon as every parameter overlapping it has its
gradient accumulated
(`Tensor.register_post_accumulate_grad_hook`), on the backward at the accumulation boundary
(stage 2: on every micro-batch's, per `reduce_each_micro_batch`). Segments are launched
strictly in one order, the same on every rank, so collectives always match even if
autograd finishes parameters in another order: reverse registration order on the first
backward, then the order the buckets became ready in it (rank 0's). Whatever is left
(unused parameters) is launched by the end-of-backward callback ([Note: end of backward]
in schedule/base.py).

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

import logging
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from ..distributed import Comm
from ..memory.pool import BufferPool
from ..sharding.flat_group import FlatParamGroup
from .base import MAX_IN_FLIGHT, BackwardSchedule, clear_by_owner

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Bucket:
    group: FlatParamGroup
    seg_index: int
    pending: int  # parameters overlapping the segment whose gradient is not in yet
    buffer: Optional[torch.Tensor] = None  # reduce-dtype staging, when one is needed
    work: object = None
    accumulate: bool = False  # stage 2: add the reduced chunk to the shard (a later micro-batch)
    launched: bool = False  # its reduction was issued in this backward
    replicas_pending: bool = False  # hybrid sharding: its chunk still to be summed over the replicate axis
    announced: bool = False  # its final gradient was announced ([Note: gradient streaming])
    landed: bool = False  # its reduced chunk was written where it is kept


class GradReducer(BackwardSchedule):
    """Launches each bucket's reduction from backward hooks (stages 0-2)."""

    def __init__(self, groups: list[FlatParamGroup], comm: Comm, accumulation_steps: int,
                 overlap: bool, backward_order: dict, reduce_each_micro_batch: bool):
        # Stages 0-1 hold full gradients anyway: they reduce once, at the boundary.
        stage = groups[0].stage
        super().__init__(comm, accumulation_steps, reduce_each_micro_batch and stage == 2)
        self.groups, self.overlap = groups, overlap
        self.pool = BufferPool()
        # Buckets in launch order: by when their last parameter is expected to finish in
        # backward (reverse registration order), identical on every rank, until the first
        # reducing backward has shown the real order (`adopt_recorded_order`).
        self.buckets: list[_Bucket] = []
        self._param_buckets: dict[int, list[_Bucket]] = {}
        for g in groups:
            for i in range(len(g.layout.segments)):
                self.buckets.append(_Bucket(g, i, 0))
        by_seg = {(id(b.group), b.seg_index): b for b in self.buckets}
        order_key = {}
        for g in groups:
            for pi, p in enumerate(g.params):
                for si in g.layout.segments_of(pi):
                    b = by_seg[(id(g), si)]
                    self._param_buckets.setdefault(id(p), []).append(b)
                    order_key[id(b)] = max(order_key.get(id(b), -1), backward_order[id(p)])
        self.buckets.sort(key=lambda b: order_key.get(id(b), -1))
        self._base_pending = {id(b): sum(1 for lst in self._param_buckets.values() if b in lst) for b in self.buckets}
        self._filled: dict = {}  # stage 2: buckets filled from each parameter's gradient
        self._bucket_params = {id(b): [pi for pi, p in enumerate(b.group.params) if b in self._param_buckets.get(id(p), ())]
                               for b in self.buckets}
        self._next = 0
        self._in_flight: deque = deque()
        self._bucket_index = {id(b): i for i, b in enumerate(self.buckets)}  # in the order recorded against
        for g in groups:
            for pi, p in enumerate(g.params):
                p.register_post_accumulate_grad_hook(self._make_hook(g, pi))
        self._owner = [(g, i) for g in groups for i in range(len(g.params))]
        self.track([p for g in groups for p in g.params], self._clear_grads,
                   [v for g in groups for v in g.grad_views] if stage < 2 else None)
        self._reset_buckets()

    # -- per-backward state -----------------------------------------------------------
    def _reset_buckets(self) -> None:
        for b in self.buckets:
            b.pending, b.buffer, b.work, b.launched = self._base_pending[id(b)], None, None, False
            b.replicas_pending, b.announced, b.landed = False, False, False
        self._filled.clear()
        self._next = 0

    def _make_hook(self, group: FlatParamGroup, index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(group, index, param)
        return hook

    def _on_grad_ready(self, group: FlatParamGroup, index: int, param: torch.Tensor) -> None:
        self.begin_backward()
        buckets = self._param_buckets.get(id(param), ())  # none for a parameter with no elements
        if not self.first_arrival(param, group.names[index], any(b.launched for b in buckets)):
            return  # accumulated in place (or into .grad) before its bucket is launched
        if group.grad_views is not None and param.grad is not group.grad_views[index]:
            # Someone replaced .grad (e.g. model.zero_grad(set_to_none=True)); fold it back.
            group.grad_views[index].copy_(param.grad)
            param.grad = group.grad_views[index]
        if not self.reduces_now:
            return
        for b in buckets:
            b.pending -= 1
            if b.pending == 0:
                self.record_done(self._bucket_index[id(b)])
        self._launch_ready(flush=False)

    def _launch_ready(self, flush: bool) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.pending > 0 and not flush:
                return
            self._launch(b)
            self._next += 1

    def _fill(self, b: _Bucket) -> None:
        """Stage 2: copy the bucket's part of each overlapping gradient into a pooled buffer,
        taken only now so that just the buckets in flight hold one; a parameter's own
        gradient is freed once its last bucket is filled."""
        g = b.group
        seg = g.layout.segments[b.seg_index]
        b.buffer = self.pool.get(seg.numel, g.reduce_dtype, g.flat.device)
        b.buffer.zero_()
        for pi in self._bucket_params[id(b)]:
            p, slot = g.params[pi], g.layout.slots[pi]
            if p.grad is not None:
                lo, hi = max(slot.offset, seg.start), min(slot.offset + slot.numel, seg.end)
                b.buffer[lo - seg.start: hi - seg.start].copy_(p.grad.reshape(-1)[lo - slot.offset: hi - slot.offset])
            self._filled[id(p)] = self._filled.get(id(p), 0) + 1
            if self._filled[id(p)] == len(self._param_buckets[id(p)]):
                p.grad = None

    def _launch(self, b: _Bucket) -> None:
        b.launched = True
        g, comm = b.group, self.comm
        # Hybrid sharding ([Note: mesh axes]): the reduce-scatter sums within a replica row;
        # the owned chunk is then summed over the rows (stage 0 all-reduces over all ranks).
        b.replicas_pending = g.stage > 0 and comm.topology.replicate_size > 1
        seg = g.layout.segments[b.seg_index]
        chunk = g.layout.chunk(b.seg_index, g.rank)
        local = chunk.flat_start - seg.start
        n = comm.world_size
        if g.grad_shard is not None:  # stage 2: bucket buffer -> gradient shard
            self._fill(b)
            b.buffer.div_(n)
            # A shard that holds a gradient to keep (an earlier micro-batch's, or one not
            # cleared since the last step) is added to: reduce in place, add when done.
            b.accumulate = not g.fresh[b.seg_index]
            out = (b.buffer[local: local + chunk.numel] if b.accumulate
                   else g.grad_shard[chunk.shard_start: chunk.shard_start + chunk.numel])
            b.work = g.collectives.reduce_scatter(out, b.buffer, "backward", async_op=self.overlap,
                                                  label=f"bucket {b.seg_index}")
        else:
            grads = g.grad_flat[seg.start: seg.end]
            if g.reduce_dtype != grads.dtype:
                b.buffer = self.pool.get(seg.numel, g.reduce_dtype, grads.device)
                b.buffer.copy_(grads)
                target = b.buffer
            else:
                target = grads
            # Divide before summing, as DDP does, so fp16/bf16 sums stay in range.
            target.div_(n)
            if g.stage == 0:
                b.work = comm.all_reduce(target, "backward", async_op=self.overlap, label=f"bucket {b.seg_index}")
            else:
                b.work = g.collectives.reduce_scatter(target[local: local + chunk.numel], target, "backward",
                                                      async_op=self.overlap, label=f"bucket {b.seg_index}")
        if not self.overlap:
            self._finish(b)
            return
        # Bound the buckets in flight: a finished bucket's buffer goes back to the pool at
        # once, and at most MAX_IN_FLIGHT wait behind the wire, so the pool stays a few
        # buckets large whatever the model size (CB).
        self._in_flight.append(b)
        while self._in_flight and (len(self._in_flight) > MAX_IN_FLIGHT or self._in_flight[0].work is None
                                   or self._in_flight[0].work.is_completed()):
            self._finish(self._in_flight.popleft())

    def _finish(self, b: _Bucket, announce: bool = True) -> None:
        if b.work is not None:
            b.work.wait()
            b.work = None
        if b.replicas_pending:
            b.replicas_pending = False
            self._sum_over_replicas(b)
        if b.launched and not b.landed:
            b.landed = True
            self._land(b)
        if b.buffer is not None:
            self.pool.put(b.buffer)
            b.buffer = None
        if announce and b.launched and not b.announced and self.at_boundary and self.on_final_grads is not None:
            b.announced = True
            self.on_final_grads(b.group, b.seg_index)  # [Note: gradient streaming]

    def _land(self, b: _Bucket) -> None:
        """Where the reduced bucket is kept: the gradient shard (stage 2), the flat gradient
        (stages 0-1), and in the reduce dtype when it is wider (`grad_owned`)."""
        g = b.group
        seg = g.layout.segments[b.seg_index]
        c = g.layout.chunk(b.seg_index, g.rank)
        local = c.flat_start - seg.start
        if g.grad_shard is not None:
            if b.accumulate:
                g.grad_shard[c.shard_start: c.shard_start + c.numel].add_(b.buffer[local: local + c.numel])
            g.fresh[b.seg_index] = False
        elif g.stage == 0:
            if b.buffer is not None:  # reduced in a wider dtype: kept in it, and in the gradients' own
                g.owned_grad_buffer()[seg.start: seg.end].copy_(b.buffer)
                g.grad_flat[seg.start: seg.end].copy_(b.buffer)
        else:
            source = b.buffer[local: local + c.numel] if b.buffer is not None else None
            chunk = source if source is not None else g.grad_flat[c.flat_start: c.flat_start + c.numel]
            g.add_carried(b.seg_index, chunk)
            if source is not None:
                g.owned_grad_buffer()[c.shard_start: c.shard_start + c.numel].copy_(source)
                g.grad_flat[c.flat_start: c.flat_start + c.numel].copy_(source)

    def _sum_over_replicas(self, b: _Bucket) -> None:
        """The rank's reduced chunk of the bucket, wherever the reduce-scatter left it, summed
        over the replicate axis (each row holds the same shards of different data)."""
        g = b.group
        seg = g.layout.segments[b.seg_index]
        c = g.layout.chunk(b.seg_index, g.rank)
        local = c.flat_start - seg.start
        if g.grad_shard is not None:  # stage 2
            chunk = (b.buffer[local: local + c.numel] if b.accumulate
                     else g.grad_shard[c.shard_start: c.shard_start + c.numel])
        else:  # stage 1: in the staging buffer, or in place in the flat gradient
            source = b.buffer if b.buffer is not None else g.grad_flat[seg.start: seg.end]
            chunk = source[local: local + c.numel]
        self.comm.all_reduce(chunk, "backward", axis="replicate", label=f"bucket {b.seg_index}")

    def finish_backward(self) -> None:
        if not self.reduces_now:
            return
        self._launch_ready(flush=True)
        self._wait_all()
        for g in self.groups:
            g.drop_carried()
            g.owned_grads_final()
        if self.recording_order:
            self.buckets = [self.buckets[i] for i in self.adopt_recorded_order(list(range(len(self.buckets))))]
        self._reset_buckets()

    def start_window(self) -> None:
        """Stage 1: gradients not cleared since the last step are kept aside ([Note: gradient
        clearing] in schedule/base.py): every rank's owned chunks of them are added once this
        window is reduced (the rest of the buffer is stale local sums)."""
        for g in self.groups:
            if g.stage == 1 and any(self.presence.has_grad(p) for p in g.params):
                g.carry_over()

    def _clear_grads(self, indices: list[int]) -> None:
        clear_by_owner(self._owner, indices)

    def _wait_all(self, announce: bool = True) -> None:
        for b in self.buckets:
            self._finish(b, announce)
        self._in_flight.clear()

    def reset(self) -> None:
        """After a backward that raised: wait for what is in flight, return every buffer."""
        super().reset()
        for b in self.buckets:  # no new collective now: the other ranks may not be reducing
            b.replicas_pending = False
        self._wait_all(announce=False)
        self._reset_buckets()

    def after_step(self) -> None:
        super().after_step()
        self._reset_buckets()
