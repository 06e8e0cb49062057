"""Atomic file I/O for checkpoints: fsynced writes with their size and sha256, and the
commit that makes a finished temporary directory the checkpoint.

[Note: atomic save]
Every rank writes under `{path}.tmp-{id}` (the id is rank 0's, agreed by all_gather_object),
fsyncs its files, then all ranks exchange "ok"/"failed" with all_gather_object. Only if
every rank succeeded does rank 0 write COMPLETE inside the temporary directory (to a side
file, renamed, so it is whole or absent) and then swap the directory into `path` in one
atomic rename (`commit`); otherwise rank 0 removes the temporary directory and every rank
raises the same CheckpointError. A checkpoint without COMPLETE is never loaded and
`latest()` skips it, so a failure at any point leaves the previous checkpoint the newest
complete one. A rank that dies outright (instead of raising) makes the others fail at the
exchange after the process group's timeout, with the same outcome on disk.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid

import torch

from safetensors.torch import save_file

from .format import COMPLETE, FORMAT, OLD_TAG, CheckpointError

log = logging.getLogger(__name__)

__all__ = ["commit", "digest", "digest_written", "parse_json", "read_json", "read_marker", "refuse_to_replace",
           "write_json", "write_safetensors"]

CHUNK = 1 << 20
# A checkpoint's files are opened without following a symbolic link (where the OS can):
# a link planted in a checkpoint must not make a read land outside it.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def open_nofollow(file: str, mode: str = "rb"):
    return os.fdopen(os.open(file, os.O_RDONLY | NOFOLLOW), mode)


def digest(file: str) -> dict:
    h = hashlib.sha256()
    size = 0
    with open_nofollow(file) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def parse_json(text: str):
    """JSON from a checkpoint's files, where any malformed text is a ValueError: json's
    decoder recurses once per nesting level, so '[' * 100000 raises RecursionError, which
    the callers' checks for bad input (and their callers' `except OSError`) would let through."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("it is nested too deeply to be JSON that zerodp wrote") from None


def read_json(file: str):
    with open_nofollow(file, "r") as f:
        return parse_json(f.read())


def read_marker(directory: str) -> dict | None:
    """The COMPLETE marker of a zerodp checkpoint directory, or None if it is none (no
    marker, a linked one, or another program's file of that name). A marker that is not
    JSON is logged: the directory looks like a checkpoint, and the user may wonder why it
    is not one."""
    file = os.path.join(directory, COMPLETE)
    try:
        marker = read_json(file)
    except OSError:
        return None
    except ValueError as e:
        log.warning("%s is not a complete zerodp checkpoint, skipped: its %s is not JSON (%s)", directory, COMPLETE,
                    _shown(str(e)))
        return None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or not isinstance(marker.get("files"), dict):
        return None
    return marker


def _shown(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def refuse_to_replace(path: str) -> None:
    """`save` replaces only what it could have written itself: nothing, an empty directory
    or a zerodp checkpoint. Anything else at `path` (a run directory with train.log, a file,
    a link) is the user's, and replacing it would delete it."""
    if not os.path.lexists(path):
        return
    fix = "save to a new path (e.g. a step_N directory inside it), or move or remove it yourself"
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symbolic link, not a zerodp checkpoint: zerodp.save would replace the "
                              f"link itself; {fix}")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file, not a zerodp checkpoint: zerodp.save replaces only a checkpoint "
                              f"it wrote; {fix}")
    names = sorted(os.listdir(path))
    if not names or read_marker(path) is not None:
        return
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise CheckpointError(f"{path} exists and is not a zerodp checkpoint (it holds {shown}; no {COMPLETE} marker "
                          f"of zerodp): zerodp.save replaces only a checkpoint it wrote, which would delete these "
                          f"files; {fix}")


def fsync(file: str) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(file: str, tensors: dict) -> dict:
    """Write, fsync and return the size and sha256 of a safetensors file.

    The sha256 is of the header read back and the tensors' bytes as safetensors was given
    them (it copies them unchanged on a little-endian host), hashed from memory while the
    disk flushes the file: reading 0.7 GB back from the page cache to hash it cost the 124M
    model's asynchronous save a third of its background time, on the cores training runs on
    (benchmarks/results/checkpoint-*.md). What the disk holds is checked where it matters,
    at load (`reader.verify` hashes the file)."""
    save_file(tensors, file, metadata={"format": "pt"})
    flushed: list = []
    flusher = threading.Thread(target=lambda: flushed.append(_try(fsync, file)), name="zerodp-fsync")
    try:
        flusher.start()
    except RuntimeError:  # no new thread at interpreter shutdown (Python 3.12.0-3.12.2): an
        flusher = None    # asynchronous save finishing at exit flushes, then hashes
        fsync(file)
    try:
        found = digest_written(file, tensors)
    finally:
        if flusher is not None:
            flusher.join()
    if flushed and flushed[0] is not None:
        raise flushed[0]
    return found


def _try(fn, *args) -> BaseException | None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - raised by the caller, on its thread
        return e
    return None


def digest_written(file: str, tensors: dict) -> dict:
    """`digest(file)` of the safetensors file just written from `tensors`, without reading its
    data: its header read back, then each tensor's bytes in the order the header places them.
    Raises CheckpointError where the file is not exactly that (a gap, a size, a name)."""
    with open_nofollow(file) as f:
        prefix = f.read(8)
        header = f.read(int.from_bytes(prefix, "little")) if len(prefix) == 8 else b""
        size = os.fstat(f.fileno()).st_size
    try:
        index = parse_json(header)
    except ValueError as e:
        raise CheckpointError(f"{file}: the safetensors header just written does not parse ({e})") from e
    names = sorted(k for k in index if k != "__metadata__")
    if names != sorted(tensors):
        raise CheckpointError(f"{file}: the file just written does not lay out the tensors given "
                              f"({len(names)} in it, {len(tensors)} given)")
    h = hashlib.sha256(prefix)
    h.update(header)
    end = 0
    for (start, stop), name in sorted((v["data_offsets"], k) for k, v in index.items() if k != "__metadata__"):
        data = tensor_bytes(tensors[name])
        if start != end or stop - start != data.nbytes:
            raise CheckpointError(f"{file}: the file just written does not lay out {name!r} as its tensor "
                                  f"({start}..{stop} after {end})")
        h.update(data)
        end = stop
    if size != 8 + len(header) + end:
        raise CheckpointError(f"{file}: {size} bytes written where its tensors make {8 + len(header) + end}")
    return {"size": size, "sha256": h.hexdigest()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes as they lie in memory (no copy of a contiguous one)."""
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_json(file: str, obj) -> dict:
    with open(file, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return digest(file)


def fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fsync(path)


def commit(tmp: str, path: str, files: dict) -> None:
    """Make the finished temporary directory the checkpoint at `path`.

    COMPLETE is written inside the private temporary directory first, so a failure there
    (a full disk) leaves the previous checkpoint at `path` in place and trusted. Only then
    is the previous one moved aside and the new one renamed into place; a save to the same
    path that wins the race in between is moved aside in turn, and the last rename wins.
    `save` checked `path` on every rank before writing ([Note: atomic save]); it is checked
    again here, just before it is replaced, in case a user's file arrived in between."""
    side = os.path.join(tmp, COMPLETE + ".writing")
    # "completed" orders checkpoints for latest() and keep_last ([Note: checkpoint order] in
    # retention.py): recorded inside, so a copy that gives every file a new time keeps it.
    write_json(side, {"format": FORMAT, "files": files, "completed": time.time()})
    os.replace(side, os.path.join(tmp, COMPLETE))
    fsync_dir(tmp)
    refuse_to_replace(path)
    if os.path.isdir(path) and not os.path.islink(path) and exchange(tmp, path):
        # One atomic swap: `path` is never missing, not even for a reader in between.
        fsync_dir(os.path.dirname(path))
        shutil.rmtree(tmp, ignore_errors=True)  # now the previous checkpoint
        return
    displaced = []
    for attempt in range(8):
        if os.path.lexists(path):
            old = f"{path}{OLD_TAG}{uuid.uuid4().hex[:12]}"
            try:
                os.rename(path, old)
                displaced.append(old)
            except FileNotFoundError:  # another save moved it first
                pass
        try:
            os.rename(tmp, path)
            break
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or attempt == 7:
                if displaced and not os.path.lexists(path):  # put the previous checkpoint back
                    os.rename(displaced.pop(), path)
                raise
    fsync_dir(os.path.dirname(path))
    for old in displaced:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:  # a file or a link where the checkpoint was to go
            os.unlink(old)


def exchange(a: str, b: str) -> bool:
    """Swap two directories atomically (Linux renameat2 with RENAME_EXCHANGE); False where
    the C library or the filesystem cannot, and the caller renames in two steps instead."""
    rename2 = renameat2()
    if rename2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if rename2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), b)


@functools.lru_cache(maxsize=1)
def renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn
