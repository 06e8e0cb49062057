"""Reading a checkpoint: its marker and metadata, each file's sha256 before use, and element
ranges of flattened parameters from the pieces that hold them."""
from __future__ import annotations

import bisect
import contextlib
import math
import os
import stat

import torch
from safetensors import safe_open

from .files import digest, read_json
from .format import (COMPLETE, FORMAT, FORMAT_VERSION, METADATA, TMP_TAG, CheckpointError, InvalidCheckpoint,
                     PathLike, describe_error, is_format_name, rank_file, rank_json)
from .schema import check_listing, check_metadata, check_rng, check_tp_record
from .tp_pieces import piece_runs

__all__ = ["Reader", "flat_range", "name_mismatch", "open_checkpoint", "read_rank_json", "verify"]


def open_checkpoint(path: PathLike) -> tuple[str, dict, dict]:
    """(real path, metadata, {file: size/sha256}) of a complete checkpoint, or a CheckpointError.
    Checks COMPLETE and metadata.json whole ([Note: a checkpoint is input] in schema.py), and
    presence and size of every file; contents are checked as they are read. Only names the
    format writes are opened, each a regular file directly in the directory's real path."""
    # A link to the checkpoint is fine: its files are inside its target.
    path = os.path.realpath(os.fsdecode(os.fspath(path)))
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:  # as `save` refuses to write one: see saving._check_path
        raise CheckpointError(f"checkpoint path {path!r} is not valid UTF-8: safetensors, which zerodp reads "
                              f"checkpoints with, opens only UTF-8 paths; rename it to a UTF-8 name") from None
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint: a zerodp checkpoint is a directory, this is a file")
    if TMP_TAG in os.path.basename(path):
        raise CheckpointError(f"{path} is the temporary directory of a save that did not finish; "
                              f"use zerodp.latest() to find the newest complete checkpoint")
    if not os.path.lexists(os.path.join(path, COMPLETE)):
        if not os.path.isdir(path):
            raise removed(path, COMPLETE)
        if not os.path.lexists(os.path.join(path, METADATA)):
            raise CheckpointError(f"{path} is not a zerodp checkpoint: it has neither {METADATA} nor {COMPLETE}")
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE} marker): the save that wrote it "
                              f"did not finish; use zerodp.latest() to find the newest complete checkpoint")
    try:
        files = check_listing(path, read_json(inside(path, COMPLETE)))
    except FileNotFoundError:
        raise removed(path, COMPLETE) from None
    except (OSError, ValueError) as e:
        if isinstance(e, InvalidCheckpoint):
            raise
        raise InvalidCheckpoint(f"checkpoint {path}: {COMPLETE} is unreadable ({describe_error(e)})") from e
    problems = []
    for name, d in sorted(files.items()):
        try:
            size = os.lstat(inside(path, name)).st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if size != d["size"]:
            problems.append(f"{name} has {size} bytes, {d['size']} were written (truncated?)")
    if problems:
        if not os.path.isdir(path):
            raise removed(path, COMPLETE)
        raise InvalidCheckpoint(f"checkpoint {path} is damaged: " + "; ".join(problems))
    verify(path, METADATA, files)
    meta = read_checked_json(path, METADATA)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        found = meta if not isinstance(meta, dict) else (meta.get("format"), meta.get("format_version"))
        raise InvalidCheckpoint(f"checkpoint {path} has format {found!r}; this zerodp reads {FORMAT!r} version "
                                f"{FORMAT_VERSION}")
    check_metadata(path, meta, files)
    return path, meta, files


def inside(path: str, name: str) -> str:
    """The file `name` of checkpoint `path`, refused unless it is a name the format writes
    (never a path: no '/', no '..') and a regular file, not a link (which could lead out)."""
    if name != COMPLETE and not is_format_name(name):
        raise InvalidCheckpoint(f"checkpoint {path}: {name!r} is not a file a zerodp checkpoint has")
    file = os.path.join(path, name)
    try:
        st = os.lstat(file)
    except FileNotFoundError:
        return file  # the caller reports it missing
    if stat.S_ISLNK(st.st_mode):
        raise InvalidCheckpoint(f"checkpoint {path}: {name} is a symbolic link; zerodp writes a checkpoint's files "
                                f"itself and never follows a link out of it: copy the file in instead of linking it")
    if not stat.S_ISREG(st.st_mode):
        raise InvalidCheckpoint(f"checkpoint {path}: {name} is not a regular file")
    return file


def removed(path: str, name: str) -> CheckpointError:
    """A file of a checkpoint that was complete a moment ago is gone: another job's save
    pruned it (keep_last) or replaced it while this one read it. Not a damaged checkpoint:
    `latest()` again finds the one to read now."""
    what = f"checkpoint {path} was removed" if not os.path.isdir(path) else f"checkpoint {path}: {name} was removed"
    return CheckpointError(f"{what} while being read (keep_last pruning?); load another checkpoint, e.g. "
                           f"zerodp.latest() of its directory again")


def read_checked_json(path: str, name: str):
    """A JSON file of the checkpoint, once verify() checked it."""
    try:
        return read_json(inside(path, name))
    except FileNotFoundError:
        raise removed(path, name) from None
    except ValueError as e:
        raise InvalidCheckpoint(f"checkpoint {path}: {name} is not JSON ({e})") from e


def verify(path: str, name: str, files: dict) -> None:
    if name not in files:
        raise InvalidCheckpoint(f"checkpoint {path}: {name} is not listed in {COMPLETE}")
    try:
        found = digest(inside(path, name))
    except FileNotFoundError:
        raise removed(path, name) from None
    if found["sha256"] != files[name]["sha256"]:
        raise InvalidCheckpoint(f"checkpoint {path}: {name} is corrupt (sha256 {found['sha256'][:12]}..., "
                                f"{files[name]['sha256'][:12]}... was written)")


def read_rank_json(path: str, name: str, files: dict) -> dict:
    """A rank's RNG states, after its sha256 and its contents are checked."""
    verify(path, name, files)
    return check_rng(path, name, read_checked_json(path, name))


class Reader(contextlib.ExitStack):
    """A checkpoint's safetensors files, each opened once, after its sha256 is checked."""

    def __init__(self, path: str, files: dict):
        super().__init__()
        self.path, self.files = path, files
        self._open: dict = {}
        self._records: dict = {}  # rank -> what its rank{r}.json records of its pieces, or None

    def file(self, name: str):
        if name not in self._open:
            verify(self.path, name, self.files)
            try:
                self._open[name] = self.enter_context(
                    safe_open(inside(self.path, name), framework="pt", device="cpu"))
            except InvalidCheckpoint:
                raise
            except Exception as e:
                if not os.path.exists(os.path.join(self.path, name)):
                    raise removed(self.path, name) from e
                raise InvalidCheckpoint(f"checkpoint {self.path}: {name} is not a safetensors file ({e})") from e
        return self._open[name]

    def tp_record(self, rank: int) -> dict | None:
        """What rank{r}.json records of the slices rank{r}.safetensors holds (under tensor
        parallelism; None in checkpoints without, and in those of a zerodp before the record)."""
        if rank not in self._records:
            name = rank_json(rank)
            verify(self.path, name, self.files)
            self._records[rank] = check_tp_record(self.path, name, read_checked_json(self.path, name))
        return self._records[rank]

    def _check_piece(self, kind: str, name: str, info: dict, rank: int, tp_rank: int) -> None:
        """metadata.json's split of `name` and the tensor-parallel rank of its piece in rank
        `rank`'s file are what that rank recorded when it wrote the piece: a changed split
        or a piece pointed at another tensor-parallel rank's file would otherwise read
        valid tensors into the wrong places ([Note: tensor-parallel pieces] in tp_pieces.py)."""
        record = self.tp_record(rank)
        if record is None:
            return
        wrote = record["splits"].get(name)
        expert = (info.get("split") or {}).get("axis") == "ep"  # a bank: the piece's rank is an expert-parallel one
        held = record.get("expert_parallel", {}).get("rank") if expert else record["rank"]
        if held != tp_rank or wrote != info.get("split"):
            section = "frozen" if kind == "frozen" else "params"
            raise InvalidCheckpoint(
                f"checkpoint {self.path}: {METADATA} has {section}[{name!r}] split {info.get('split')} with a piece "
                f"of tensor-parallel rank {tp_rank}'s slice in {rank_file(rank)}, but {rank_json(rank)} records that "
                f"rank {rank} wrote tensor-parallel rank {record['rank']}'s slices, with {name} split {wrote}; "
                f"{METADATA} was changed after the save: use another checkpoint")

    def tensor_slice(self, name: str, key: str, shape: list, dtype: str | None = None):
        """`get_slice(key)` of file `name`, once its shape (and dtype) is what the metadata says."""
        f = self.file(name)
        try:
            sl = f.get_slice(key)
        except Exception as e:
            raise InvalidCheckpoint(f"checkpoint {self.path}: {name} lacks {key} ({e})") from e
        if list(sl.get_shape()) != list(shape) or (dtype is not None and sl.get_dtype() != dtype):
            raise InvalidCheckpoint(f"checkpoint {self.path}: {name} holds {key} as {tuple(sl.get_shape())} "
                                    f"{sl.get_dtype()}; metadata.json says {tuple(shape)}"
                                    f"{'' if dtype is None else ' ' + dtype}")
        return sl

    def read_runs(self, kind: str, name: str, info: dict, want: list, numel: int,
                  dtype: torch.dtype) -> torch.Tensor:
        """The `numel` elements of flattened parameter `name` that `want` names, as runs
        (original flat start, offset in the result, length), from the saved pieces of `info`
        that overlap them, whatever tensor-parallel split they were saved with; one slice
        read per saved piece ([Note: tensor-parallel pieces] in tp_pieces.py)."""
        out = torch.empty(numel, dtype=dtype)
        saved = piece_runs(info)
        starts = [r[0] for r in saved]
        # (rank, piece start, piece numel, tensor-parallel rank) -> [(offset in the piece, offset in out, length)]
        hits: dict = {}
        covered = 0
        for g, at, n in want:
            i = max(bisect.bisect_right(starts, g) - 1, 0)
            while i < len(saved) and saved[i][0] < g + n:
                s_g, s_n, rank, p_start, p_numel, p_off, tp_rank = saved[i]
                lo, hi = max(g, s_g), min(g + n, s_g + s_n)
                if lo < hi:
                    hits.setdefault((rank, p_start, p_numel, tp_rank), []).append(
                        (p_off + lo - s_g, at + lo - g, hi - lo))
                    covered += hi - lo
                i += 1
        if covered != numel:
            raise CheckpointError(f"checkpoint {self.path}: {numel} elements of {name} were asked for, "
                                  f"{covered} are held by its rank files")
        for (rank, p_start, p_numel, tp_rank), runs in hits.items():
            self._check_piece(kind, name, info, rank, tp_rank)
            piece = self.tensor_slice(rank_file(rank), f"{kind}/{name}/{p_start}", [p_numel])
            lo, hi = min(r[0] for r in runs), max(r[0] + r[2] for r in runs)
            block = piece[lo:hi]  # what this rank needs of the piece, and what lies between
            for src, dst, n in runs:
                out[dst:dst + n] = block[src - lo:src - lo + n]
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
