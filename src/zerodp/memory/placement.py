"""Where a long-lived buffer lives: beside the computation, in host memory, or on disk.

[Note: placement]
One `Placement` says where a buffer that outlives a step is allocated, and how values move
between it and the device that computes: the fp32 master and the optimizer states
(Config.offload_optimizer, ZeRO-Offload, arXiv 2101.06840) and stage 3's parameter and
gradient shards (Config.offload_params, ZeRO-Infinity, arXiv 2104.07857) use the same one.

- "device": beside the parameters; nothing is copied.
- "host": host memory, pinned when the computation runs on CUDA (`pinned`), so that the
  copies to and from it run asynchronously (`copy_into`, then `synchronize` before the
  host reads). On a CPU-only machine host and device are the same memory and the copies
  are still made, so tests take the path a GPU run takes.
- "disk": files under Config.offload_dir ([Note: disk buffers] in diskmem.py), mapped into
  memory; `prefetch` starts reading a buffer's pages, `release` writes them back and drops
  them, so that RAM holds only the buffers in use. Stage 3's shards are cut from arenas
  reserved at initialize (`reserve`), so that a disk too small fails there.

Opening a placement (`open_placement`) is collective: a directory that cannot be used, or a
disk without room, fails on every rank before training starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch

from ..distributed.agreement import raise_if_any_failed
from . import hostmem
from .diskmem import OffloadDir

__all__ = ["Placement", "PlacementKind", "open_placement"]

PlacementKind = Literal["device", "host", "disk"]
KINDS: tuple = ("device", "host", "disk")


@dataclass(frozen=True)
class Placement:
    """[Note: placement]"""

    kind: PlacementKind = "device"
    pinned: bool = False  # host memory beside a CUDA computation: page-locked
    files: Optional[OffloadDir] = None  # disk: the rank's offload directory
    arenas: dict = field(default_factory=dict)  # disk: reserved arenas by purpose ("params", "grads")

    @property
    def offloaded(self) -> bool:
        return self.kind != "device"

    @property
    def streams(self) -> bool:
        """Whether `prefetch` and `release` do anything (the buffers stream from a disk)."""
        return self.files is not None

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device, *, arena: Optional[str] = None,
              transfers: bool = True) -> torch.Tensor:
        """A long-lived 1-D buffer here (zeros on the CPU and disk; contents undefined on an
        accelerator). `arena`: on disk, cut from that reserved arena; `transfers`: the
        buffer is copied to or from the device (pinned on host beside CUDA)."""
        if self.kind == "device":
            return hostmem.empty(numel, dtype, device)
        if self.kind == "disk":
            return self.arenas[arena].take(numel, dtype) if arena else self.files.empty(numel, dtype)
        if self.pinned and transfers:
            return torch.zeros(numel, dtype=dtype, pin_memory=True)
        return hostmem.empty(numel, dtype, torch.device("cpu"))

    def staging(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for values held off the device for a while and copied back (Pa+cpu's
        activation checkpoints): pinned beside CUDA, else from the allocator, as short-lived
        tensors are."""
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pinned)

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device, *, arena: Optional[str] = None):
        """As `empty`, zeroed: only device memory on an accelerator needs it (anonymous and
        pinned pages start zeroed, and so do the files' freshly allocated blocks)."""
        out = self.empty(numel, dtype, device, arena=arena)
        if self.kind == "device" and out.device.type != "cpu":
            out.zero_()
        return out

    def copy_of(self, src: torch.Tensor, dtype: torch.dtype, *, arena: Optional[str] = None) -> torch.Tensor:
        out = self.empty(src.numel(), dtype, src.device, arena=arena)
        out.copy_(src.reshape(-1))
        self.release([out])
        return out

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Values between this placement and the device (asynchronous from pinned memory:
        `synchronize` before the host reads them)."""
        dst.copy_(src, non_blocking=self.pinned)

    def stage_in(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """A buffer's values into `out`, a device buffer a collective may use."""
        self.prefetch([src])
        self.copy_into(out, src)
        self.release([src])

    def land(self, dst: torch.Tensor, chunk: torch.Tensor, add: bool) -> None:
        """A result computed on the device (a reduced gradient chunk) into a buffer here."""
        if add:
            dst.add_(chunk.to(dst.device))
        else:
            self.copy_into(dst, chunk)
        self.release([dst])

    def synchronize(self) -> None:
        """Wait for the asynchronous copies into or out of pinned memory."""
        if self.pinned:
            torch.cuda.current_stream().synchronize()

    def prefetch(self, tensors) -> None:
        """These buffers are used next (disk: start reading their pages)."""
        if self.files is not None:
            self.files.prefetch(tensors)

    def release(self, tensors) -> None:
        """These buffers were used (disk: write them back, drop them from memory)."""
        if self.files is not None:
            self.files.release(tensors)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in this placement's own storage (a file, on disk)."""
        return self.files is None or self.files.owns(t)

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer's values as a CPU tensor, for a checkpoint (on disk: the mapping itself,
        which safetensors streams)."""
        if self.kind == "device":
            return t.detach().cpu().contiguous()
        return t.detach() if self.kind == "disk" else t.detach().clone()

    def write(self, t: torch.Tensor, value: torch.Tensor) -> None:
        """Values from a checkpoint (CPU) into a buffer."""
        t.copy_(value.to(t.device))

    def close(self) -> None:
        """Delete the files now (the run failed to start): the directory can be used again."""
        if self.files is not None:
            self.files.close()


def open_placement(kind: str, comm, offload_dir=None, *, files: Optional[OffloadDir] = None,
                   reserve: Sequence[tuple[str, int]] = (), what: str = "") -> Placement:
    """The placement `kind` names (Config's offload values: "none" is "device"), for
    buffers beside computation on `comm.device`; on disk
    in `files` when another placement of the run opened the directory already, else in
    `offload_dir`, with `reserve`'s arenas ((purpose, bytes)) allocated now. Collective
    when offloaded: every rank raises if any could not open or reserve its part (`what`
    names the step in the error), its own files deleted first."""
    kind = "device" if kind == "none" else kind
    if kind not in KINDS:
        raise ValueError(f"placement {kind!r}: use one of {list(KINDS)}")
    if kind == "device":
        return Placement()
    if kind == "host":
        return Placement("host", pinned=comm.device.type == "cuda")
    opened, placement, problem = None, None, None
    try:
        # By the process's rank: the tensor-parallel ranks of one data-parallel rank share its number.
        opened = files if files is not None else OffloadDir(offload_dir, comm.topology.process_rank)
        arenas = {purpose: opened.arena(nbytes) for purpose, nbytes in reserve}
        placement = Placement("disk", files=opened, arenas=arenas)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        problem = e
    try:
        raise_if_any_failed(comm, problem, what or "opening Config.offload_dir", "init")
    except Exception:
        if opened is not None:
            opened.close()
        raise
    return placement
