"""ZeRO-Offload (Ren et al., arXiv 2101.06840): the fp32 master, the optimizer's states and
the optimizer step on the host, the accelerator keeping only the compute parameters and
the gradient shard; and ZeRO-Infinity's disk tier (Rajbhandari et al., arXiv 2104.07857):
the master and the states in files, streamed a bucket at a time.

[Note: host placement]
`HostPlacement` is a `MasterPlacement` ([Note: master placement] in master.py) that keeps
each shard's fp32 master, and so the states the optimizer creates beside it, in host
memory (pinned when the parameters are on CUDA, so that copies run asynchronously), even
in fp32 where the device placement lets the parameters be their own master. At the step,
each owned gradient piece is copied into a host fp32 buffer of its own (the master's
`.grad`), the optimizer steps on the host, and the updated masters are copied into the
compute parameters, which stage 1-2 then all-gather and stage 3 keeps as its shard. The
same code runs on a CPU-only machine, where host and device are the same memory: the
copies are real copies, so tests cover the path a GPU run takes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed.agreement import raise_if_any_failed
from ..memory import hostmem
from ..memory.diskmem import OffloadDir
from .master import MasterPlacement

__all__ = ["DiskPlacement", "HostPlacement", "placement_for", "raise_offload_failures"]


@dataclass(frozen=True)
class HostPlacement(MasterPlacement):
    """[Note: host placement]"""

    kind: str = "host"
    pinned: bool = False  # the parameters are on an accelerator: page-locked host buffers

    @property
    def separate_master(self) -> bool:
        return True

    @property
    def stages_gradients(self) -> bool:
        return True

    def allocate(self, numel: int, like: torch.device) -> torch.Tensor:
        if self.pinned:
            return torch.empty(numel, dtype=torch.float32, pin_memory=True)
        return hostmem.empty(numel, torch.float32, torch.device("cpu"))

    def fp32_grad(self, grad: torch.Tensor, master: torch.Tensor, staging=None) -> torch.Tensor:
        if staging is None:  # fp32 shards offloaded with the master: the gradient is there already
            return MasterPlacement.fp32_grad(self, grad, master)
        staging.copy_(grad.reshape(-1), non_blocking=self.pinned)  # upcast on the way if 16-bit
        return staging.view(master.shape)

    def write_back(self, master: torch.Tensor, param: torch.Tensor) -> None:
        param.copy_(master.view_as(param), non_blocking=self.pinned)

    def synchronize(self) -> None:
        if self.pinned:
            torch.cuda.current_stream().synchronize()

    def read(self, master: torch.Tensor) -> torch.Tensor:
        return master.detach().clone()

    def write(self, master: torch.Tensor, value: torch.Tensor) -> None:
        master.copy_(value)


@dataclass(frozen=True)
class DiskPlacement(HostPlacement):
    """[Note: disk placement]
    The 16-bit runs' fp32 master and every per-element optimizer state live in files under
    `Config.offload_dir` ([Note: disk buffers] in memory/diskmem.py); the step runs on the
    host a bucket at a time, reading the next bucket's pages while it steps one and
    writing back the one before. In fp32 the parameters stay their own master (a copy on
    disk would add bytes, not remove any), so only the states are on disk. The reduced
    gradient is not copied: the master's `.grad` is a view of the gradient shard (an fp32
    upcast under bf16/fp16), as on the device. CPU only for now: parameters on an
    accelerator would need the host copies `HostPlacement` makes."""

    kind: str = "disk"
    files: OffloadDir = None

    @property
    def separate_master(self) -> bool:
        return False  # fp32: the parameters are the master; 16-bit runs allocate one anyway

    @property
    def streams(self) -> bool:
        return True

    @property
    def stages_gradients(self) -> bool:
        return False

    def fp32_grad(self, grad: torch.Tensor, master: torch.Tensor, staging=None) -> torch.Tensor:
        return MasterPlacement.fp32_grad(self, grad, master)

    def write_back(self, master: torch.Tensor, param: torch.Tensor) -> None:
        param.copy_(master.view_as(param))

    def allocate(self, numel: int, like: torch.device) -> torch.Tensor:
        return self.files.empty(numel, torch.float32)

    def allocate_state(self, numel: int, dtype: torch.dtype, like: torch.device) -> torch.Tensor:
        return self.files.empty(numel, dtype)

    def prefetch(self, tensors) -> None:
        self.files.prefetch(tensors)

    def release(self, tensors) -> None:
        self.files.release(tensors)

    def read(self, master: torch.Tensor) -> torch.Tensor:
        return master.detach()  # safetensors streams it from the mapping


def placement_for(offload: str, device: torch.device, offload_dir=None, rank: int = 0,
                  files: OffloadDir = None) -> MasterPlacement:
    """The placement `Config.offload_optimizer` names, for parameters on `device`; on disk,
    in `files` when the parameter shards opened the directory already."""
    if offload == "host":
        return HostPlacement(pinned=device.type == "cuda")
    if offload == "disk":
        if device.type != "cpu":
            raise NotImplementedError(f"Config.offload_optimizer='disk' runs on CPU only so far; the parameters are "
                                      f"on {device}: use offload_optimizer='host' there")
        return DiskPlacement(files=files if files is not None else OffloadDir(offload_dir, rank))
    return MasterPlacement()


def raise_offload_failures(comm, problem, what: str, placement) -> None:
    """Raise on every rank if any failed to set up its offload directory; this rank's files
    and lock go first, so that the directory can be used again at once."""
    try:
        raise_if_any_failed(comm, problem, what, "init")
    except Exception:
        files = getattr(placement, "files", None)
        if files is not None:
            files.close()
        raise
