"""Long-lived buffers on the CPU, each in its own memory mapping rather than the C heap.

[Note: long-lived host buffers]
glibc serves every allocation below its mmap threshold from the heap, and that threshold
rises with use up to 32 MiB: after a few large frees, everything up to 32 MiB comes from
the heap. A long-lived block there (a unit's shard, a gradient shard, an optimizer state,
a pooled gather buffer) pins the pages around it, so the short-lived tensors of forward
and backward that are freed between them cannot be given back, and resident memory
climbs by hundreds of MiB that nothing uses (measured on the 124M GPT at stage 3: 0.66
GiB of free heap held after one step). Pre-allocated, defragmented buffers are the
paper's MD (arXiv 1910.02054, §6.3); on the CPU this means each of zerodp's long-lived
buffers is an anonymous mapping of its own: it never fragments the heap, and freeing it
returns its pages at once. The heap then only holds short-lived tensors, which free
cleanly between steps, as they do under DDP. On other devices (CUDA) torch's caching
allocator already segregates and reuses blocks, so `torch.empty` is used unchanged.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os

import torch


def empty(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A 1-D tensor for a buffer that lives for many steps (contents undefined on
    accelerators; zero on the CPU, where anonymous pages start zeroed)."""
    device = torch.device(device)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.empty(numel, dtype=dtype, device=device)
    # Private, so ordinary process memory (shared anonymous memory would be shmem). The
    # tensor keeps the mapping alive; its pages are unmapped when the last view dies.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=numel)


def zeros(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    t = empty(numel, dtype, device)
    if t.device.type != "cpu":
        t.zero_()
    return t


def copy_of(src: torch.Tensor, dtype: torch.dtype = None) -> torch.Tensor:
    """A long-lived, flat copy of `src` (converted to `dtype` if given)."""
    out = empty(src.numel(), dtype or src.dtype, src.device)
    out.copy_(src.reshape(-1))
    return out


# Per-step releases (after a unit's backward, after a step) skip a heap holding less free
# memory than this: see `release_free_heap`.
STEP_RELEASE_MIN_FREE = 256 * 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc's (malloc_trim, mallinfo2), either None where the C library lacks it (musl,
    macOS, Windows; mallinfo2 before glibc 2.33)."""
    if os.name != "posix":
        return None, None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None, None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    info = getattr(libc, "mallinfo2", None)
    if info is not None:
        info.argtypes, info.restype = [], _MallInfo2
    return trim, info


def free_heap_bytes() -> int | None:
    """Bytes the C heap holds free (glibc's mallinfo2: resident or not), or None where unknown."""
    _, info = _libc()
    return None if info is None else int(info().fordblks)


def release_free_heap(min_free: int = 0) -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim(0)); with `min_free`,
    only when the heap holds at least that many free bytes.

    Called where many short-lived tensors were just freed: after each stage-3 unit's
    backward (its activations and gradient temporaries) and after each stage-3 step (at
    stages 0-2 the next step refills the same pages: docs/stages.md).
    Without it, the pages they were freed into stay resident for the rest of the run
    wherever a live allocation sits above them in the heap, and the next allocations
    spread over fresh pages (measured on the 124M GPT at stage 3, N=2: peak RSS 2.37 GiB
    with a release per step only, 2.09 GiB with one per unit as well). But the released
    pages are faulted in again (and zeroed) by the next step's allocations: on a 5M-parameter
    GPT-2 (N=2, 4 x 128 tokens) a release after every unit and step made the step 17% (stage
    0) and 35% (stage 3) slower for a heap of under 200 MiB. The per-step calls therefore pass
    `min_free=STEP_RELEASE_MIN_FREE`: a heap with less free memory keeps it, bounding what is
    kept resident and unused by that much. A no-op where the C library has no malloc_trim."""
    trim, _ = _libc()
    if trim is None:
        return
    if min_free:
        free = free_heap_bytes()
        if free is not None and free < min_free:
            return
    trim(0)
