"""Asynchronous saves: `zerodp.save(..., asynchronous=True)`.

[Note: asynchronous save]
The save's steps are saving.py's. On the training thread, as a synchronous save: the plan
(one object gather on the training process group) and the snapshot, whose tensors are
copied into staging buffers (`Staging`) instead of fresh memory; then `save` returns an
`AsyncSave`. On a thread of the save: the rank's files are written and fsynced, the ranks
agree that every rank's files are complete, rank 0 commits and tidies (`saving.finish`).

The agreement is a collective, and it must not share the training process group with the
training's own: gloo pairs the n-th collective of a group on each rank with the n-th of the
others ([Note: gloo pairing] in distributed/collectives.py), and a thread's gather would
pair with whatever gradient reduction the other rank issues then. So the background
collectives run on a process group of their own, a gloo group over the same ranks created
once per training group (`channel`), with its own Comm and ledger: the training's ledger
and step fingerprint never see them. torch DCP's `async_save` asks for the same (a
separate CPU process group). The other way, agreeing and committing on the training thread
at the next save, would leave each finished checkpoint invisible until the next one
starts: a crash in between would lose a checkpoint that was whole on disk.

Invariants:
- One save at a time per training group: every `save` and `load` first waits for the one
  in flight (`wait_in_flight`), and raises its failure, on every rank alike (the ranks
  exchanged their statuses). The staging buffers are therefore never written while a
  thread reads them.
- A crash at any point leaves what a synchronous save's crash leaves ([Note: atomic save]):
  the unfinished `.tmp-` directory, which `latest()` skips and the next save removes
  ([Note: stale leftovers] in retention.py), and the previous checkpoint untouched.
- The thread is a daemon; at exit, and in `zerodp.shutdown_distributed`, `wait_for_saves`
  runs so the last save completes, then the channels' groups are destroyed and freed
  (`close_channels`): their gloo workers must end while the interpreter is whole ([Note:
  exit path] in distributed/comm.py). A script that destroys the process group itself
  calls `wait_for_saves()` (or the handle's `wait()`) first: the agreement needs it.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed.comm import Comm, before_shutdown
from ..distributed.topology import forget_meshes
from ..memory.placement import Placement
from .format import CheckpointError, describe_error
from .saving import Snapshot, finish, write_status

log = logging.getLogger(__name__)

__all__ = ["AsyncSave", "Staging", "close_channels", "wait_for_saves"]


class Staging:
    """Host buffers an asynchronous save copies the rank's tensors into: one flat buffer per
    dtype, as large as the largest save needed, allocated once and kept (pinned beside CUDA,
    so the copies from the device run asynchronously). Its bytes are the rank's checkpoint
    bytes: the pieces it writes, plus on rank 0 the replicated tensors."""

    def __init__(self, pinned: bool):
        self.placement = Placement("host", pinned=pinned)
        self.buffers: dict = {}  # dtype -> 1-D tensor

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def stage(self, sources: dict) -> dict:
        """Copies of `sources` (name -> tensor, on any device) in the buffers, by name."""
        need: dict = {}
        for t in sources.values():
            need[t.dtype] = need.get(t.dtype, 0) + t.numel()
        for dtype, numel in need.items():
            held = self.buffers.get(dtype)
            if held is None or held.numel() < numel:
                self.buffers.pop(dtype, None)  # freed before its successor is allocated
                self.buffers[dtype] = self.placement.empty(numel, dtype, torch.device("cpu"))
        used: dict = {}
        out = {}
        with torch.no_grad():
            for name, t in sources.items():
                at = used.get(t.dtype, 0)
                view = self.buffers[t.dtype][at:at + t.numel()].view(t.shape)
                self.placement.copy_into(view, t.detach())
                used[t.dtype] = at + t.numel()
                out[name] = view
        self.placement.synchronize()
        return out


class AsyncSave:
    """A save in flight, as torch's Future: `wait()` returns the checkpoint's path once it is
    committed, or raises the CheckpointError every rank raises; `done()` does not block;
    `add_done_callback(fn)` runs `fn(path)` on this rank once the save is committed (on the
    save's thread, or at once if it already is), before `wait()` returns; an error in it
    is the save's."""

    def __init__(self, path: str, tmp: str, snap: Snapshot, comm: Comm, keep_last: Optional[int]):
        self.path, self.tmp = path, tmp
        self.staged_nbytes = snap.nbytes
        self.timings: dict = {}  # seconds: "write" (this rank's files, fsynced), "total" (committed)
        self._error: Optional[BaseException] = None
        self._reported = False
        self._callbacks: list = []
        self._lock = threading.Lock()
        self._committed = False
        self._saved = False  # committed: a failure after it is a callback's
        self._thread = threading.Thread(target=self._run, args=(snap, comm, keep_last), daemon=True,
                                        name=f"zerodp-save-{path}")
        self._thread.start()

    def _run(self, snap: Snapshot, comm: Comm, keep_last: Optional[int]) -> None:
        started = time.perf_counter()
        try:
            status = write_status(self.tmp, snap)
            self.timings["write"] = time.perf_counter() - started
            finish(comm, self.path, self.tmp, status, keep_last)
            log.info("rank %d: saved checkpoint %s (step %d) in the background", comm.rank, self.path, snap.step)
            self.timings["total"] = time.perf_counter() - started
            self._saved = True
            failed = None
            while True:
                with self._lock:
                    if not self._callbacks:
                        self._committed = True
                        break
                    fn = self._callbacks.pop(0)
                try:
                    fn(self.path)
                except Exception as e:  # noqa: BLE001 - exchanged below, so every rank raises it
                    failed = failed or f"{type(e).__name__}: {e}"
            # Callbacks may run on some ranks only (the Trainer's rename, on rank 0): their
            # failure is exchanged, so that every rank raises it rather than one rank raising
            # while the others wait in the next save's collectives.
            problems = comm.all_gather_object(failed, "checkpoint", label=f"after the save of {self.path}")
            bad = [(r, p) for r, p in enumerate(problems) if p is not None]
            if bad:
                raise CheckpointError(f"rank {comm.rank}: checkpoint {self.path} was saved, but what was to run "
                                      f"once it was failed on rank {bad[0][0]}: {bad[0][1]}")
        except BaseException as e:  # noqa: BLE001 - raised to the training thread by wait()
            self._error = e
            self.timings.setdefault("total", time.perf_counter() - started)

    def add_done_callback(self, fn) -> None:
        with self._lock:
            if not self._committed:
                self._callbacks.append(fn)
                return
        if self._error is None:
            fn(self.path)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        """Block until the save is committed or failed; returns its path or raises (once)."""
        self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            if self._saved:
                raise self._error
            raise CheckpointError(f"asynchronous save of {self.path} failed: {describe_error(self._error)}; "
                                  f"the previous checkpoints are untouched") from self._error
        return self.path


# Per training process group (by name, with the group itself to tell a re-created one apart):
# the checkpoint channel and the save in flight on it, one at a time. Per optimizer: its
# staging buffers, freed with it.
_CHANNELS: dict = {}
_IN_FLIGHT: dict = {}
_STAGING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _key(optimizer) -> str:
    return optimizer.comm.topology.name


def channel(optimizer) -> Comm:
    """The checkpoint channel of `optimizer`'s process group: a Comm over a gloo group of the
    same ranks, created once (collectively: every rank is in `save`). See [Note:
    asynchronous save]. A world of one needs no group; it gets a Comm that never communicates."""
    group = optimizer.comm.topology.data_group
    built = _CHANNELS.get(_key(optimizer))
    if built is not None and built[0] is group:
        return built[1]
    comm = optimizer.comm.side_channel(optimizer.config.collective_timeout_s)
    _CHANNELS[_key(optimizer)] = (group, comm)
    return comm


def staging(optimizer) -> Staging:
    """`optimizer`'s staging buffers (the save in flight was waited for: they are free)."""
    if optimizer not in _STAGING:
        _STAGING[optimizer] = Staging(pinned=optimizer.comm.device.type == "cuda")
    return _STAGING[optimizer]


def start(optimizer, path: str, tmp: str, snap: Snapshot, keep_last: Optional[int]) -> AsyncSave:
    """Write and commit `snap` on a thread; the caller waited for the previous save."""
    handle = AsyncSave(path, tmp, snap, channel(optimizer), keep_last)
    _IN_FLIGHT[_key(optimizer)] = handle
    return handle


def wait_in_flight(optimizer) -> Optional[str]:
    """Wait for the save in flight on `optimizer`'s process group, if any, and raise its failure."""
    handle = _IN_FLIGHT.pop(_key(optimizer), None)
    return handle.wait() if handle is not None else None


def wait_for_saves() -> list[str]:
    """Wait for every asynchronous save of this process; returns their paths, or raises the
    first failure (every rank raises it). Call it on every rank before destroying the
    process group, and wherever the newest checkpoint must be on disk."""
    paths, first_error = [], None
    for key in list(_IN_FLIGHT):
        try:
            paths.append(_IN_FLIGHT.pop(key).wait())
        except CheckpointError as e:
            first_error = first_error or e
    if first_error is not None:
        raise first_error
    return paths


def close_channels() -> None:
    """Destroy the checkpoint channels' process groups and drop zerodp's references to them
    (the channels' Comms and the meshes built over them), so that the groups are freed and
    their gloo workers joined; the saves were waited for. A channel made again later is
    made anew. See [Note: exit path] in distributed/comm.py."""
    channels = list(_CHANNELS.values())
    _CHANNELS.clear()
    for _, comm in channels:
        group = comm.topology.data_group
        if group is not None and dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except ValueError:  # already destroyed, with every group (dist.destroy_process_group())
                pass
    forget_meshes()  # a mesh over a channel's group holds it


# zerodp.shutdown_distributed, and the exit, commit the save in flight, then close the channels.
before_shutdown(wait_for_saves, close_channels)
