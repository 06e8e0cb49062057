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

What a bucket is and where the gradients live: sharding/bucket.py. This module only orders
the buckets: backward hooks count down each bucket's awaited parameters, and the schedule's
`ReduceQueue` (schedule/base.py) launches them in order.
"""
from __future__ import annotations

import logging

import torch

from ..distributed import Comm
from ..memory.pool import BufferPool
from ..policies import BackwardPolicy
from ..sharding.bucket import Bucket
from ..sharding.flat_group import FlatParamGroup
from .base import BackwardSchedule, ReduceQueue, eager_hook
from .presence import clear_by_owner

log = logging.getLogger(__name__)


class GradReducer(BackwardSchedule):
    """Counts down each bucket's parameters from backward hooks; its queue reduces the
    buckets in order (stages 0-2)."""

    def __init__(self, groups: list[FlatParamGroup], comm: Comm, policy: BackwardPolicy, backward_order: dict):
        # Stages 0-1 hold full gradients anyway: they reduce once, at the boundary.
        stage = groups[0].stage
        super().__init__(comm, policy.accumulation_steps, policy.reduce_each_micro_batch and stage == 2)
        self.groups, overlap = groups, policy.overlap_comm
        self.pool = BufferPool()
        buckets: list[Bucket] = []
        for g in groups:
            first = len(buckets)  # the group's buckets are buckets[first + segment index]
            buckets += Bucket.of_group(g, comm, self.pool)
            for pi, p in enumerate(g.params):
                mine = [first + si for si in g.layout.segments_of(pi)]
                p.register_post_accumulate_grad_hook(eager_hook(self._make_hook(g, pi, mine)))

        def expected_end(i: int) -> int:  # when the bucket's last parameter should finish backward
            b = buckets[i]
            return max((backward_order[id(b.group.params[pi])] for pi in b.params), default=-1)

        # Launch order: reverse registration order, identical on every rank, until the first
        # reducing backward has shown the real order (`adopt_recorded_order`).
        self.queue = ReduceQueue(self, buckets, sorted(range(len(buckets)), key=expected_end), overlap)
        self._owner = [(g, i) for g in groups for i in range(len(g.params))]
        self.track([p for g in groups for p in g.params], self._clear_grads,
                   [v for g in groups for v in g.grad_views] if stage < 2 else None)
        # [Note: torch's utilities on sharded gradients] in grad_handle.py
        self.presence.handles_when_final = stage == 1 and comm.shard_size > 1
        self._reset_buckets()

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets in launch order."""
        return [self.queue.items[i] for i in self.queue.order]

    # -- per-backward state -----------------------------------------------------------
    def _reset_buckets(self) -> None:
        for b in self.queue.items:
            b.reset()
        self.queue.rewind()

    def _make_hook(self, group: FlatParamGroup, index: int, mine: list[int]):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(group, index, param, mine)
        return hook

    def _on_grad_ready(self, group: FlatParamGroup, index: int, param: torch.Tensor, mine: list[int]) -> None:
        """`mine`: the queue's indices of the buckets the parameter overlaps."""
        self.begin_backward()
        buckets = [self.queue.items[i] for i in mine]
        if not self.first_arrival(param, group.names[index], any(b.launched for b in buckets)):
            return  # accumulated in place (or into .grad) before its bucket is launched
        if group.grad_views is not None and param.grad is not group.grad_views[index]:
            # Someone replaced .grad (e.g. model.zero_grad(set_to_none=True)); fold it back.
            group.grad_views[index].copy_(param.grad)
            param.grad = group.grad_views[index]
        if not self.reduces_now:
            return
        for i, b in zip(mine, buckets):
            b.pending -= 1
            if b.pending == 0:
                self.record_done(i)
        self.queue.launch_ready()

    def finish_backward(self) -> None:
        if not self.reduces_now:
            return
        self.queue.flush()
        for g in self.groups:
            g.drop_carried()
            g.owned_grads_final()
        self.queue.adopt_recorded_order()
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

    def reset(self) -> None:
        """After a backward that raised: wait for what is in flight, return every buffer."""
        super().reset()
        self.queue.wait_all(failed=True)
        self._reset_buckets()

    def after_step(self) -> None:
        super().after_step()
        self._reset_buckets()
