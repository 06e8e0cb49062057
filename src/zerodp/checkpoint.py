"""Sharded checkpoints: save, load (into any world size or stage), latest.

[Note: checkpoint layout]
A checkpoint is one directory:

    metadata.json           rank 0: versions, config, world size, stage, dtypes, param groups,
                            scalar optimizer states, loss scaler, step, the user's `extra`, and
                            for every trainable parameter its shape, dtype, group and which rank
                            file holds which element ranges ("pieces")
    rank{r}.safetensors     rank r's owned element ranges: master/{name}/{start} (fp32),
                            state/{key}/{name}/{start} (exp_avg, ...), and param/{name}/{start}
                            (the compute-dtype value, only when it is not fp32: in fp32 the
                            master is the parameter)
    rank{r}.json            rank r's RNG states (torch, CUDA, python, numpy)
    replicated.safetensors  rank 0: buffers and frozen parameters, by state_dict name
    COMPLETE                written last: size and sha256 of every other file

A piece is a range [start, start+numel) of the *flattened original parameter*, never of a
flat buffer or a stage-3 unit, so the layout does not depend on the rank count, bucket
size, stage or unit choice:
any world size and stage reads any checkpoint by opening only the pieces that overlap
what it owns (`safe_open(...).get_slice`), with no conversion step. Tensors are stored
with safetensors only; nothing is pickled.

[Note: atomic save]
Every rank writes under `{path}.tmp-{id}` (the id is rank 0's, agreed by all_gather_object),
fsyncs its files, then all ranks exchange "ok"/"failed" with all_gather_object. Only if
every rank succeeded does rank 0 move the directory to `path` and write COMPLETE (itself
written to a side file and renamed, so it is whole or absent); otherwise rank 0 removes
the temporary directory and every rank raises the same CheckpointError. A checkpoint
without COMPLETE is never loaded and `latest()` skips it, so a failure at any point
leaves the previous checkpoint the newest complete one. A rank that dies outright
(instead of raising) makes the others fail at the exchange after the process group's
timeout, with the same outcome on disk.

[Note: validate, then write]
`load` and `load_pretrained` check everything (marker, sizes and sha256 of the files a
rank reads, parameter names, shapes, groups, optimizer type), read what the rank owns
into memory, and agree across ranks that all of it worked, before they change a single
tensor. A bad checkpoint therefore raises on every rank and leaves the model, the
optimizer and the RNG as they were.

[Note: trainable state comes from the optimizer]
Trainable values and shapes are read and written through `optimizer.owned_slices()` (full
shapes, owned ranges), never the model: at stage 3 `model.state_dict()` holds 1-D shards.
The model gives only names, which are trainable (by identity: tied weights too) and the
replicated tensors, full at every stage. Nothing is gathered, at stage 3 either.
"""
from __future__ import annotations

import base64
import contextlib
import ctypes
import ctypes.util
import errno
import functools
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import uuid
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "latest", "load", "save"]

FORMAT = "zerodp-checkpoint"
FORMAT_VERSION = 1
METADATA = "metadata.json"
COMPLETE = "COMPLETE"
REPLICATED = "replicated.safetensors"
TMP_TAG = ".tmp-"  # an unfinished save
OLD_TAG = ".old-"  # a checkpoint being replaced by a save to the same path
_CHUNK = 1 << 20

PathLike = str | os.PathLike


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says which file or name and why."""


def _rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def _rank_json(rank: int) -> str:
    return f"rank{rank}.json"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


# -- files ------------------------------------------------------------------------------
def _digest(file: str) -> dict:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return {"size": os.path.getsize(file), "sha256": h.hexdigest()}


def _fsync(file: str) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_safetensors(file: str, tensors: dict) -> dict:
    """Write, fsync and return the size and sha256 of a safetensors file."""
    save_file(tensors, file, metadata={"format": "pt"})
    _fsync(file)
    return _digest(file)


def _write_json(file: str, obj) -> dict:
    with open(file, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return _digest(file)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        _fsync(path)


# -- what a model holds ---------------------------------------------------------------
@dataclass
class _ModelView:
    """The model's state_dict names, each either a trainable parameter (held by the
    optimizer's owned slices, under its first name) or replicated (buffers, frozen params).
    See [Note: trainable state comes from the optimizer]."""

    keys: list  # [state_dict key, "param" | "replicated", source name], in state_dict order
    replicated: dict  # source name -> tensor
    trainable: set  # names of trainable parameters as owned_slices names them

    def aliases(self) -> dict:
        """Trainable name -> every state_dict key that holds it (tied weights have several)."""
        out: dict = {}
        for key, kind, src in self.keys:
            if kind == "param":
                out.setdefault(src, []).append(key)
        return out


def _model_view(model: nn.Module) -> _ModelView:
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    seen: dict = {}
    keys, replicated = [], {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in trainable:
            keys.append([key, "param", trainable[id(t)]])
        elif id(t) in seen:  # a tied frozen parameter or shared buffer: stored once
            keys.append([key, "replicated", seen[id(t)]])
        else:
            seen[id(t)] = key
            keys.append([key, "replicated", key])
            replicated[key] = t
    return _ModelView(keys, replicated, set(trainable.values()))


def _json_safe(value):
    """A hyperparameter as JSON, or None when it has no JSON form (it is then not saved)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, float, str)):
        return value
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [_json_safe(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    return None


def _group_hyperparameters(optimizer) -> list:
    out = []
    for group in optimizer.inner.param_groups:
        out.append({k: _json_safe(v) for k, v in group.items()
                    if k != "params" and (_json_safe(v) is not None or v is None)})
    return out


def _restore_hyperparameters(optimizer, saved: list) -> None:
    for group, values in zip(optimizer.inner.param_groups, saved):
        for k, v in values.items():
            if k == "params" or k not in group:
                continue
            cur = group[k]
            if torch.is_tensor(cur):
                cur.fill_(v)
            elif isinstance(cur, tuple) and isinstance(v, list):
                group[k] = tuple(v)
            else:
                group[k] = v


# -- RNG ------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _from_b64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def _rng_state() -> dict:
    version, internal, gauss = random.getstate()
    state = {"torch": _b64(torch.get_rng_state()), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(_from_b64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_from_b64(s) for s in state["cuda"]])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# -- save -------------------------------------------------------------------------------
def _slices_to_write(optimizer) -> list:
    """This rank's share of the trainable state: stage 0 replicates it, so rank 0 alone writes."""
    if optimizer.config.stage == 0 and optimizer.comm.rank != 0:
        return []
    return [s for s in optimizer.owned_slices() if s.numel > 0]


def _shard_tensors(slices, full_precision: bool) -> dict:
    out = {}
    for s in slices:
        out[f"master/{s.name}/{s.start}"] = s.master.detach().cpu().contiguous()
        if not full_precision:
            out[f"param/{s.name}/{s.start}"] = s.param.detach().cpu().contiguous()
        for key, v in s.states.items():
            out[f"state/{key}/{s.name}/{s.start}"] = v.detach().cpu().contiguous()
    return out


def _raise_if_failed(statuses: list, what: str) -> None:
    errors: dict = {}
    for rank, st in enumerate(statuses):
        if st is not None and not st["ok"]:
            errors.setdefault(st["error"], []).append(rank)
    if errors:
        parts = [f"rank {', '.join(map(str, ranks))}: {err}" for err, ranks in errors.items()]
        raise CheckpointError(f"{what} failed on {sum(map(len, errors.values()))} of {len(statuses)} ranks; "
                              + " | ".join(parts))


def save(path: PathLike, model: nn.Module, optimizer, **extra) -> str:
    """Write a sharded checkpoint of `model` and `optimizer` to directory `path`, from every
    rank in parallel (each writes only what it owns); returns the absolute path.

    `extra` (JSON-serialisable, e.g. the data loader's position or an LR scheduler's
    state_dict) is taken from rank 0 and returned by `load`. Atomic: see [Note: atomic save].
    Saving to an existing checkpoint's path replaces it once the new one is complete.
    """
    comm, rank = optimizer.comm, optimizer.comm.rank
    path = os.path.abspath(os.fspath(path))
    # 1. Agree on the temporary directory and on which rank holds which element ranges.
    try:
        json.dumps(extra)
        slices = _slices_to_write(optimizer)
        local = {"ok": True, "tmp": f"{path}{TMP_TAG}{uuid.uuid4().hex[:12]}",
                 "pieces": [(s.name, s.start, s.numel, list(s.shape), s.group) for s in slices],
                 "state_keys": sorted({k for s in slices for k in s.states}),
                 "scalars": optimizer.scalar_states()}
    except Exception as e:  # noqa: BLE001 - reported through the exchange, so no rank waits forever
        local = {"ok": False, "error": _describe(e)}
    agreed = comm.all_gather_object(local, "checkpoint")
    _raise_if_failed(agreed, f"save of {path} (nothing was written)")
    tmp = agreed[0]["tmp"]
    # 2. Every rank writes its files; rank 0 also the metadata and the replicated state.
    try:
        os.makedirs(tmp, exist_ok=True)
        full_precision = optimizer.config.compute_dtype == torch.float32
        files = {_rank_file(rank): _write_safetensors(os.path.join(tmp, _rank_file(rank)),
                                                      _shard_tensors(slices, full_precision)),
                 _rank_json(rank): _write_json(os.path.join(tmp, _rank_json(rank)), {"rng": _rng_state()})}
        if rank == 0:
            view = _model_view(model)
            replicated = {k: t.detach().cpu().contiguous() for k, t in view.replicated.items()}
            files[REPLICATED] = _write_safetensors(os.path.join(tmp, REPLICATED), replicated)
            meta = _metadata(model, optimizer, view, agreed, extra)
            files[METADATA] = _write_json(os.path.join(tmp, METADATA), meta)
        status = {"ok": True, "files": files}
    except Exception as e:  # noqa: BLE001
        status = {"ok": False, "error": _describe(e)}
    statuses = comm.all_gather_object(status, "checkpoint")
    try:
        _raise_if_failed(statuses, f"save of {path} (the previous checkpoints are untouched)")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    # 3. Everyone finished: rank 0 writes COMPLETE and moves the directory into place.
    result = None
    if rank == 0:
        try:
            files = {name: d for st in statuses for name, d in st["files"].items()}
            _commit(tmp, path, files)
            result = {"ok": True}
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            result = {"ok": False, "error": _describe(e)}
    _raise_if_failed(comm.all_gather_object(result, "checkpoint")[:1], f"commit of {path}")
    log.info("rank %d: saved checkpoint %s (step %d)", rank, path, optimizer.step_count)
    return path


def _metadata(model, optimizer, view: _ModelView, agreed: list, extra: dict) -> dict:
    import zerodp

    cfg = optimizer.config
    params: dict = {}
    for r, st in enumerate(agreed):
        for name, start, numel, shape, group in st["pieces"]:
            p = params.setdefault(name, {"shape": shape, "dtype": _dtype_name(cfg.compute_dtype),
                                         "group": group, "pieces": []})
            p["pieces"].append([r, start, numel])
    for p in params.values():
        p["pieces"].sort(key=lambda piece: piece[1])
    scalars = [{} for _ in optimizer.inner.param_groups]
    for st in agreed:  # a rank may own nothing of a group; take the values where they exist
        for gi, values in enumerate(st["scalars"]):
            for k, v in values.items():
                scalars[gi].setdefault(k, _json_safe(v))
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "zerodp_version": zerodp.__version__, "torch_version": torch.__version__,
        "world_size": optimizer.comm.world_size, "stage": cfg.stage,
        "compute_dtype": _dtype_name(cfg.compute_dtype), "master_dtype": "float32",
        "config": cfg.to_dict(), "model": type(model).__name__, "optimizer": type(optimizer.inner).__name__,
        "param_groups": _group_hyperparameters(optimizer), "scalar_states": scalars,
        "state_keys": sorted({k for st in agreed for k in st["state_keys"]}),
        "step": optimizer.step_count, "loss_scaler": optimizer.scaler.state_dict(), "extra": extra,
        "params": params,
        "replicated": {k: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for k, t in view.replicated.items()},
        "state_dict_keys": view.keys,
    }


def _commit(tmp: str, path: str, files: dict) -> None:
    """Make the finished temporary directory the checkpoint at `path`.

    COMPLETE is written inside the private temporary directory first, so a failure there
    (a full disk) leaves the previous checkpoint at `path` in place and trusted. Only then
    is the previous one moved aside and the new one renamed into place; a save to the same
    path that wins the race in between is moved aside in turn, and the last rename wins."""
    side = os.path.join(tmp, COMPLETE + ".writing")
    _write_json(side, {"format": FORMAT, "files": files})
    os.replace(side, os.path.join(tmp, COMPLETE))
    _fsync_dir(tmp)
    if os.path.isdir(path) and not os.path.islink(path) and _exchange(tmp, path):
        # One atomic swap: `path` is never missing, not even for a reader in between.
        _fsync_dir(os.path.dirname(path))
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
    _fsync_dir(os.path.dirname(path))
    for old in displaced:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:  # a file or a link where the checkpoint was to go
            os.unlink(old)


def _exchange(a: str, b: str) -> bool:
    """Swap two directories atomically (Linux renameat2 with RENAME_EXCHANGE); False where
    the C library or the filesystem cannot, and the caller renames in two steps instead."""
    rename2 = _renameat2()
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
def _renameat2():
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


# -- reading a checkpoint -------------------------------------------------------------
def _open_checkpoint(path: PathLike) -> tuple[str, dict, dict]:
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
        raise CheckpointError(f"checkpoint {path}: {COMPLETE} is unreadable ({_describe(e)})") from e
    problems = []
    for name, d in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems.append(f"{name} is missing")
        elif os.path.getsize(file) != d["size"]:
            problems.append(f"{name} has {os.path.getsize(file)} bytes, {d['size']} were written (truncated?)")
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
    _verify(path, METADATA, files)
    with open(meta_file) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r} version "
                              f"{meta.get('format_version')!r}; this zerodp reads {FORMAT!r} version {FORMAT_VERSION}")
    return path, meta, files


def _verify(path: str, name: str, files: dict) -> None:
    if name not in files:
        raise CheckpointError(f"checkpoint {path}: {name} is not listed in {COMPLETE}")
    found = _digest(os.path.join(path, name))
    if found["sha256"] != files[name]["sha256"]:
        raise CheckpointError(f"checkpoint {path}: {name} is corrupt (sha256 {found['sha256'][:12]}..., "
                              f"{files[name]['sha256'][:12]}... was written)")


class _Reader(contextlib.ExitStack):
    """A checkpoint's safetensors files, each opened once, after its sha256 is checked."""

    def __init__(self, path: str, files: dict):
        super().__init__()
        self.path, self.files = path, files
        self._open: dict = {}

    def file(self, name: str):
        if name not in self._open:
            _verify(self.path, name, self.files)
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
            f = self.file(_rank_file(rank))
            try:
                out[lo - start: hi - start] = f.get_slice(key)[lo - p_start: hi - p_start]
            except Exception as e:
                raise CheckpointError(f"checkpoint {self.path}: {_rank_file(rank)} lacks {key} ({e})") from e
            covered += hi - lo
        if covered != numel:
            raise CheckpointError(f"checkpoint {self.path}: elements [{start}, {start + numel}) of {name} are "
                                  f"not all held by any rank file ({covered} of {numel} found)")
        return out


def _flat_range(f, key: str, shape: list, start: int, numel: int) -> torch.Tensor:
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


def _name_mismatch(path: str, what: str, expected: dict, found: dict) -> str | None:
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


# -- load -------------------------------------------------------------------------------
@dataclass
class _Loaded:
    """Everything a rank will write, read and checked before anything is written."""

    masters: list  # (slice, fp32 tensor)
    states: list  # (slice, key, tensor)
    replicated: dict  # source name -> tensor
    targets: dict  # source name -> the model's tensor it goes into
    rng: dict | None


def load(path: PathLike, model: nn.Module, optimizer) -> dict:
    """Restore a checkpoint written by `save` into `model` and `optimizer`; returns the
    `extra` given to save. Works across world sizes and stages (each rank reads only the
    element ranges it owns); with the same world size and stage the resume is bitwise.
    RNG states are restored only when the world size is unchanged. Raises a
    CheckpointError, on every rank and before changing anything, if the checkpoint is
    missing, incomplete, damaged or of another model (see [Note: validate, then write])."""
    comm = optimizer.comm
    loaded, meta = None, None
    try:
        path, meta, files = _open_checkpoint(path)
        view = _model_view(model)
        with _Reader(path, files) as reader:
            loaded = _read_for_rank(path, meta, files, reader, view, model, optimizer)
        local = {"ok": True}
    except Exception as e:  # noqa: BLE001 - see [Note: validate, then write]
        local = {"ok": False, "error": _describe(e)}
    _raise_if_failed(comm.all_gather_object(local, "checkpoint"), f"load of {path}")
    _apply(meta, loaded, optimizer)
    log.info("rank %d: loaded checkpoint %s (step %d, saved by %d ranks at stage %d)", comm.rank, path,
             meta["step"], meta["world_size"], meta["stage"])
    return meta["extra"]


def _read_for_rank(path, meta, files, reader: _Reader, view: _ModelView, model, optimizer) -> _Loaded:
    slices = optimizer.owned_slices()
    # The whole model, by name: trainable parameters and replicated state.
    expected = {n: None for n in view.trainable}
    expected.update({k: list(t.shape) for k, t in view.replicated.items()})
    found = {n: None for n in meta["params"]}
    found.update({k: v["shape"] for k, v in meta["replicated"].items()})
    # Trainable shapes from the owned slices; a parameter this rank owns nothing of is checked
    # by the ranks that own it, and the exchange makes every rank raise.
    for s in slices:
        expected[s.name] = list(s.shape)
        if s.name in meta["params"]:
            found[s.name] = meta["params"][s.name]["shape"]
    problem = _name_mismatch(path, "checkpoint", expected, found)
    if problem:
        raise CheckpointError(problem)
    if meta["optimizer"] != type(optimizer.inner).__name__:
        raise CheckpointError(f"checkpoint {path} holds {meta['optimizer']} state; the optimizer is "
                              f"{type(optimizer.inner).__name__}")
    if len(meta["param_groups"]) != len(optimizer.inner.param_groups):
        raise CheckpointError(f"checkpoint {path} has {len(meta['param_groups'])} param groups; the optimizer "
                              f"has {len(optimizer.inner.param_groups)}")
    moved = sorted({s.name for s in slices if meta["params"][s.name]["group"] != s.group})
    if moved:
        raise CheckpointError(f"checkpoint {path}: parameters {moved[:10]} are in another param group "
                              f"than in the checkpoint")
    have_states = {k for s in slices for k in s.states}
    if have_states and meta["state_keys"] and have_states != set(meta["state_keys"]):
        raise CheckpointError(f"checkpoint {path} holds optimizer states {meta['state_keys']}; the optimizer "
                              f"has {sorted(have_states)}")
    masters, states = [], []
    for s in slices:
        if s.numel == 0:
            continue
        pieces = meta["params"][s.name]["pieces"]
        masters.append((s, reader.read_range("master", s.name, pieces, s.start, s.numel, torch.float32)))
        for key in meta["state_keys"]:
            states.append((s, key, reader.read_range(f"state/{key}", s.name, pieces, s.start, s.numel,
                                                     torch.float32)))
    replicated = {}
    if view.replicated:
        f = reader.file(REPLICATED)
        replicated = {k: f.get_tensor(k) for k in view.replicated}
    rank = optimizer.comm.rank
    rng = None
    if meta["world_size"] == optimizer.comm.world_size:
        _verify(path, _rank_json(rank), files)
        with open(os.path.join(path, _rank_json(rank))) as fh:
            rng = json.load(fh)["rng"]
    return _Loaded(masters, states, replicated, view.replicated, rng)


@torch.no_grad()
def _apply(meta: dict, loaded: _Loaded, optimizer) -> None:
    """Write what `_read_for_rank` read: the only part of `load` that changes state."""
    _restore_hyperparameters(optimizer, meta["param_groups"])
    if meta["state_keys"]:
        optimizer.materialize_state()
    elif not any(meta["scalar_states"]):
        optimizer.clear_state()  # saved before the first step: no state yet
    for s, value in loaded.masters:
        s.master.copy_(value.to(s.master.device))
    # owned_slices() again: materialize_state may just have created the states.
    live = {(s.name, s.start): s for s in optimizer.owned_slices()}
    for s, key, value in loaded.states:
        target = live[(s.name, s.start)].states.get(key)
        if target is None:
            raise CheckpointError(f"the optimizer has no state {key!r} for {s.name}; the checkpoint has")
        target.copy_(value.to(target.device))
    optimizer.load_scalar_states(meta["scalar_states"])
    scaler = dict(meta["loss_scaler"])
    if not (optimizer.config.uses_loss_scaling and meta["config"]["mixed_precision"] == "fp16"):
        scaler["scale"] = optimizer.scaler.scale  # a loss scale only means something to fp16 runs
    optimizer.scaler.load_state_dict(scaler)
    optimizer.step_count = int(meta["step"])
    _write_replicated(loaded.replicated, loaded.targets)
    if loaded.rng is not None:
        _set_rng_state(loaded.rng)
    elif optimizer.comm.rank == 0:
        log.warning("checkpoint saved by %d ranks, loaded by %d: RNG states are not restored",
                    meta["world_size"], optimizer.comm.world_size)
    optimizer.sync_params_from_master("checkpoint")


def _write_replicated(values: dict, targets: dict) -> None:
    for k, v in values.items():
        t = targets[k]
        t.data.copy_(v.to(device=t.device, dtype=t.dtype))


# -- latest ------------------------------------------------------------------------------
def latest(directory: PathLike) -> str | None:
    """The newest complete checkpoint directly under `directory` (by the step recorded in
    its metadata, then by when it completed), or None. Directories without a COMPLETE
    marker (unfinished or crashed saves) are ignored; contents are verified by `load`."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    found = []
    for entry in os.scandir(directory):
        if not entry.is_dir() or TMP_TAG in entry.name or OLD_TAG in entry.name:
            continue
        marker = os.path.join(entry.path, COMPLETE)
        try:
            with open(os.path.join(entry.path, METADATA)) as f:
                step = int(json.load(f)["step"])
            done = os.path.getmtime(marker)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append((step, done, os.path.abspath(entry.path)))
    return max(found)[2] if found else None


# -- consolidate / export ------------------------------------------------------------------
