"""What a checkpoint directory keeps: leftovers of killed saves are removed, and with
`keep_last` only the newest complete checkpoints stay.

[Note: stale leftovers]
A save killed outright (SIGKILL, a node lost) leaves its `{path}.tmp-{id}` directory; one
killed in the middle of replacing a checkpoint may leave `{path}.old-{id}`. Neither is ever
loaded (`latest` skips both), but they hold the disk. Each temporary directory names its
writer (OWNER: host with its boot and pid namespace, pid, start time), written before the
directory gets its `.tmp-` name (it is made as `{path}.staging-{id}` and renamed once OWNER
is in it, so a kill can never leave a `.tmp-` directory without one); after every
successful save rank 0 removes the siblings whose writer is gone: on this host, a pid that
no longer runs; elsewhere (a shared filesystem, another container), one older than a day. A save in progress, by this job or another, is
never touched. `.old-` and `.staging-` directories live for the milliseconds of a commit or
of naming the writer; one older than a minute is a leftover.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid

from .format import COMPLETE, METADATA, OLD_TAG, STAGING_TAG, TMP_TAG

log = logging.getLogger(__name__)

__all__ = ["OWNER", "owner_record", "prune", "remove_stale"]

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
    except ProcessLookupError:
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
        with open(os.path.join(entry.path, OWNER)) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return age > FOREIGN_STALE_S  # no owner recorded (yet, or by an older zerodp)
    if owner.get("host") == _machine():
        return not _alive(int(owner.get("pid", -1)))
    return now - float(owner.get("started", 0.0)) > FOREIGN_STALE_S


def remove_stale(directory: str) -> list[str]:
    """Remove the leftovers of killed saves directly under `directory`; returns their names."""
    removed, now = [], time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False) or not any(
                tag in entry.name for tag in (TMP_TAG, OLD_TAG, STAGING_TAG)):
            continue
        try:
            if _is_stale(entry, now):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
        except OSError:  # gone meanwhile, or unreadable: not ours to judge
            continue
    if removed:
        log.info("removed leftovers of killed saves in %s: %s", directory, removed)
    return removed


def prune(directory: str, keep_last: int, keep: str) -> list[str]:
    """Remove all but the `keep_last` most recently completed checkpoints directly under
    `directory`, never `keep`; returns their names. By completion time, not step: a run
    started over in an old directory keeps its own newest, not the old run's."""
    found = []
    for entry in os.scandir(directory):
        if not entry.is_dir(follow_symlinks=False) or TMP_TAG in entry.name or OLD_TAG in entry.name:
            continue
        try:
            with open(os.path.join(entry.path, METADATA)) as f:
                step = int(json.load(f)["step"])
            done = os.path.getmtime(os.path.join(entry.path, COMPLETE))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a complete zerodp checkpoint: never ours to delete
        found.append((done, step, entry.path))
    found.sort(reverse=True)
    removed = []
    for _, _, path in found[keep_last:]:
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
