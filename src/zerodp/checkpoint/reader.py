"""Reading a checkpoint: its marker and metadata, each file's sha256 before use, and element
ranges of flattened parameters from the pieces that hold them."""
from __future__ import annotations

import contextlib
import json
import math
import os

import torch
from safetensors import safe_open

from .files import digest
from .format import (COMPLETE, FORMAT, FORMAT_VERSION, METADATA, TMP_TAG, CheckpointError, PathLike, describe_error,
                     rank_file)

__all__ = ["Reader", "flat_range", "name_mismatch", "open_checkpoint", "verify"]


def open_checkpoint(path: PathLike) -> tuple[str, dict, dict]:
    """(path, metadata, {file: size/sha256}) of a complete checkpoint, or a CheckpointError.
    Checks presence and size of every file; contents are checked as they are read."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint: a zerodp checkpoint is a directory, this is a file")
    marker, meta_file = os.path.join(path, COMPLETE), os.path.join(path, METADATA)
    if TMP_TAG in os.path.basename(path):
        raise CheckpointError(f"{path} is the temporary directory of a save that did not finish; "
                              f"use zerodp.latest() to find the newest complete checkpoint")
    if not os.path.exists(marker):
        if not os.path.exists(meta_file):
            raise CheckpointError(f"{path} is not a zerodp checkpoint: it has neither {METADATA} nor {COMPLETE}")
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE} marker): the save that wrote it "
                              f"did not finish; use zerodp.latest() to find the newest complete checkpoint")
    try:
        with open(marker) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: {COMPLETE} is unreadable ({describe_error(e)})") from e
    problems = []
    for name, d in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems.append(f"{name} is missing")
        elif os.path.getsize(file) != d["size"]:
            problems.append(f"{name} has {os.path.getsize(file)} bytes, {d['size']} were written (truncated?)")
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
    verify(path, METADATA, files)
    with open(meta_file) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r} version "
                              f"{meta.get('format_version')!r}; this zerodp reads {FORMAT!r} version {FORMAT_VERSION}")
    return path, meta, files


def verify(path: str, name: str, files: dict) -> None:
    if name not in files:
        raise CheckpointError(f"checkpoint {path}: {name} is not listed in {COMPLETE}")
    found = digest(os.path.join(path, name))
    if found["sha256"] != files[name]["sha256"]:
        raise CheckpointError(f"checkpoint {path}: {name} is corrupt (sha256 {found['sha256'][:12]}..., "
                              f"{files[name]['sha256'][:12]}... was written)")


class Reader(contextlib.ExitStack):
    """A checkpoint's safetensors files, each opened once, after its sha256 is checked."""

    def __init__(self, path: str, files: dict):
        super().__init__()
        self.path, self.files = path, files
        self._open: dict = {}

    def file(self, name: str):
        if name not in self._open:
            verify(self.path, name, self.files)
            try:
                self._open[name] = self.enter_context(
                    safe_open(os.path.join(self.path, name), framework="pt", device="cpu"))
            except Exception as e:
                raise CheckpointError(f"checkpoint {self.path}: {name} is not a safetensors file ({e})") from e
        return self._open[name]

    def read_range(self, kind: str, name: str, pieces: list, start: int, numel: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """Elements [start, start+numel) of flattened parameter `name`, from the pieces
        that overlap them (see [Note: checkpoint layout])."""
        out = torch.empty(numel, dtype=dtype)
        covered = 0
        for rank, p_start, p_numel in pieces:
            lo, hi = max(start, p_start), min(start + numel, p_start + p_numel)
            if lo >= hi:
                continue
            key = f"{kind}/{name}/{p_start}"
            f = self.file(rank_file(rank))
            try:
                out[lo - start: hi - start] = f.get_slice(key)[lo - p_start: hi - p_start]
            except Exception as e:
                raise CheckpointError(f"checkpoint {self.path}: {rank_file(rank)} lacks {key} ({e})") from e
            covered += hi - lo
        if covered != numel:
            raise CheckpointError(f"checkpoint {self.path}: elements [{start}, {start + numel}) of {name} are "
                                  f"not all held by any rank file ({covered} of {numel} found)")
        return out


def flat_range(f, key: str, shape: list, start: int, numel: int) -> torch.Tensor:
    """Elements [start, start+numel) of a flattened tensor in a safetensors file, reading
    only the rows of its first dimension that hold them."""
    if len(shape) == 0:
        return f.get_tensor(key).reshape(-1)[start: start + numel]
    row = math.prod(shape[1:])
    if row == 0:
        return torch.empty(0)
    r0, r1 = start // row, -(-(start + numel) // row)
    block = f.get_slice(key)[r0:r1].reshape(-1)
    return block[start - r0 * row: start - r0 * row + numel]


def name_mismatch(path: str, what: str, expected: dict, found: dict) -> str | None:
    """A message listing names missing from, unexpected in, or shaped differently in
    `found` compared with `expected` ({name: shape}), or None when they match."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    shapes = sorted(f"{n} {tuple(found[n])} vs model {tuple(expected[n])}"
                    for n in set(expected) & set(found)
                    if found[n] is not None and expected[n] is not None and list(found[n]) != list(expected[n]))
    if not (missing or unexpected or shapes):
        return None
    parts = []
    for label, items in (("missing", missing), ("not in the model", unexpected), ("shape differs", shapes)):
        if items:
            more = f" and {len(items) - 10} more" if len(items) > 10 else ""
            parts.append(f"{label} ({len(items)}): {', '.join(items[:10])}{more}")
    return f"{what} {path} does not match the model: " + "; ".join(parts)
