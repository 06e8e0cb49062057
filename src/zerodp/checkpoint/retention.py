"""What a checkpoint directory keeps: leftovers of killed saves are removed, and with
`keep_last` only the newest complete checkpoints stay.

[Note: stale leftovers]
A save killed outright (SIGKILL, a node lost) leaves its `{path}.tmp-{id}` directory; one
killed in the middle of replacing a checkpoint may leave `{path}.old-{id}`. Neither is ever
loaded (`latest` skips both), but they hold the disk. Each temporary directory names its
writer (OWNER: host with its boot and pid namespace, pid, start time), written before the
directory gets its `.tmp-` name (it is made as `{path}.staging-{id}` and renamed once OWNER
is in it, and OWNER is removed only once the checkpoint has its final name, so a kill
during the commit leaves a `.tmp-` that names it; the one exception is the previous
checkpoint swapped out under a `.tmp-` name by an in-place replacement, which a kill before
its removal leaves unnamed: removed a day later, as any unnamed one); after every
successful save rank 0 removes the siblings whose writer is gone: on this host, a pid that
no longer runs; elsewhere (a shared filesystem, another container), one older than a day. A save in progress, by this job or another, is
never touched. `.old-` and `.staging-` directories live for the milliseconds of a commit or
of naming the writer; one older than a minute is a leftover. Only a name zerodp makes (the
tag and a 12-digit hex id) holding only files zerodp writes is ever a leftover: a user's
`data.tmp-2023` beside the checkpoints is not.

[Note: checkpoint order]
`latest()` and `keep_last` order the checkpoints of a directory the same way: by when each
completed, recorded in its COMPLETE marker (the marker's file time for checkpoints written
before the record). Completion, not step: a run started over in an old directory, or
continued from an earlier checkpoint after a rollback, counts its steps again, and its
newest checkpoint is the one it wrote last, while the old run's have higher steps. Resuming
the highest step would continue the abandoned run; pruning by step would delete the new
run's checkpoints first. With one order for both, what `keep_last` keeps is what `latest()`
picks. The time is recorded inside the marker so that a copy (cp -r, a sync to object
storage), which gives every file a new time, keeps the order.
"""
from __future__ import annotations

import logging
import math
import os
import re
import shutil
import socket
import time
import uuid

from .files import read_json, read_marker
from .format import COMPLETE, METADATA, OLD_TAG, STAGING_TAG, TMP_TAG, is_format_name

log = logging.getLogger(__name__)

__all__ = ["OWNER", "by_completion", "owner_record", "prune", "remove_stale"]

OWNER = "OWNER"
FOREIGN_STALE_S = 24 * 3600.0
OLD_STALE_S = 60.0


def _machine() -> str:
    """This host as pids are meaningful on it: the hostname, the boot and the pid namespace
    (two containers may share a hostname, not their pids)."""
    parts = [socket.gethostname()]
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(source) if source.endswith("/pid") else open(source).read().strip())
        except OSError:
            parts.append("?")
    return "|".join(parts)


def owner_record() -> dict:
    return {"host": _machine(), "pid": os.getpid(), "started": time.time()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no process can have that pid
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _is_stale(entry: os.DirEntry, now: float) -> bool:
    st = entry.stat(follow_symlinks=False)
    if OLD_TAG in entry.name:  # a rename sets ctime, not mtime: the time it was moved aside
        return now - st.st_ctime > OLD_STALE_S
    if STAGING_TAG in entry.name:
        return now - st.st_mtime > OLD_STALE_S
    age = now - st.st_mtime
    try:
        owner = read_json(os.path.join(entry.path, OWNER))
        pid, started = int(owner.get("pid", -1)), float(owner.get("started", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        # No owner recorded (yet, or by an older zerodp), or a record zerodp did not write:
        # judged by age alone, as one without.
        return age > FOREIGN_STALE_S
    if owner.get("host") == _machine():
        return not _alive(pid)
    return now - started > FOREIGN_STALE_S


LEFTOVER_NAME = re.compile(".+(" + "|".join(re.escape(t) for t in (TMP_TAG, OLD_TAG, STAGING_TAG)) + ")[0-9a-f]{12}")


def is_leftover_name(name: str) -> bool:
    """Whether a name has a tag `save`, `commit` and `prune` give directories on their way
    in or out: never a checkpoint to list (removing one asks for LEFTOVER_NAME in full)."""
    return any(tag in name for tag in (TMP_TAG, OLD_TAG, STAGING_TAG))


def _only_ours(path: str) -> bool:
    """Whether a leftover holds nothing but what a save writes (else it is not ours to remove)."""
    return all(is_format_name(n) or n in (COMPLETE, COMPLETE + ".writing", OWNER) for n in os.listdir(path))


def remove_stale(directory: str) -> list[str]:
    """Remove the leftovers of killed saves directly under `directory`; returns their names."""
    removed, now = [], time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False) or not LEFTOVER_NAME.fullmatch(entry.name):
            continue
        try:
            if _is_stale(entry, now) and _only_ours(entry.path):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
        except OSError:  # gone meanwhile, or unreadable: not ours to judge
            continue
    if removed:
        log.info("removed leftovers of killed saves in %s: %s", directory, removed)
    return removed


def _completed(path: str, marker: dict) -> tuple:
    """The key checkpoints are ordered by ([Note: checkpoint order]); the step and the name
    break ties of file times, which some filesystems keep to a few milliseconds."""
    recorded = marker.get("completed")
    if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and math.isfinite(recorded):
        return recorded, 0, os.path.basename(path)
    step = 0
    try:
        step = int(read_json(os.path.join(path, METADATA))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return os.lstat(os.path.join(path, COMPLETE)).st_mtime, step, os.path.basename(path)


def by_completion(directory: str) -> list[str]:
    """The complete zerodp checkpoints directly under `directory`, the most recently
    completed first ([Note: checkpoint order]). A link, a leftover or a directory without
    zerodp's COMPLETE marker is none."""
    found = []
    for entry in os.scandir(directory):
        if not entry.is_dir(follow_symlinks=False) or is_leftover_name(entry.name):
            continue
        marker = read_marker(entry.path)
        if marker is None:
            continue
        try:
            found.append((_completed(entry.path, marker), entry.path))
        except OSError:  # removed meanwhile
            continue
    found.sort(reverse=True)
    return [path for _, path in found]


def prune(directory: str, keep_last: int, keep: str) -> list[str]:
    """Remove all but the `keep_last` most recently completed checkpoints directly under
    `directory`, never `keep`; returns their names. The order is latest()'s
    ([Note: checkpoint order])."""
    removed = []
    for path in by_completion(directory)[keep_last:]:
        if os.path.abspath(path) != os.path.abspath(keep):
            # Renamed aside first, so that `latest` never sees a half-deleted checkpoint.
            aside = f"{path}{OLD_TAG}{uuid.uuid4().hex[:12]}"
            try:
                os.rename(path, aside)
            except OSError:
                continue
            shutil.rmtree(aside, ignore_errors=True)
            removed.append(os.path.basename(path))
    if removed:
        log.info("keep_last=%d: removed %s from %s", keep_last, removed, directory)
    return removed
