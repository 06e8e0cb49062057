"""Where a stage-3 unit keeps its parameter shard and gradient shard (Config.offload_params).

[Note: shard homes]
"device": beside the computation, as always. "host" (ZeRO-Offload's parameter offload):
in host memory, pinned when the computation runs on CUDA. "disk" (ZeRO-Infinity): in a
file under `Config.offload_dir` ([Note: disk buffers] in memory/diskmem.py), cut from two
arenas (parameter shards, gradient shards) reserved at initialize, so that a disk too
small fails there on every rank. An
offloaded shard never takes part in a collective itself: each gather first copies it into
a pooled buffer on the device (`stage_in`, asynchronous from pinned memory), and each
reduce-scatter lands in the device's unsharded gradient buffer, from which the owned chunk
is copied (or added, when accumulating) into the offloaded gradient shard (`land`). A CPU
run takes the same path, with real copies, so tests cover the one a GPU run takes. On
disk, a shard's pages are read just before its gather (MADV_WILLNEED for the whole range,
then the copy; the unit after the prefetched ones is asked for ahead, so that its reading
overlaps compute) and dropped right after, so RAM holds only the units in flight.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..memory import hostmem
from ..memory.diskmem import Arena

__all__ = ["ShardHome"]

@dataclass(frozen=True)
class ShardHome:
    """[Note: shard homes]"""

    kind: str = "device"
    pinned: bool = False  # host memory for a CUDA run: page-locked
    param_arena: Optional[Arena] = None  # disk: the reserved files the shards are cut from
    grad_arena: Optional[Arena] = None
    files: object = None  # disk: the OffloadDir the arena lies in (prefetch, release)

    @property
    def offloaded(self) -> bool:
        return self.kind != "device"

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device, grads: bool = False) -> torch.Tensor:
        """A long-lived 1-D buffer in this home (zeros on the CPU and disk), for a parameter
        shard or (`grads`) a gradient shard."""
        if self.kind == "device":
            return hostmem.empty(numel, dtype, device)
        if self.kind == "disk":
            return (self.grad_arena if grads else self.param_arena).take(numel, dtype)
        if self.pinned:
            return torch.zeros(numel, dtype=dtype, pin_memory=True)
        return hostmem.empty(numel, dtype, torch.device("cpu"))

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device, grads: bool = False) -> torch.Tensor:
        """As `empty`, zeroed: only device memory on an accelerator needs it (anonymous and
        pinned pages start zeroed, and so do the files' freshly allocated blocks)."""
        out = self.empty(numel, dtype, device, grads)
        if self.kind == "device" and out.device.type != "cpu":
            out.zero_()
        return out

    def copy_of(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = self.empty(src.numel(), dtype, src.device)
        out.copy_(src.reshape(-1))
        self.release([out])
        return out

    def stage_in(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        """The shard's values into `out`, a device buffer a collective may use."""
        self.prefetch([shard])
        out.copy_(shard, non_blocking=self.pinned)
        self.release([shard])

    def land(self, shard: torch.Tensor, chunk: torch.Tensor, add: bool) -> None:
        """A reduced chunk (on the device) into the offloaded gradient shard."""
        if add:
            shard.add_(chunk.to(shard.device))
        else:
            shard.copy_(chunk, non_blocking=self.pinned)
        self.release([shard])

    def prefetch(self, tensors) -> None:
        if self.files is not None:
            self.files.prefetch(tensors)

    def release(self, tensors) -> None:
        if self.files is not None:
            self.files.release(tensors)

    def synchronize(self) -> None:
        """Wait for the asynchronous copies into pinned shards (before the CPU reads them)."""
        if self.pinned:
            torch.cuda.current_stream().synchronize()
