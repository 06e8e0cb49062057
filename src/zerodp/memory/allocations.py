"""The tensor memory a block of code adds: tracemalloc for tensor storages.

[Note: added tensor memory]
`TensorAllocations` is a torch dispatch mode: every tensor an operator returns inside the
block is looked up by its storage, and a storage that did not exist when the block began
(a census of every live tensor then, `live_tensor_storages`) is counted from the first
operator that returns it until the storage is freed (a finalizer on the storage). So a
buffer the pool already held is not counted, one it allocates is (from the collective that
fills it), and a temporary counts while it lives. `peak_nbytes` is the most counted at once:
what the block added to the process at its worst, measured independently of what zerodp's
ledger says it holds. Storages torch allocates and frees inside one operator, and memory
outside tensors, are not seen. Every operator pays a Python call, so time nothing under it.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .ledger import live_tensor_storages, storage_key

__all__ = ["TensorAllocations"]


class TensorAllocations(TorchDispatchMode):
    """Within the block: `nbytes`, the storages added and alive now; `peak_nbytes`, the most
    at once ([Note: added tensor memory])."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = self.peak_nbytes = 0
        self._before: set = set()
        self._counted: dict = {}  # storage key -> nbytes, while alive
        self._paused = False

    def __enter__(self):
        held: list = []
        live_tensor_storages(hold=held)
        self._before = set()
        for storage in held:  # a storage freed inside the block frees its address for a new one
            key = (storage.data_ptr(), storage.device)
            if key not in self._before:
                self._before.add(key)
                weakref.finalize(storage, self._before.discard, key)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out) if not self._paused else ():
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._count(t)
        return out

    @contextlib.contextmanager
    def paused(self):
        """What runs within is not counted (a check of the measured code's results)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _count(self, t: torch.Tensor) -> None:
        key, nbytes = storage_key(t)
        if not nbytes or key in self._before or key in self._counted:
            return
        self._counted[key] = nbytes
        self.nbytes += nbytes
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)
        weakref.finalize(t.untyped_storage(), self._freed, key)

    def _freed(self, key) -> None:
        self.nbytes -= self._counted.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak_nbytes = self.nbytes
