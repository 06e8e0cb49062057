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

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..distributed.agreement import describe_trained
from . import background, saving
from .files import read_marker
from .format import (
    METADATA,
    REPLICATED,
    CheckpointError,
    ModelView,
    PathLike,
    frozen_runs,
    model_view,
    plain_module,
    rank_json,
    read_on_every_rank,
    restore_hyperparameters,
    write_replicated,
)
from .reader import Reader, flat_range, name_mismatch, open_checkpoint, read_rank_json
from .retention import by_completion
from .rng import set_rng_state
from .schema import check_hyperparameters, saved_states
from .tp_pieces import local_runs, ranks_of, split_rank, splits_of

log = logging.getLogger(__name__)

__all__ = ["latest", "load", "save"]


def save(path: PathLike, model: nn.Module, optimizer, *, keep_last: int | None = None,
         asynchronous: bool = False, **extra):
    """Write a sharded checkpoint of `model` and `optimizer` to directory `path`, from every
    rank in parallel (each writes only what it owns); returns the absolute path. Every rank
    must call it.

    `extra` (JSON-serialisable, e.g. the data loader's position or an LR scheduler's
    state_dict) is taken from rank 0 and returned by `load`. Atomic: see [Note: atomic save].
    Saving to an existing checkpoint's path replaces it once the new one is complete. Once
    it is, leftovers of killed saves beside it are removed ([Note: stale leftovers] in
    retention.py), and with `keep_last` only that many newest complete checkpoints stay in
    its directory.

    `asynchronous=True` returns an `AsyncSave` as soon as the rank's state is copied into
    host staging memory; the files are written, agreed on and committed in the background
    while training goes on ([Note: asynchronous save] in background.py). Every save and
    load first waits for the one in flight and raises its failure.
    """
    model = plain_module(model)  # a torch.compile'd model saves and loads as the module it wraps
    background.wait_in_flight(optimizer)
    path = os.path.abspath(os.fsdecode(os.fspath(path)))
    agreed = saving.plan(path, model, optimizer, keep_last, extra, asynchronous)
    if asynchronous:
        snap = saving.take_snapshot(model, optimizer, agreed, extra, stage=background.staging(optimizer).stage)
        return background.start(optimizer, path, agreed.tmp, snap, keep_last)
    snap = saving.take_snapshot(model, optimizer, agreed, extra)
    ranks = ranks_of(optimizer)
    saving.finish(ranks, path, agreed.tmp, saving.write_status(agreed.tmp, snap), keep_last)
    log.info("rank %d: saved checkpoint %s (step %d)", ranks.rank, path, optimizer.step_count)
    return path


@dataclass
class _Loaded:
    """Everything a rank will write, read and checked before anything is written."""

    masters: list  # (slice, fp32 tensor)
    states: list  # (slice, key, tensor)
    replicated: dict  # source name -> tensor
    targets: dict  # source name -> the model's tensor it goes into
    rng: dict | None
    frozen: list  # (FrozenSlice, tensor): stage 3's frozen parameters


def load(path: PathLike, model: nn.Module, optimizer) -> dict:
    """Restore a checkpoint written by `save` into `model` and `optimizer`; returns the
    `extra` given to save. Works across world sizes and stages (each rank reads only the
    element ranges it owns); with the same world size and stage the resume is bitwise.
    RNG states are restored only when the world size is unchanged. Raises a
    CheckpointError, on every rank and before changing anything, if the checkpoint is
    missing, incomplete, damaged or of another model (see [Note: validate, then write])."""
    model = plain_module(model)  # a torch.compile'd model saves and loads as the module it wraps
    background.wait_in_flight(optimizer)
    comm = ranks_of(optimizer)

    def read():
        opened, meta, files = open_checkpoint(path)
        view = model_view(model, optimizer)
        with Reader(opened, files) as reader:
            loaded = _read_for_rank(opened, meta, files, reader, view, model, optimizer)
        # Every rank must read the same checkpoint (a `latest()` racing a save on a shared
        # filesystem can differ per rank; the path itself may differ between mounts) into
        # the same model: compared before anything changes.
        return (opened, meta, loaded), {"checkpoint (sha256 of its metadata)": files[METADATA]["sha256"],
                                        **describe_trained(model, optimizer)}

    path, meta, loaded = read_on_every_rank(comm, read, f"load of {path}",
                                            "every rank must load into the same model, optimizer and Config")
    _apply(meta, loaded, optimizer)
    log.info("rank %d: loaded checkpoint %s (step %d, saved by %d ranks at stage %d)", comm.rank, path,
             meta["step"], meta["world_size"], meta["stage"])
    return meta["extra"]


def _read_for_rank(path, meta, files, reader: Reader, view: ModelView, model, optimizer) -> _Loaded:
    slices = optimizer.owned_slices()
    # The whole model, by name: trainable parameters and replicated state.
    expected = {n: None for n in view.trainable}
    expected.update({k: list(t.shape) for k, t in view.replicated.items()})
    expected.update(view.frozen)  # frozen parameters, sharded (stage 3) or replicated, load into either form
    found = {n: None for n in meta["params"]}
    found.update({k: v["shape"] for k, v in [*meta["replicated"].items(), *meta["frozen"].items()]})
    # Trainable shapes from the owned slices; a parameter this rank owns nothing of is checked
    # by the ranks that own it, and the exchange makes every rank raise.
    splits = splits_of(optimizer)
    for s in slices:
        expected[s.name] = list(s.shape) if s.name not in splits else splits[s.name].global_shape(s.shape)
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
    # Per parameter: they differ between param groups and optimizers (Muon beside AdamW).
    # A slice without states yet gets them from the load ([Note: validate, then write]).
    if meta["state_keys"]:
        differ = {s.name: sorted(s.states) for s in slices
                  if s.states and set(s.states) != set(saved_states(meta, s.name))}
        if differ:
            name = min(differ)
            more = f" (and {len(differ) - 1} more parameters)" if len(differ) > 1 else ""
            raise CheckpointError(f"checkpoint {path} holds optimizer states {saved_states(meta, name)} for {name}; "
                                  f"the optimizer has {differ[name]}{more}: load into an optimizer built with the "
                                  f"same param groups and hyperparameters as the saved one")
    check_hyperparameters(path, meta["param_groups"], optimizer.inner.param_groups)
    splits = splits_of(optimizer)
    masters, states = [], []
    for s in slices:
        if s.numel == 0:
            continue
        info = meta["params"][s.name]
        # By the original parameter's coordinates: [Note: tensor-parallel pieces].
        want = local_runs(info["shape"], splits.get(s.name), split_rank(optimizer, s.name), s.start, s.numel)
        masters.append((s, reader.read_runs("master", s.name, info, want, s.numel, torch.float32)))
        for key in saved_states(meta, s.name):
            states.append((s, key, reader.read_runs(f"state/{key}", s.name, info, want, s.numel, torch.float32)))
    # Shapes from the file itself, against the model's: copy_ would broadcast a [1] silently.
    replicated = {}
    for k, t in view.replicated.items():
        if k in meta["frozen"]:  # held as runs by the save (stage 3, or split by tensor parallelism)
            info = meta["frozen"][k]
            replicated[k] = reader.read_runs("frozen", k, info, [(0, 0, t.numel())] if t.numel() else [], t.numel(),
                                             getattr(torch, info["dtype"])).view(t.shape)
            continue
        reader.tensor_slice(REPLICATED, k, list(t.shape))
        replicated[k] = reader.file(REPLICATED).get_tensor(k)
    frozen = []
    for s in frozen_runs(model, optimizer):
        want = local_runs(view.frozen[s.name], splits.get(s.name), split_rank(optimizer, s.name), s.start,
                          s.numel)
        if s.name in meta["frozen"]:
            info = meta["frozen"][s.name]
            frozen.append((s, reader.read_runs("frozen", s.name, info, want, s.numel, getattr(torch, info["dtype"]))))
        else:  # replicated whole by a save at stages 0-2 without its split
            shape = view.frozen[s.name]
            reader.tensor_slice(REPLICATED, s.name, shape)
            f = reader.file(REPLICATED)
            # One read of the rows that hold every run (a split along dim 1 has a run per row).
            lo = min((g for g, _, _ in want), default=0)
            hi = max((g + n for g, _, n in want), default=0)
            block = flat_range(f, s.name, shape, lo, hi - lo)
            frozen.append((s, torch.cat([block[g - lo: g - lo + n] for g, _, n in want]) if want
                           else torch.empty(0)))
    ranks = ranks_of(optimizer)
    rng = None
    # A rank's random state is its place's: the same world split the same way.
    same_tp = meta.get("tensor_parallel_size", 1) == optimizer.comm.topology.tp_size
    if meta["world_size"] == ranks.world_size and same_tp:
        rng = read_rank_json(path, rank_json(ranks.rank), files)
    return _Loaded(masters, states, replicated, view.replicated, rng, frozen)


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
    missing = sorted({(s.name, key) for s, key, _ in loaded.states if key not in live[(s.name, s.start)].states})
    if missing:
        raise CheckpointError(f"the optimizer has no state {missing[0][1]!r} for {missing[0][0]} "
                              f"({len(missing)} in all); the checkpoint has")
    for s, key, value in loaded.states:
        s = live[(s.name, s.start)]
        s.write(s.states[key], value)
    optimizer.load_scalar_states(meta["scalar_states"])
    scaler = dict(meta["loss_scaler"])
    if not (optimizer.config.uses_loss_scaling and meta["config"]["mixed_precision"] == "fp16"):
        scaler["scale"] = optimizer.scaler.scale  # a loss scale only means something to fp16 runs
    optimizer.scaler.load_state_dict(scaler)
    optimizer.step_count = int(meta["step"])
    write_replicated(loaded.replicated, loaded.targets)
    for s, value in loaded.frozen:
        s.write(value)
    if loaded.rng is not None:
        set_rng_state(loaded.rng)
    elif ranks_of(optimizer).rank == 0:
        log.warning("checkpoint saved by %d ranks (tensor-parallel size %d), loaded by %d (%d): RNG states are not "
                    "restored", meta["world_size"], meta.get("tensor_parallel_size", 1), ranks_of(optimizer).world_size,
                    optimizer.comm.topology.tp_size)
    optimizer.sync_params_from_master("checkpoint")


def latest(directory: PathLike) -> str | None:
    """The most recently completed checkpoint directly under `directory`, or None: the
    order `keep_last` prunes in ([Note: checkpoint order] in retention.py). Directories
    without a COMPLETE marker (unfinished or crashed saves) are ignored; contents are
    verified by `load`."""
    directory = os.fsdecode(os.fspath(directory))
    if not os.path.isdir(directory):
        return None
    for path in by_completion(directory):
        # keep_last may have pruned it since the listing (another job's save beside this
        # one): the newest still there is the answer.
        if read_marker(path) is not None:
            return os.path.abspath(path)
        log.info("checkpoint %s was removed since %s was listed (keep_last pruning?); trying the next newest",
                 path, directory)
    return None
