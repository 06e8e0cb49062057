"""The steps of a save ([Note: atomic save] in files.py), each a function, so that the
synchronous `save` runs them in a row and an asynchronous one runs the last two on a thread
([Note: asynchronous save] in background.py):

1. `plan`: the ranks agree on the temporary directory and on which rank holds which element
   ranges (one object gather on the training process group).
2. `take_snapshot`: everything the files will hold, taken now: the rank's pieces (fresh
   copies, or copies into reused staging buffers), rank 0's replicated tensors and
   metadata, the RNG states. After it, training may change the model and optimizer.
3. `write_files`: the rank's files, written and fsynced, with their sizes and sha256.
4. `finish`: the ranks agree that every rank's files are complete; rank 0 commits (COMPLETE,
   the rename into place) and tidies the directory.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..distributed.agreement import first_disagreement
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
    describe_error,
    dtype_name,
    frozen_runs,
    group_hyperparameters,
    json_safe,
    model_view,
    raise_if_failed,
    rank_file,
    rank_json,
)
from .retention import OWNER, owner_record, prune, remove_stale
from .rng import rng_state
from .tp_pieces import ranks_of, split_info, split_rank, splits_of

log = logging.getLogger(__name__)

__all__ = ["Plan", "Snapshot", "finish", "plan", "take_snapshot", "write_files"]


def _slices_to_write(model, optimizer) -> tuple[list, list]:
    """This rank's share of the trainable state and of the frozen parameters held as runs:
    stage 0 replicates the former, so (data) rank 0 alone writes it; under tensor
    parallelism a parameter left unsplit is the same on every tensor-parallel rank, so
    tensor-parallel rank 0 alone writes it ([Note: tensor-parallel pieces]); a split frozen
    parameter at stages 0-2 is whole on every data rank, so data rank 0 writes it."""
    if optimizer.comm.topology.replicate_rank != 0:  # hybrid sharding: row 0 writes, the others hold copies
        return [], []
    splits, tp_rank = splits_of(optimizer), optimizer.comm.topology.tp_rank
    sharded = optimizer.stage3 is not None
    # A frozen expert bank at stages 0-2 is whole on the ranks that hold its experts: the
    # first expert-parallel group's ranks write theirs.
    banks = getattr(getattr(optimizer, "expert_parallel", None), "splits", {})
    frozen = [s for s in frozen_runs(model, optimizer) if s.numel > 0 and (tp_rank == 0 or s.name in splits)
              and (sharded or optimizer.comm.rank == 0 or (s.name in banks
                                                           and optimizer.comm.rank < optimizer.comm.topology.ep_size))]
    if optimizer.config.stage == 0 and optimizer.comm.rank != 0:
        return [], frozen
    return [s for s in optimizer.owned_slices() if s.numel > 0 and (tp_rank == 0 or s.name in splits)], frozen


def _piece(s, splits: dict, tp_rank: int, kind, states=()) -> tuple:
    """One owned slice (or frozen run) as the plan exchanges it: its original shape, `kind`
    (a trainable slice's param group, a frozen run's dtype), for a split parameter the
    split and the tensor-parallel rank whose slice `start` counts in, and the names of its
    optimizer states."""
    split = splits.get(s.name)
    shape = list(s.shape) if split is None else split.global_shape(s.shape)
    return (s.name, s.start, s.numel, shape, kind, split_info(split), tp_rank, sorted(states))


def states_by_parameter(agreed: list) -> dict:
    """Each trainable parameter's optimizer state names, from every rank's plan entry.

    They differ between parameters: Muon's momentum beside AdamW's moments in the Muon
    recipe, SGD's momentum buffer only where a group's momentum is not 0, AdamW's
    max_exp_avg_sq only in an amsgrad group. The checkpoint records one set per parameter,
    so every piece of a parameter must have it; raised on every rank alike (the entries are
    the same everywhere)."""
    out: dict = {}
    for r, st in enumerate(agreed):
        for name, start, *_, states in st["pieces"]:
            first = out.setdefault(name, (states, r, start))
            if first[0] != states:
                raise CheckpointError(
                    f"parameter {name} has optimizer states {first[0]} in the piece rank {first[1]} owns from "
                    f"element {first[2]} and {states} in the piece rank {r} owns from element {start}: the optimizer "
                    f"created states for part of it only, and a zerodp checkpoint holds one set of states per "
                    f"parameter; save after a step that updated every element of it")
    return {name: states for name, (states, _, _) in out.items()}


def _check_path(path: str) -> None:
    """A checkpoint path safetensors can open. Its reader (Rust) takes UTF-8 paths only, so
    a directory name that is not (a bytes name such as b'ckpt\\xff') would be written and
    then refused by every load and `consolidate`, and by any other safetensors tool: the
    save is refused instead, before anything is written."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointError(f"checkpoint path {path!r} is not valid UTF-8: safetensors, which zerodp writes and "
                              f"reads checkpoints with, opens only UTF-8 paths, so the checkpoint could not be "
                              f"loaded; save under a UTF-8 name") from None


@dataclass
class Plan:
    """What the ranks agreed on before writing."""

    path: str
    tmp: str
    slices: list  # this rank's OwnedSlices to write
    agreed: list  # every rank's plan entry: pieces, state keys, scalar states
    frozen: list = field(default_factory=list)  # this rank's FrozenSlices to write (stage 3)
    states: dict = field(default_factory=dict)  # trainable parameter -> its optimizer state names


def plan(path: str, model, optimizer, keep_last: Optional[int], extra: dict, asynchronous: bool = False) -> Plan:
    """Step 1: check the arguments and `path` on every rank, make the temporary directory
    (rank 0) and exchange who writes what. Raises the same CheckpointError on every rank."""
    comm = ranks_of(optimizer)
    rank = comm.rank
    save_id = uuid.uuid4().hex[:12]
    staging = f"{path}{STAGING_TAG}{save_id}"
    slices: list = []
    frozen: list = []
    # Arguments whose value decides which collectives follow (an asynchronous save agrees on
    # its own channel, keep_last prunes after the commit), so that ranks that differ would
    # wait on each other until the store times out, or rank 0's would silently win.
    arguments = {"asynchronous": asynchronous, "keep_last": keep_last}
    try:
        _check_path(path)
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last={keep_last!r}: use a positive integer (or None to keep every checkpoint)")
        json.dumps(extra)
        fileio.refuse_to_replace(path)  # on every rank, before anything is written or deleted
        slices, frozen = _slices_to_write(model, optimizer)
        splits = splits_of(optimizer)
        local = {"ok": True, "tmp": f"{path}{TMP_TAG}{save_id}", "arguments": arguments,
                 "pieces": [_piece(s, splits, split_rank(optimizer, s.name), s.group, s.states) for s in slices],
                 "frozen": [_piece(s, splits, split_rank(optimizer, s.name), dtype_name(s.dtype)) for s in frozen],
                 "state_keys": sorted({k for s in slices for k in s.states}),
                 "scalars": optimizer.scalar_states()}
        if rank == 0:  # the directory gets its name only with its writer named: [Note: stale leftovers]
            os.makedirs(staging)
            fileio.write_json(os.path.join(staging, OWNER), owner_record())
            os.rename(staging, local["tmp"])
    except Exception as e:  # noqa: BLE001 - reported through the exchange, so no rank waits forever
        local = {"ok": False, "error": describe_error(e), "arguments": arguments}
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
    agreed = comm.all_gather_object(local, "checkpoint", label=f"save of {path}: plan")
    try:
        differs = first_disagreement([st["arguments"] for st in agreed])
        if differs:
            raise CheckpointError(f"rank {rank}: save of {path} refused, nothing was written: the ranks disagree on "
                                  f"zerodp.save's argument {differs}; every rank must call zerodp.save with the "
                                  f"same keep_last and asynchronous")
        raise_if_failed(agreed, f"save of {path} (nothing was written)")
        states = states_by_parameter(agreed)
    except CheckpointError:
        if rank == 0 and local.get("tmp"):
            shutil.rmtree(local["tmp"], ignore_errors=True)
        raise
    return Plan(path, agreed[0]["tmp"], slices, agreed, frozen, states)


@dataclass
class Snapshot:
    """What one rank's files will hold, independent of the live model and optimizer."""

    rank: int
    step: int
    tensors: dict  # rank{r}.safetensors: master/..., param/..., state/... (CPU)
    rng: dict
    replicated: Optional[dict]  # rank 0: replicated.safetensors
    metadata: Optional[dict]  # rank 0: metadata.json
    # Under tensor parallelism, rank{r}.json's record of the slices rank{r}.safetensors holds:
    # [Note: tensor-parallel pieces] in tp_pieces.py.
    tensor_parallel: Optional[dict] = None

    @property
    def nbytes(self) -> int:
        held = list(self.tensors.values()) + list((self.replicated or {}).values())
        return sum(t.numel() * t.element_size() for t in held)


def shard_sources(slices, full_precision: bool, frozen=()) -> dict:
    """This rank's pieces by their name in the rank file: the live tensors (masters and
    states wherever their placement keeps them), to be copied, never written as they are."""
    out = {f"frozen/{s.name}/{s.start}": s.value for s in frozen}
    for s in slices:
        out[f"master/{s.name}/{s.start}"] = s.master
        if not full_precision:
            out[f"param/{s.name}/{s.start}"] = s.param.detach()
        for key, v in s.states.items():
            out[f"state/{key}/{s.name}/{s.start}"] = v
    return out


def _fresh_copies(slices, full_precision: bool, frozen=()) -> dict:
    """This rank's pieces as CPU tensors; masters and optimizer states are read through
    their placement ([Note: master placement] in optim/master.py)."""
    out = {f"frozen/{s.name}/{s.start}": s.read() for s in frozen}
    for s in slices:
        out[f"master/{s.name}/{s.start}"] = s.read(s.master)
        if not full_precision:
            out[f"param/{s.name}/{s.start}"] = s.param.detach().cpu().contiguous()
        for key, v in s.states.items():
            out[f"state/{key}/{s.name}/{s.start}"] = s.read(v)
    return out


def take_snapshot(model, optimizer, agreed: Plan, extra: dict, stage: Optional[Callable] = None) -> Snapshot:
    """Step 2. `stage(tensors) -> tensors` copies the live tensors into buffers the caller
    keeps (an asynchronous save's staging); without it, each is copied fresh."""
    rank = ranks_of(optimizer).rank
    full_precision = optimizer.config.compute_dtype == torch.float32
    replicated = meta = None
    view = model_view(model, optimizer) if rank == 0 else None
    if stage is None:
        tensors = _fresh_copies(agreed.slices, full_precision, agreed.frozen)
        if rank == 0:
            replicated = {k: t.detach().cpu().contiguous() for k, t in view.replicated.items()}
    else:
        sources = shard_sources(agreed.slices, full_precision, agreed.frozen)
        if rank == 0:
            sources.update({(REPLICATED, k): t.detach() for k, t in view.replicated.items()})
        staged = stage(sources)
        tensors = {k: v for k, v in staged.items() if not isinstance(k, tuple)}
        if rank == 0:
            replicated = {k[1]: v for k, v in staged.items() if isinstance(k, tuple)}
    if rank == 0:
        # A JSON copy: the caller's `extra` (a scheduler's state_dict) may change once save returns.
        meta = json.loads(json.dumps(_metadata(model, optimizer, view, agreed, extra)))
    return Snapshot(rank, optimizer.step_count, tensors, rng_state(), replicated, meta,
                    rank_record(optimizer, agreed.slices, agreed.frozen))


def write_files(tmp: str, snap: Snapshot) -> dict:
    """Step 3: this rank's files in `tmp`, fsynced; returns {name: {size, sha256}}."""
    os.makedirs(tmp, exist_ok=True)
    r = snap.rank
    record = {"rng": snap.rng, **({} if snap.tensor_parallel is None else {"tensor_parallel": snap.tensor_parallel})}
    files = {rank_file(r): fileio.write_safetensors(os.path.join(tmp, rank_file(r)), snap.tensors),
             rank_json(r): fileio.write_json(os.path.join(tmp, rank_json(r)), record)}
    if snap.replicated is not None:
        files[REPLICATED] = fileio.write_safetensors(os.path.join(tmp, REPLICATED), snap.replicated)
    if snap.metadata is not None:
        files[METADATA] = fileio.write_json(os.path.join(tmp, METADATA), snap.metadata)
    return files


def write_status(tmp: str, snap: Snapshot) -> dict:
    """`write_files` as the status the ranks exchange: its files, or its error."""
    try:
        return {"ok": True, "files": write_files(tmp, snap)}
    except Exception as e:  # noqa: BLE001 - reported through the exchange, so no rank waits forever
        return {"ok": False, "error": describe_error(e)}


def finish(comm, path: str, tmp: str, status: dict, keep_last: Optional[int]) -> str:
    """Step 4, on every rank with `comm` (the training process group's, or the checkpoint
    channel of an asynchronous save): agree that every rank's files are complete; rank 0
    then writes COMPLETE and moves the directory into place; every rank learns the outcome."""
    rank = comm.rank
    statuses = comm.all_gather_object(status, "checkpoint", label=f"save of {path}: files written")
    try:
        raise_if_failed(statuses, f"save of {path} (the previous checkpoints are untouched)")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    result = None
    if rank == 0:
        try:
            files = {name: d for st in statuses for name, d in st["files"].items()}
            fileio.commit(tmp, path, files)
            # OWNER names the writer of an unfinished save only; it goes once the checkpoint has
            # its name, so that a kill during the commit leaves a `.tmp-` whose writer is named.
            try:
                os.remove(os.path.join(path, OWNER))
            except FileNotFoundError:
                pass
            except OSError as e:  # the checkpoint is complete and trusted: a stray OWNER harms nothing
                log.warning("checkpoint %s saved, but removing its %s file failed: %s", path, OWNER, e)
            result = {"ok": True}
        except Exception as e:  # noqa: BLE001
            shutil.rmtree(tmp, ignore_errors=True)
            result = {"ok": False, "error": describe_error(e)}
    committed = comm.all_gather_object(result, "checkpoint", label=f"save of {path}: commit")
    raise_if_failed(committed[:1], f"commit of {path}")
    if rank == 0:
        _tidy(os.path.dirname(path), keep_last, path)
    return path


def _tidy(directory: str, keep_last: Optional[int], saved: str) -> None:
    """After a successful save: what the directory no longer needs goes. A failure here
    loses nothing and fails nothing; it is logged."""
    try:
        remove_stale(directory)
        if keep_last is not None:
            prune(directory, keep_last, keep=saved)
    except Exception as e:  # noqa: BLE001 - rank 0 tidies alone: raising would fail the committed save on it only
        log.warning("checkpoint %s saved, but tidying %s failed: %s: %s", saved, directory, type(e).__name__, e)


def rank_record(optimizer, slices: list, frozen: list) -> Optional[dict]:
    """Under tensor parallelism, what rank{r}.json records of this rank's pieces: its
    tensor-parallel rank and the split of each split parameter it writes, so that a reader
    can check metadata.json's splits and pieces against what each rank wrote
    ([Note: tensor-parallel pieces] in tp_pieces.py)."""
    topology = optimizer.comm.topology
    if topology.tp_size == 1 and topology.ep_size == 1:
        return None
    splits = splits_of(optimizer)
    ep = {"expert_parallel": {"rank": topology.ep_rank, "size": topology.ep_size}} if topology.ep_size > 1 else {}
    return {"rank": topology.tp_rank, "size": topology.tp_size, **ep,
            "splits": {s.name: split_info(splits[s.name]) for s in [*slices, *frozen] if s.name in splits}}


def _metadata(model, optimizer, view: ModelView, plan: Plan, extra: dict) -> dict:
    cfg = optimizer.config
    agreed = plan.agreed
    params: dict = {}
    state_keys = sorted({k for st in agreed for k in st["state_keys"]})
    for r, st in enumerate(agreed):
        for name, start, numel, shape, group, split, tp_rank, _ in st["pieces"]:
            p = params.setdefault(name, {"shape": shape, "dtype": dtype_name(cfg.compute_dtype),
                                         "group": group, "pieces": []})
            if plan.states[name] != state_keys:  # only where they differ: [Note: checkpoint layout]
                p["states"] = plan.states[name]
            if split is None:
                p["pieces"].append([r, start, numel])
            else:  # [Note: tensor-parallel pieces]
                p["split"] = split
                p["pieces"].append([r, start, numel, tp_rank])
    frozen: dict = {}
    for r, st in enumerate(agreed):
        for name, start, numel, shape, dtype, split, tp_rank, _ in st["frozen"]:
            p = frozen.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": []})
            if split is None:
                p["pieces"].append([r, start, numel])
            else:
                p["split"] = split
                p["pieces"].append([r, start, numel, tp_rank])
    for p in [*params.values(), *frozen.values()]:
        p["pieces"].sort(key=lambda piece: (piece[3:], piece[1]))
    scalars = [{} for _ in optimizer.inner.param_groups]
    for st in agreed:  # a rank may own nothing of a group; take the values where they exist
        for gi, values in enumerate(st["scalars"]):
            for k, v in values.items():
                scalars[gi].setdefault(k, json_safe(v))
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "zerodp_version": __version__, "torch_version": torch.__version__,
        "world_size": ranks_of(optimizer).world_size, "stage": cfg.stage,
        "compute_dtype": dtype_name(cfg.compute_dtype), "master_dtype": "float32",
        "config": cfg.to_dict(), "model": type(model).__name__, "optimizer": type(optimizer.inner).__name__,
        "param_groups": group_hyperparameters(optimizer), "scalar_states": scalars,
        "state_keys": state_keys,
        "step": optimizer.step_count, "loss_scaler": optimizer.scaler.state_dict(), "extra": extra,
        "params": params, "frozen": frozen,
        "replicated": {k: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for k, t in view.replicated.items()},
        "state_dict_keys": view.keys,
        # Only under tensor parallelism, so a checkpoint without stays what it always was.
        **({"tensor_parallel_size": optimizer.comm.topology.tp_size} if optimizer.comm.topology.tp_size > 1 else {}),
        **({"expert_parallel_size": optimizer.comm.topology.ep_size} if optimizer.comm.topology.ep_size > 1 else {}),
    }
