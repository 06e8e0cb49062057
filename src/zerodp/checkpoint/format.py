"""The checkpoint format: file names, what a model holds, parameter-group hyperparameters,
and how ranks report a failure to each other.

[Note: checkpoint layout]
A checkpoint is one directory:

    metadata.json           rank 0: versions, config, world size, stage, dtypes, param groups,
                            scalar optimizer states, loss scaler, step, the user's `extra`, the
                            names of the optimizer states (`state_keys`), and for every trainable
                            parameter its shape, dtype, group, which rank file holds which element
                            ranges ("pieces"), and "states", its own state names, where they are
                            not all of `state_keys` (Muon's momentum beside AdamW's moments, SGD
                            without momentum in one group: none)
    rank{r}.safetensors     rank r's owned element ranges: master/{name}/{start} (fp32),
                            state/{key}/{name}/{start} (exp_avg, ...), param/{name}/{start}
                            (the compute-dtype value, only when it is not fp32: in fp32 the
                            master is the parameter), and frozen/{name}/{start} (a frozen
                            parameter sharded at stage 3 or split by tensor parallelism, in its
                            own dtype; metadata's "frozen" lists its pieces as "params" does)
    rank{r}.json            rank r's RNG states (torch, CUDA, python, numpy); under tensor
                            parallelism also its tensor-parallel rank and the split of each
                            split parameter it wrote ([Note: tensor-parallel pieces])
    replicated.safetensors  rank 0: buffers and frozen parameters of stages 0-2, by state_dict name
    COMPLETE                written last: size and sha256 of every other file

A piece is a range [start, start+numel) of the *flattened original parameter*, never of a
flat buffer or a stage-3 unit, so the layout does not depend on the rank count, bucket
size, stage or unit choice:
any world size and stage reads any checkpoint by opening only the pieces that overlap
what it owns (`safe_open(...).get_slice`), with no conversion step. Tensors are stored
with safetensors only; nothing is pickled. Under tensor parallelism a split parameter's
pieces are ranges of one tensor-parallel rank's slice, with the split described beside
them: [Note: tensor-parallel pieces] in tp_pieces.py.

[Note: trainable state comes from the optimizer]
Trainable values and shapes are read and written through `optimizer.owned_slices()` (full
shapes, owned ranges), never the model: at stage 3 `model.state_dict()` holds 1-D shards.
The model gives only names, which are trainable (by identity: tied weights too) and the
replicated tensors, full at every stage. Frozen parameters are replicated at stages 0-2 and
sharded at stage 3, where each rank writes its runs of them (`frozen_runs`); either form
loads into either. Nothing is gathered, at stage 3 either. A frozen parameter the
tensor-parallel plan split (a base trained only in part) is never replicated
whole: at stages 0-2 its slice is one run (`frozen_runs` again), written by data rank 0 of
each tensor-parallel rank, with the split beside its pieces as a trainable one's.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..distributed.agreement import first_disagreement
from ..memory.placement import Placement
from ..sharding.frozen import FrozenSlice, frozen_slices
from .tp_pieces import splits_of

__all__ = ["CheckpointError", "InvalidCheckpoint", "ModelView", "PathLike", "frozen_runs", "model_view"]

FORMAT = "zerodp-checkpoint"
FORMAT_VERSION = 1
METADATA = "metadata.json"
COMPLETE = "COMPLETE"
REPLICATED = "replicated.safetensors"
TMP_TAG = ".tmp-"  # an unfinished save
OLD_TAG = ".old-"  # a checkpoint being replaced by a save to the same path
STAGING_TAG = ".staging-"  # an unfinished save's directory until its writer is named inside

PathLike = str | os.PathLike


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says which file or name and why."""


class InvalidCheckpoint(CheckpointError, ValueError):
    """A checkpoint's files or values are not what zerodp writes: damaged, changed after the
    save, or another program's. Bad input, hence also a ValueError; raised before anything
    outside the checkpoint is opened and before anything is changed."""


# Every name a checkpoint's COMPLETE may list: what `save` writes, nothing else. A rank is a
# decimal number without leading zeros, so no name can step out of the directory.
RANK_NAME = re.compile(r"rank(0|[1-9][0-9]{0,8})\.(safetensors|json)")


def is_format_name(name: str) -> bool:
    return name in (METADATA, REPLICATED) or RANK_NAME.fullmatch(name) is not None


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def rank_json(rank: int) -> str:
    return f"rank{rank}.json"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_error(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


@dataclass
class ModelView:
    """The model's state_dict names, each a trainable parameter (held by the optimizer's
    owned slices, under its first name), a frozen parameter sharded at stage 3 (held by
    `frozen_runs`), or replicated (buffers, frozen params at stages 0-2).
    See [Note: trainable state comes from the optimizer]."""

    keys: list  # [state_dict key, "param" | "frozen" | "replicated", source name], in state_dict order
    replicated: dict  # source name -> tensor
    trainable: set  # names of trainable parameters as owned_slices names them
    # name of a frozen parameter held as runs (`frozen_runs`) -> its original (full) shape
    frozen: dict = field(default_factory=dict)

    def aliases(self, kind: str = "param") -> dict:
        """Trainable (or sharded frozen) name -> every state_dict key that holds it (tied
        weights have several)."""
        out: dict = {}
        for key, k, src in self.keys:
            if k == kind:
                out.setdefault(src, []).append(key)
        return out


def plain_module(model: nn.Module) -> nn.Module:
    """The module `torch.compile(model)` wraps (its state dict's keys carry an `_orig_mod.`
    prefix the trained parameters' names do not), else `model` itself."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def frozen_runs(model: nn.Module, optimizer) -> list:
    """This rank's runs of the frozen parameters it writes and reads by pieces: those stage 3
    shards, and at stages 0-2 the slices of those tensor-parallelism split (one run each)."""
    if optimizer.stage3 is not None:
        return frozen_slices(optimizer.stage3.units)
    splits, seen, out = splits_of(optimizer), set(), []
    for name, p in plain_module(model).named_parameters():
        if name in splits and not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(FrozenSlice(name, tuple(p.shape), p.dtype, 0, p.numel(), p.detach().view(-1), Placement()))
    return out


def model_view(model: nn.Module, optimizer) -> ModelView:
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    splits = splits_of(optimizer)
    units = optimizer.stage3.units if optimizer.stage3 is not None else []
    # Frozen parameters held as runs, by identity (a compiled model's names carry a prefix):
    # stage 3's sharded ones, or at stages 0-2 those tensor parallelism split.
    held = {id(p): (n, shape) for u in units for part in u.frozen
            for p, n, shape in zip(part.params, part.names, (s.shape for s in part.layout.slots))}
    if not units:
        params = dict(plain_module(model).named_parameters())
        held = {id(params[s.name]): (s.name, s.shape) for s in frozen_runs(model, optimizer)}
    runs = {i: (n, list(shape) if n not in splits else splits[n].global_shape(shape)) for i, (n, shape) in held.items()}
    seen: dict = {}
    keys, replicated, frozen = [], {}, {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in trainable:
            keys.append([key, "param", trainable[id(t)]])
        elif id(t) in runs:
            name, shape = runs[id(t)]
            keys.append([key, "frozen", name])
            frozen[name] = shape
        elif id(t) in seen:  # a tied frozen parameter or shared buffer: stored once
            keys.append([key, "replicated", seen[id(t)]])
        else:
            seen[id(t)] = key
            keys.append([key, "replicated", key])
            replicated[key] = t
    return ModelView(keys, replicated, set(trainable.values()), frozen)


def json_safe(value):
    """A hyperparameter as JSON, or None when it has no JSON form (it is then not saved)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, float, str)):
        return value
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [json_safe(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    return None


def group_hyperparameters(optimizer) -> list:
    out = []
    for group in optimizer.param_groups:
        out.append({k: json_safe(v) for k, v in group.items()
                    if k != "params" and (json_safe(v) is not None or v is None)})
    return out


def restore_hyperparameters(optimizer, saved: list) -> None:
    for group, values in zip(optimizer.param_groups, saved):
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


def raise_if_failed(statuses: list, what: str) -> None:
    errors: dict = {}
    for rank, st in enumerate(statuses):
        if st is not None and not st["ok"]:
            errors.setdefault(st["error"], []).append(rank)
    if errors:
        parts = [f"rank {', '.join(map(str, ranks))}: {err}" for err, ranks in errors.items()]
        raise CheckpointError(f"{what} failed on {sum(map(len, errors.values()))} of {len(statuses)} ranks; "
                              + " | ".join(parts))


def read_on_every_rank(comm, read, what: str, fix: str):
    """[Note: validate, then write] for a load: `read()` returns what this rank read and a
    description of it every rank must share. Refused on every rank, before the caller changes
    anything, if one rank failed or the ranks describe different things; `fix` ends that
    message. Returns what `read` returned first."""
    try:
        loaded, described = read()
        local = {"ok": True, "described": described}
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        loaded, local = None, {"ok": False, "error": describe_error(e), "described": {}}
    everyone = comm.all_gather_object(local, "checkpoint", label=what)
    raise_if_failed(everyone, what)
    differs = first_disagreement([r["described"] for r in everyone])
    if differs:
        raise CheckpointError(f"rank {comm.rank}: {what} refused, nothing was changed: the ranks disagree on the "
                              f"{differs}; {fix}")
    return loaded


def write_replicated(values: dict, targets: dict) -> None:
    for k, v in values.items():
        t = targets[k]
        t.data.copy_(v.to(device=t.device, dtype=t.dtype))
