"""ZeRO-Offload (Ren et al., arXiv 2101.06840): the fp32 master, the optimizer's states and
the optimizer step on the host, the accelerator keeping only the compute parameters and
the gradient shard.

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

from ..memory import hostmem
from .master import MasterPlacement

__all__ = ["HostPlacement", "placement_for"]


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


def placement_for(offload: str, device: torch.device) -> MasterPlacement:
    """The placement `Config.offload_optimizer` names, for parameters on `device`."""
    if offload == "host":
        return HostPlacement(pinned=device.type == "cuda")
    return MasterPlacement()
