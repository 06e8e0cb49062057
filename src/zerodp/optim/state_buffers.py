"""Where the optimizer's per-element states live between steps: one long-lived buffer per
shard and state, in the master's placement ([Note: master placement] in master.py).

The user's optimizer creates its states lazily, in its first step, one small tensor per
piece, in the C heap; each moves at once into its shard's buffer ([Note: long-lived host
buffers] in memory/hostmem.py, or a file: [Note: disk buffers] in memory/diskmem.py),
bucket by bucket, so that no more than a bucket of states is ever held twice.
"""
from __future__ import annotations

import torch

from ..memory import hostmem
from ..memory.ledger import is_elementwise_state
from .inner import elementwise_state_dtypes
from ..memory.placement import Placement
from .master import MasterShard

__all__ = ["StateBuffers"]


class StateBuffers:
    """The shards' state buffers, and which master tensor's states sit where in them."""

    def __init__(self, shards: list[MasterShard], placement: Placement):
        self.shards, self.placement = shards, placement
        self.buffers: dict = {}  # (shard index, state key, dtype) -> its buffer
        self.moved: set = set()  # (id(master tensor), state key) already in its buffer
        self.slot_of = {}  # id(master tensor) -> (shard index, offset in the shard's buffers)
        for si, shard in enumerate(shards):
            at = 0
            for m in shard.master_tensors:
                self.slot_of[id(m)] = (si, at)
                at += m.numel()

    def buffer(self, shard_index: int, key: str, dtype: torch.dtype, device) -> torch.Tensor:
        found = self.buffers.get((shard_index, key, dtype))
        if found is None:
            numel = sum(m.numel() for m in self.shards[shard_index].master_tensors)
            found = self.buffers[(shard_index, key, dtype)] = self.placement.empty(numel, dtype, device, transfers=False)
        return found

    def allocate_ahead(self, inner: torch.optim.Optimizer, groups: list[list[MasterShard]]) -> None:
        """Every buffer now, as each param group's hyperparameters will create them, so that
        a disk without room fails before the first step."""
        index = {id(s): i for i, s in enumerate(self.shards)}
        for gi, group in enumerate(groups):
            for key, dtype in elementwise_state_dtypes(inner, gi).items():
                for shard in group:
                    if shard.master_tensors:
                        self.buffer(index[id(shard)], key, dtype, shard.master_tensors[0].device)

    def move_in(self, state: dict, chunk: list[torch.Tensor], on_cpu: bool) -> None:
        """The states `chunk`'s first step created, into their buffers."""
        moved = 0
        for t in chunk:
            shard_index, offset = self.slot_of[id(t)]
            for k, v in list(state.get(t, {}).items()):
                if not is_elementwise_state(v, t) or (id(t), k) in self.moved:
                    continue
                new = self.buffer(shard_index, k, v.dtype, v.device)[offset: offset + v.numel()].view_as(v)
                new.copy_(v)
                state[t][k] = new  # the heap copy is freed here
                self.moved.add((id(t), k))
                moved += v.numel() * v.element_size()
        if moved and on_cpu:
            hostmem.release_free_heap()

    @staticmethod
    def step_tensors(state: dict, chunk: list[torch.Tensor]) -> list[torch.Tensor]:
        """A bucket's master tensors, their gradients and their per-element states."""
        return [*chunk, *(t.grad for t in chunk if t.grad is not None), *(v for t in chunk for v in state.get(t, {}).values() if is_elementwise_state(v, t))]

    def forget(self) -> None:
        """The optimizer's states were dropped: the next first step moves them in again."""
        self.moved.clear()
