"""Sharded checkpoints: save, load (into any world size or stage), latest. The format is
format.py ([Note: checkpoint layout]); writes are atomic (files.py, [Note: atomic save]).

[Note: validate, then write]
`load` and `load_pretrained` check everything (marker, sizes and sha256 of the files a
rank reads, parameter names, shapes, groups, optimizer type, and every value the metadata
and the RNG states hold: [Note: a checkpoint is input] in schema.py), read what the rank owns
into memory, and agree across ranks that all of it worked, before they change a single
tensor. A bad checkpoint therefore raises on every rank and leaves the model, the
optimizer and the RNG as they were.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed.agreement import describe_trained, first_disagreement
from ..version import __version__
from . import files as fileio  # by module, so a test can fail its writes
from .format import (
    METADATA,
    REPLICATED,
    STAGING_TAG,
    TMP_TAG,
    CheckpointError,
    FORMAT,
    FORMAT_VERSION,
    ModelView,
    PathLike,
    describe_error,
    dtype_name,
    group_hyperparameters,
    json_safe,
    model_view,
    raise_if_failed,
    rank_file,
    refuse_tensor_parallel,
    rank_json,
    restore_hyperparameters,
    write_replicated,
)
from .reader import Reader, name_mismatch, open_checkpoint, read_rank_json
from .retention import OWNER, by_completion, owner_record, prune, remove_stale
from .rng import rng_state, set_rng_state
from .schema import check_hyperparameters

log = logging.getLogger(__name__)

__all__ = ["latest", "load", "save"]


def _slices_to_write(optimizer) -> list:
    """This rank's share of the trainable state: stage 0 replicates it, so rank 0 alone writes."""
    if optimizer.config.stage == 0 and optimizer.comm.rank != 0:
        return []
    if optimizer.comm.topology.replicate_rank != 0:  # hybrid sharding: row 0 writes, the others hold copies
        return []
    return [s for s in optimizer.owned_slices() if s.numel > 0]


def _shard_tensors(slices, full_precision: bool) -> dict:
    """This rank's pieces as CPU tensors; masters and optimizer states are read through
    their placement ([Note: master placement] in optim/master.py)."""
    out = {}
    for s in slices:
        out[f"master/{s.name}/{s.start}"] = s.read(s.master)
        if not full_precision:
            out[f"param/{s.name}/{s.start}"] = s.param.detach().cpu().contiguous()
        for key, v in s.states.items():
            out[f"state/{key}/{s.name}/{s.start}"] = s.read(v)
    return out


def save(path: PathLike, model: nn.Module, optimizer, *, keep_last: int | None = None, **extra) -> str:
    """Write a sharded checkpoint of `model` and `optimizer` to directory `path`, from every
    rank in parallel (each writes only what it owns); returns the absolute path. Every rank
    must call it.

    `extra` (JSON-serialisable, e.g. the data loader's position or an LR scheduler's
    state_dict) is taken from rank 0 and returned by `load`. Atomic: see [Note: atomic save].
    Saving to an existing checkpoint's path replaces it once the new one is complete. Once
    it is, leftovers of killed saves beside it are removed ([Note: stale leftovers] in
    retention.py), and with `keep_last` only that many newest complete checkpoints stay in
    its directory.
    """
    refuse_tensor_parallel(optimizer, "zerodp.save")
    comm, rank = optimizer.comm, optimizer.comm.rank
    path = os.path.abspath(os.fspath(path))
    # 1. Agree on the temporary directory and on which rank holds which element ranges.
    save_id = uuid.uuid4().hex[:12]
    staging = f"{path}{STAGING_TAG}{save_id}"
    try:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last={keep_last!r}: use a positive integer (or None to keep every checkpoint)")
        json.dumps(extra)
        fileio.refuse_to_replace(path)  # on every rank, before anything is written or deleted
        slices = _slices_to_write(optimizer)
        local = {"ok": True, "tmp": f"{path}{TMP_TAG}{save_id}",
                 "pieces": [(s.name, s.start, s.numel, list(s.shape), s.group) for s in slices],
                 "state_keys": sorted({k for s in slices for k in s.states}),
                 "scalars": optimizer.scalar_states()}
        if rank == 0:  # the directory gets its name only with its writer named: [Note: stale leftovers]
            os.makedirs(staging)
            fileio.write_json(os.path.join(staging, OWNER), owner_record())
            os.rename(staging, local["tmp"])
    except Exception as e:  # noqa: BLE001 - reported through the exchange, so no rank waits forever
        local = {"ok": False, "error": describe_error(e)}
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
    agreed = comm.all_gather_object(local, "checkpoint", label=f"save of {path}: plan")
    try:
        raise_if_failed(agreed, f"save of {path} (nothing was written)")
    except CheckpointError:
        if rank == 0 and local.get("tmp"):
            shutil.rmtree(local["tmp"], ignore_errors=True)
        raise
    tmp = agreed[0]["tmp"]
    # 2. Every rank writes its files; rank 0 also the metadata and the replicated state.
    try:
        os.makedirs(tmp, exist_ok=True)
        full_precision = optimizer.config.compute_dtype == torch.float32
        files = {rank_file(rank): fileio.write_safetensors(os.path.join(tmp, rank_file(rank)),
                                                      _shard_tensors(slices, full_precision)),
                 rank_json(rank): fileio.write_json(os.path.join(tmp, rank_json(rank)), {"rng": rng_state()})}
        if rank == 0:
            view = model_view(model)
            replicated = {k: t.detach().cpu().contiguous() for k, t in view.replicated.items()}
            files[REPLICATED] = fileio.write_safetensors(os.path.join(tmp, REPLICATED), replicated)
            meta = _metadata(model, optimizer, view, agreed, extra)
            files[METADATA] = fileio.write_json(os.path.join(tmp, METADATA), meta)
        status = {"ok": True, "files": files}
    except Exception as e:  # noqa: BLE001
        status = {"ok": False, "error": describe_error(e)}
    statuses = comm.all_gather_object(status, "checkpoint", label=f"save of {path}: files written")
    try:
        raise_if_failed(statuses, f"save of {path} (the previous checkpoints are untouched)")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    # 3. Everyone finished: rank 0 writes COMPLETE and moves the directory into place.
    result = None
    if rank == 0:
        try:
            files = {name: d for st in statuses for name, d in st["files"].items()}
            os.remove(os.path.join(tmp, OWNER))  # it names the writer of an unfinished save only
            fileio.commit(tmp, path, files)
            result = {"ok": True}
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            result = {"ok": False, "error": describe_error(e)}
    committed = comm.all_gather_object(result, "checkpoint", label=f"save of {path}: commit")
    raise_if_failed(committed[:1], f"commit of {path}")
    if rank == 0:
        _tidy(os.path.dirname(path), keep_last, path)
    log.info("rank %d: saved checkpoint %s (step %d)", rank, path, optimizer.step_count)
    return path


def _tidy(directory: str, keep_last: int | None, saved: str) -> None:
    """After a successful save: what the directory no longer needs goes. A failure here
    loses nothing and fails nothing; it is logged."""
    try:
        remove_stale(directory)
        if keep_last is not None:
            prune(directory, keep_last, keep=saved)
    except OSError as e:
        log.warning("checkpoint %s saved, but tidying %s failed: %s", saved, directory, e)


def _metadata(model, optimizer, view: ModelView, agreed: list, extra: dict) -> dict:
    cfg = optimizer.config
    params: dict = {}
    for r, st in enumerate(agreed):
        for name, start, numel, shape, group in st["pieces"]:
            p = params.setdefault(name, {"shape": shape, "dtype": dtype_name(cfg.compute_dtype),
                                         "group": group, "pieces": []})
            p["pieces"].append([r, start, numel])
    for p in params.values():
        p["pieces"].sort(key=lambda piece: piece[1])
    scalars = [{} for _ in optimizer.inner.param_groups]
    for st in agreed:  # a rank may own nothing of a group; take the values where they exist
        for gi, values in enumerate(st["scalars"]):
            for k, v in values.items():
                scalars[gi].setdefault(k, json_safe(v))
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "zerodp_version": __version__, "torch_version": torch.__version__,
        "world_size": optimizer.comm.world_size, "stage": cfg.stage,
        "compute_dtype": dtype_name(cfg.compute_dtype), "master_dtype": "float32",
        "config": cfg.to_dict(), "model": type(model).__name__, "optimizer": type(optimizer.inner).__name__,
        "param_groups": group_hyperparameters(optimizer), "scalar_states": scalars,
        "state_keys": sorted({k for st in agreed for k in st["state_keys"]}),
        "step": optimizer.step_count, "loss_scaler": optimizer.scaler.state_dict(), "extra": extra,
        "params": params,
        "replicated": {k: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for k, t in view.replicated.items()},
        "state_dict_keys": view.keys,
    }


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
    refuse_tensor_parallel(optimizer, "zerodp.load")
    comm = optimizer.comm
    loaded, meta = None, None
    try:
        path, meta, files = open_checkpoint(path)
        view = model_view(model)
        with Reader(path, files) as reader:
            loaded = _read_for_rank(path, meta, files, reader, view, model, optimizer)
        # Every rank must read the same checkpoint (a `latest()` racing a save on a shared
        # filesystem can differ per rank; the path itself may differ between mounts) into
        # the same model: compared before anything changes.
        described = {"checkpoint (sha256 of its metadata)": files[METADATA]["sha256"],
                     **describe_trained(model, optimizer)}
        local = {"ok": True, "described": described}
    except Exception as e:  # noqa: BLE001 - see [Note: validate, then write]
        local = {"ok": False, "error": describe_error(e), "described": {}}
    everyone = comm.all_gather_object(local, "checkpoint", label=f"load of {path}")
    raise_if_failed(everyone, f"load of {path}")
    differs = first_disagreement([r["described"] for r in everyone])
    if differs:
        raise CheckpointError(f"rank {comm.rank}: load of {path} refused, nothing was changed: the ranks disagree "
                              f"on the {differs}; every rank must load into the same model, optimizer and Config")
    _apply(meta, loaded, optimizer)
    log.info("rank %d: loaded checkpoint %s (step %d, saved by %d ranks at stage %d)", comm.rank, path,
             meta["step"], meta["world_size"], meta["stage"])
    return meta["extra"]


def _read_for_rank(path, meta, files, reader: Reader, view: ModelView, model, optimizer) -> _Loaded:
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
    problem = name_mismatch(path, "checkpoint", expected, found)
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
    check_hyperparameters(path, meta["param_groups"], optimizer.inner.param_groups)
    masters, states = [], []
    for s in slices:
        if s.numel == 0:
            continue
        pieces = meta["params"][s.name]["pieces"]
        masters.append((s, reader.read_range("master", s.name, pieces, s.start, s.numel, torch.float32)))
        for key in meta["state_keys"]:
            states.append((s, key, reader.read_range(f"state/{key}", s.name, pieces, s.start, s.numel,
                                                     torch.float32)))
    # Shapes from the file itself, against the model's: copy_ would broadcast a [1] silently.
    replicated = {}
    for k, t in view.replicated.items():
        reader.tensor_slice(REPLICATED, k, list(t.shape))
        replicated[k] = reader.file(REPLICATED).get_tensor(k)
    rank = optimizer.comm.rank
    rng = None
    if meta["world_size"] == optimizer.comm.world_size:
        rng = read_rank_json(path, rank_json(rank), files)
    return _Loaded(masters, states, replicated, view.replicated, rng)


@torch.no_grad()
def _apply(meta: dict, loaded: _Loaded, optimizer) -> None:
    """Write what `_read_for_rank` read: the only part of `load` that changes state."""
    restore_hyperparameters(optimizer, meta["param_groups"])
    if meta["state_keys"]:
        optimizer.materialize_state()
    elif not any(meta["scalar_states"]):
        optimizer.clear_state()  # saved before the first step: no state yet
    for s, value in loaded.masters:
        s.write(s.master, value)
    # owned_slices() again: materialize_state may just have created the states.
    live = {(s.name, s.start): s for s in optimizer.owned_slices()}
    for s, key, value in loaded.states:
        s = live[(s.name, s.start)]
        target = s.states.get(key)
        if target is None:
            raise CheckpointError(f"the optimizer has no state {key!r} for {s.name}; the checkpoint has")
        s.write(target, value)
    optimizer.load_scalar_states(meta["scalar_states"])
    scaler = dict(meta["loss_scaler"])
    if not (optimizer.config.uses_loss_scaling and meta["config"]["mixed_precision"] == "fp16"):
        scaler["scale"] = optimizer.scaler.scale  # a loss scale only means something to fp16 runs
    optimizer.scaler.load_state_dict(scaler)
    optimizer.step_count = int(meta["step"])
    write_replicated(loaded.replicated, loaded.targets)
    if loaded.rng is not None:
        set_rng_state(loaded.rng)
    elif optimizer.comm.rank == 0:
        log.warning("checkpoint saved by %d ranks, loaded by %d: RNG states are not restored",
                    meta["world_size"], optimizer.comm.world_size)
    optimizer.sync_params_from_master("checkpoint")


def latest(directory: PathLike) -> str | None:
    """The most recently completed checkpoint directly under `directory`, or None: the
    order `keep_last` prunes in ([Note: checkpoint order] in retention.py). Directories
    without a COMPLETE marker (unfinished or crashed saves) are ignored; contents are
    verified by `load`."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    found = by_completion(directory)
    return os.path.abspath(found[0]) if found else None
