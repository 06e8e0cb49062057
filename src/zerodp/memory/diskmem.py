"""Buffers that live in files under an offload directory (ZeRO-Infinity's disk tier).

[Note: disk buffers]
Each buffer is a file of its own, allocated in full when it is created (posix_fallocate:
a disk too full fails then, with the bytes it needed, not in the middle of a step), and
mapped into memory (MAP_SHARED), so the optimizer and the checkpoint code use it as any
tensor. What decides how much of it is in RAM is `prefetch` and `release`, called by the
optimizer around each bucket it steps: `prefetch` asks the kernel to start reading the
next bucket's pages (MADV_WILLNEED, asynchronous), `release` writes back and drops the
pages of a bucket already stepped out of the process (MADV_PAGEOUT; MADV_DONTNEED where
the kernel has none) and starts writing them back (posix_fadvise DONTNEED), dropping
them from the page cache at the next release, once written. So reading bucket k+1 and
writing bucket k-1 overlap the step of bucket k, and about three buckets of these
buffers are in memory, the process's and the page cache's together.

The directory holds scratch, never trusted on its own: a run recreates its files at
start, and resuming goes through checkpoints. Each rank owns `rank{r}/` and a lock file
naming its process; a second run pointed at the same directory fails at start while the
first lives (a lock whose process is gone is taken over). Each file is unlinked as soon as
it is open, so a run killed outright leaves no bytes behind (only its lock and an empty
`rank{r}/`); the rest goes when the run ends (the optimizer is freed or the process exits).
"""
from __future__ import annotations

import atexit
import errno
import json
import mmap
import os
import shutil
import socket
import weakref

import torch

__all__ = ["Arena", "OffloadDir"]

_MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)  # Linux >= 5.4
_PAGE = mmap.PAGESIZE


class OffloadDir:
    """One rank's files under `root` (see [Note: disk buffers])."""

    def __init__(self, root: str, rank: int):
        root = os.path.abspath(os.fspath(root))
        if not os.path.isdir(root):
            raise FileNotFoundError(f"Config.offload_dir={root!r} does not exist (or is not a directory): create it "
                                    f"on a local disk with room for the offloaded states")
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(f"Config.offload_dir={root!r} is not writable by this process: choose a "
                                  f"directory it may write")
        self.root, self.rank = root, rank
        self.dir = os.path.join(root, f"rank{rank}")
        self.lock = os.path.join(root, f"rank{rank}.lock")
        self._take_lock()
        try:
            shutil.rmtree(self.dir, ignore_errors=True)  # scratch of an earlier run: never trusted
            os.makedirs(self.dir)
        except OSError:
            os.remove(self.lock)
            raise
        self.regions: list[tuple[int, int, mmap.mmap, int]] = []  # (address, bytes, mapping, fd)
        self._written: list = []  # (fd, offset, bytes) released last, being written back
        self.nbytes = 0
        self._count = 0
        self._closer = weakref.finalize(self, _close, self.dir, self.lock, self.regions, os.getpid())
        atexit.register(self._closer)

    def close(self) -> None:
        """Delete the files and the lock now (the run failed to start, or is done)."""
        self._closer()

    def _take_lock(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    with open(self.lock) as f:
                        owner = json.load(f)
                except (OSError, ValueError):  # empty: its writer died between create and write,
                    owner = {"host": me["host"], "pid": -1}  # or is writing it now (microseconds)
                if owner.get("host") == me["host"] and not _alive(int(owner.get("pid", -1))):
                    os.remove(self.lock)  # its process is gone: a killed run's
                    continue
                raise RuntimeError(f"Config.offload_dir={self.root!r} is in use by another run (rank {self.rank}: "
                                   f"process {owner.get('pid')} on {owner.get('host')}, lock {self.lock}): give "
                                   f"each run a directory of its own")
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of `numel` elements backed by a new, fully allocated file (zeros)."""
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        path = os.path.join(self.dir, f"buffer{self._count}.bin")
        self._count += 1
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        # Unlinked at once: the open file keeps its blocks, and a run killed outright
        # leaves no bytes on the disk behind it.
        os.remove(path)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    free = shutil.disk_usage(self.root).free
                    raise OSError(e.errno, f"Config.offload_dir={self.root!r} is full: {nbytes:,} more bytes are "
                                           f"needed for the offloaded states ({self.nbytes:,} taken so far), "
                                           f"{free:,} are free: free space or choose a larger disk") from e
                raise
            pages = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        t = torch.frombuffer(pages, dtype=dtype, count=numel)
        self.regions.append((t.data_ptr(), nbytes, pages, fd))
        self.nbytes += nbytes
        return t

    def arena(self, nbytes: int) -> "Arena":
        """One file of `nbytes`, allocated now, to be cut into buffers (`Arena.take`): what
        is reserved at once fails at once when the disk cannot hold it."""
        return Arena(self.empty(nbytes, torch.uint8))

    def _ranges(self, tensors):
        """(mapping, fd, page-aligned offset, length) of each tensor that lies in a file."""
        for t in tensors:
            if t is None or t.numel() == 0:
                continue
            start, length = t.data_ptr(), t.numel() * t.element_size()
            for base, nbytes, pages, fd in self.regions:
                if base <= start < base + nbytes:
                    lo = (start - base) // _PAGE * _PAGE
                    hi = min(nbytes, -(-(start - base + length) // _PAGE) * _PAGE)
                    yield pages, fd, lo, hi - lo
                    break

    def prefetch(self, tensors) -> None:
        """Start reading these tensors' pages from disk (asynchronous)."""
        for pages, _, lo, n in self._ranges(tensors):
            pages.madvise(mmap.MADV_WILLNEED, lo, n)

    def release(self, tensors) -> None:
        """Drop these tensors' pages from this process and start writing them back
        (asynchronous); the pages released the time before, written by now, leave the
        page cache too."""
        for fd, lo, n in self._written:
            os.posix_fadvise(fd, lo, n, os.POSIX_FADV_DONTNEED)
        self._written = []
        for pages, fd, lo, n in self._ranges(tensors):
            try:
                pages.madvise(_MADV_PAGEOUT, lo, n)
            except OSError:
                pages.madvise(mmap.MADV_DONTNEED, lo, n)
            os.posix_fadvise(fd, lo, n, os.POSIX_FADV_DONTNEED)  # starts the writeback of dirty pages
            self._written.append((fd, lo, n))

    def owns(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(base <= p < base + n for base, n, _, _ in self.regions)


class Arena:
    """Page-aligned buffers cut, one after another, from one file-backed tensor."""

    def __init__(self, space: torch.Tensor):
        self.space, self.used = space, 0

    @staticmethod
    def nbytes_for(sizes) -> int:
        """Bytes an arena needs for buffers of these (numel, dtype) sizes."""
        return sum(-(-numel * dtype.itemsize // _PAGE) * _PAGE for numel, dtype in sizes)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self.used + nbytes > self.space.numel():
            raise RuntimeError(f"offload arena of {self.space.numel():,} bytes has no room for {nbytes:,} more "
                               f"({self.used:,} used): the reservation undercounted")
        out = self.space[self.used: self.used + nbytes].view(dtype)
        self.used += -(-nbytes // _PAGE) * _PAGE
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _close(directory: str, lock: str, regions: list, owner: int) -> None:
    """The run's files go when it ends (not from a forked child's exit); a mapping still
    viewed by a tensor stays valid (the kernel keeps a file's pages while it is mapped)."""
    if os.getpid() != owner:
        return
    for _, _, _, fd in regions:
        try:
            os.close(fd)
        except OSError:
            pass
    regions.clear()
    shutil.rmtree(directory, ignore_errors=True)
    try:
        os.remove(lock)
    except OSError:
        pass
