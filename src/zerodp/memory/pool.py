"""Long-lived communication buffers, allocated once and reused (the paper's MD and CB)."""
from __future__ import annotations

import torch

from . import hostmem

__all__ = ["BufferPool"]


class BufferPool:
    """Long-lived buffers, allocated once and handed out again (the paper's MD and CB,
    §6.2-6.3): bucket staging at stages 0-2, gathered units and unsharded gradients at
    stage 3. Reusing them keeps the process's memory flat: freed large blocks would
    otherwise stay in the C allocator's heap, so resident memory would not fall."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.allocated: list[torch.Tensor] = []  # every buffer ever handed out (none is freed)

    @property
    def allocated_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.allocated)

    def get(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer of `numel` elements starting at offset 0 of its storage (contents
        undefined): the smallest free one that fits, or a new one."""
        fits = [i for i, b in enumerate(self.free)
                if b.numel() >= numel and b.dtype == dtype and b.device == torch.device(device)]
        if fits:
            best = min(fits, key=lambda i: self.free[i].numel())
            return self.free.pop(best)[:numel]
        buf = hostmem.empty(numel, dtype, device)
        self.allocated.append(buf)
        return buf

    def put(self, buf: torch.Tensor) -> None:
        self.free.append(buf._base if buf._base is not None else buf)

    def mark(self) -> int:
        """A point to come back to with `release_since`."""
        return len(self.allocated)

    def release_since(self, mark: int) -> None:
        """Drop the buffers allocated after `mark` that are free again: a one-off peak (every
        unit gathered at once by `gathered_parameters`) must not stay held for the rest of
        the run. Buffers still in use stay allocated; the pool keeps them when they return."""
        added = {id(b) for b in self.allocated[mark:]}
        dropped = {id(b) for b in self.free if id(b) in added}
        self.free = [b for b in self.free if id(b) not in dropped]
        self.allocated = [b for b in self.allocated if id(b) not in dropped]
