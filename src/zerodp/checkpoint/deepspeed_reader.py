"""A DeepSpeed ZeRO checkpoint (stages 1-3, the folder `engine.save_checkpoint` writes) read
into a zerodp model and optimizer at any world size and stage: `zerodp.load` comes here for
such a folder (checkpoint/__init__.py). docs/deepspeed.md.

[Note: what is read from a DeepSpeed checkpoint]
`save_dir/latest` names the tag (one path component); `save_dir/<tag>/` holds, for N
data-parallel ranks (model parallel size 1):
- `mp_rank_00_model_states.pt` (stages 1-2) or `zero_pp_rank_{r}_mp_rank_00_model_states.pt`
  (stage 3, one per rank): `param_shapes` (per DeepSpeed param group, or stage-3 sub-group,
  the trainable parameters' names and shapes in the order they are flattened), `buffer_names`,
  `module` (buffers; whole frozen parameters at stage 1), `frozen_param_shapes` and
  `frozen_param_fragments` (stages 2-3; at stage 3 each rank's partition), `global_steps`,
  `global_samples`, `skipped_steps`, `dp_world_size`, `lr_scheduler`, `ds_version`, and the
  client state given to save_checkpoint.
- `[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`: `optimizer_state_dict` with the fp32
  master partitions and the inner torch optimizer's state over them (Adam's exp_avg,
  exp_avg_sq, step) and param groups, `zero_stage`, `partition_count`, the loss scaler.

Layouts (as DeepSpeed's own utils/zero_to_fp32.py reconstructs them):
- stages 1-2: each param group is one flat buffer, the parameters back to back in
  `param_shapes` order, padded at the end and cut into N equal partitions; rank r saved
  partition r (`single_partition_of_fp32_groups`, its padding dropped). Element e of the group
  is at rank e // P, offset e % P, P = rank 0's length. The optimizer states are torch's state
  of that flat partition (padded length), in the same places.
- stage 3: every parameter is cut on its own into N partitions of ceil(numel / N) elements,
  and rank r's `fp32_flat_groups` (one per sub-group) hold its partition of each parameter,
  back to back in `param_shapes` order; the states follow the same flat sub-groups.

Every file is read with `torch.load(weights_only=True, mmap=True)`: tensors, containers and
numbers only. DeepSpeed pickles three classes of its own beside them: the loss scaler
(`LossScaler` / `DynamicLossScaler`), the stage enum (`ZeroStageEnum`) and
`fragment_address` (param_slice_mappings). weights_only refuses them, so each is allowed for
this load only (`torch.serialization.safe_globals`) under its DeepSpeed name, bound to a
stand-in here: `Saved`, which keeps the pickled attribute dictionary as data, and `int` for
the enum. No DeepSpeed code runs and DeepSpeed need not be installed. Anything else a file
holds (a client state with other objects) is refused by weights_only; the error names it.

Each rank reads only the ranges of the parameters it owns (the partitions are memory-mapped),
then, as zerodp.load, all ranks agree that reading worked before anything changes
([Note: validate, then write] in sharded.py).
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import stat
from dataclasses import dataclass, field

import torch
from torch import nn

from . import background
from .format import (CheckpointError, InvalidCheckpoint, PathLike, frozen_runs, model_view, plain_module,
                     read_on_every_rank, restore_hyperparameters, write_replicated)
from .reader import name_mismatch
from .tp_pieces import ranks_of

log = logging.getLogger(__name__)

__all__ = ["is_deepspeed_checkpoint", "load_deepspeed", "Saved"]

LATEST = "latest"
_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class Saved:
    """A DeepSpeed object as pickled data: its attribute dictionary, nothing run."""

    def __setstate__(self, state) -> None:
        self.state = state if isinstance(state, dict) else {}


def _stage_value(value):
    return int(value)


# DeepSpeed's names, each bound to its stand-in for a load ([Note: what is read from a DeepSpeed checkpoint]).
_STAND_INS = [(Saved, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
              (Saved, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
              (Saved, "deepspeed.utils.tensor_fragment.fragment_address"),
              (_stage_value, "deepspeed.runtime.zero.config.ZeroStageEnum")]


def _folder(path: str) -> str | None:
    """The tag folder of a DeepSpeed save_dir (its `latest`), or `path` if it is one."""
    if not os.path.isdir(path):
        return None
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest) and not os.path.islink(latest):
        with open(latest, encoding="utf-8") as f:
            tag = f.read(4096).strip()
        if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or "\0" in tag:
            raise InvalidCheckpoint(f"{latest} names {tag!r}, not a checkpoint tag (one folder name inside {path})")
        return os.path.join(path, tag)
    names = os.listdir(path)
    return path if any(_MODEL.match(n) for n in names) and any(_OPTIM.match(n) for n in names) else None


def is_deepspeed_checkpoint(path: PathLike) -> bool:
    """Whether `path` is a DeepSpeed save_dir (with `latest`) or one of its tag folders."""
    path = os.fsdecode(os.fspath(path))
    if os.path.isfile(os.path.join(path, "metadata.json")):  # zerodp's own
        return False
    try:
        return _folder(path) is not None
    except (OSError, InvalidCheckpoint):
        return os.path.isfile(os.path.join(path, LATEST))  # let load_deepspeed say what is wrong


def _read(file: str) -> dict:
    st = os.lstat(file)  # a planted link must not make the read land outside the folder
    if not stat.S_ISREG(st.st_mode):
        raise InvalidCheckpoint(f"{file} is not a regular file")
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            obj = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - weights_only's refusal, a truncated zip: both named
        first = str(e).strip().splitlines()
        detail = next((ln for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0] if first else "")
        raise InvalidCheckpoint(f"{file} could not be read with torch.load(weights_only=True): {detail[:300]}. zerodp "
                                f"reads tensors, containers and DeepSpeed's loss scaler, stage enum and fragment "
                                f"addresses; if you trust the file, allow the class named with "
                                f"torch.serialization.add_safe_globals before zerodp.load") from None
    if not isinstance(obj, dict):
        raise InvalidCheckpoint(f"{file} holds {type(obj).__name__}, not DeepSpeed's dict")
    return obj


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise InvalidCheckpoint(what)


@dataclass
class _Param:
    """Where a trainable parameter's elements are in the DeepSpeed files."""

    name: str
    shape: tuple
    group: int  # DeepSpeed's param group
    sub: int  # its flat group: the param group (stages 1-2) or the sub-group (stage 3)
    offset: int  # stages 1-2: in the group's flat buffer; stage 3: in each rank's flat sub-group
    per_rank: int  # elements per partition: the group's (stages 1-2) or the parameter's (stage 3)
    stage3: bool

    def runs(self, start: int, numel: int):
        """(rank, offset in that rank's flat tensor, count) covering [start, start + numel)."""
        end, out = start + numel, []
        while start < end:
            if self.stage3:
                rank, off = divmod(start, self.per_rank)
                off_in = self.offset + off
            else:
                rank, off_in = divmod(self.offset + start, self.per_rank)
                off = off_in
            n = min(self.per_rank - off, end - start)
            out.append((rank, off_in, n))
            start += n
        return out


@dataclass
class _Checkpoint:
    folder: str
    stage: int
    world: int
    model_states: dict  # rank 0's
    flats: list  # [rank][sub] fp32 partitions
    states: list  # [rank][sub] {key: tensor}
    scalars: list  # per DeepSpeed param group: {key: value}
    groups: list  # per DeepSpeed param group: hyperparameters
    params: dict  # name -> _Param
    frozen_fragments: list = field(default_factory=list)  # [rank] {name: tensor}
    scaler: object = None

    def elements(self, p: _Param, key: str | None, start: int, numel: int) -> torch.Tensor:
        src = self.flats if key is None else [[s[key] for s in rank] for rank in self.states]
        pieces = []
        for rank, off, n in p.runs(start, numel):
            t = src[rank][p.sub]
            _check(off + n <= t.numel(), f"{self.folder}: rank {rank}'s partition of {p.name} ends at {t.numel()}, "
                                         f"before element {off + n} ({key or 'fp32'})")
            pieces.append(t[off:off + n])
        return torch.cat(pieces).to(torch.float32) if pieces else torch.empty(0)


def _open(path: str) -> _Checkpoint:
    folder = _folder(path)
    if folder is None or not os.path.isdir(folder):
        raise CheckpointError(f"{path} is not a DeepSpeed checkpoint (no `latest` naming a tag folder with "
                              f"*_model_states.pt and *_optim_states.pt)")
    names = os.listdir(folder)
    models, optims = {}, {}
    for n in names:
        if m := _MODEL.match(n):
            models[int(m.group(1) or 0)] = (n, int(m.group(2)))
        elif m := _OPTIM.match(n):
            optims[int(m.group(1))] = (n, int(m.group(2)))
    for n in names:
        if n.startswith(("layer_", "expert_")) or n == "offloaded_tensors":
            raise CheckpointError(f"{folder} holds {n}: pipeline, MoE and NVMe-offloaded optimizer checkpoints are "
                                  f"not read; consolidate it with DeepSpeed's zero_to_fp32.py and load_pretrained")
    if any(mp != 0 for _, mp in [*models.values(), *optims.values()]):
        raise CheckpointError(f"{folder} was saved with model (tensor) parallelism: not read")
    if not optims:
        raise CheckpointError(f"{folder} has no *_optim_states.pt: a DeepSpeed checkpoint without ZeRO (stage 0) "
                              f"keeps the optimizer inside the model states; read its weights with "
                              f"torch.load(..., weights_only=True)['module'] and load_pretrained")
    world = len(optims)
    _check(sorted(optims) == list(range(world)), f"{folder}: optimizer files of ranks {sorted(optims)}, not 0..N-1")
    opt = [_read(os.path.join(folder, optims[r][0]))["optimizer_state_dict"] for r in range(world)]
    ms = _read(os.path.join(folder, models[min(models)][0])) if models else None
    _check(ms is not None and isinstance(ms.get("param_shapes"), list), f"{folder}: no model states with "
                                                                        f"param_shapes")
    stage = opt[0].get("zero_stage")
    _check(stage in (1, 2, 3) and all(o.get("zero_stage") == stage for o in opt),
           f"{folder}: zero_stage {[o.get('zero_stage') for o in opt]}, not one stage of 1-3")
    counts = opt[0].get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    _check(all(c == world for c in counts) and ms.get("dp_world_size") == world,
           f"{folder}: partition_count {counts} and dp_world_size {ms.get('dp_world_size')}, but {world} optimizer "
           f"files (an overwritten or partial save?)")
    ckpt = _layout(folder, stage, world, ms, opt)
    if stage == 3:
        frag = []
        for r in range(world):
            _check(r in models, f"{folder}: no model states of rank {r}")
            frag.append(_read(os.path.join(folder, models[r][0])).get("frozen_param_fragments") or {})
        ckpt.frozen_fragments = frag
    return ckpt


def _layout(folder: str, stage: int, world: int, ms: dict, opt: list) -> _Checkpoint:
    shapes = ms["param_shapes"]
    if stage == 3:
        flats = [o.get("fp32_flat_groups") for o in opt]
        inner = [o.get("optimizer_state_dict") for o in opt]
    else:
        flats = [o.get("single_partition_of_fp32_groups") for o in opt]
        inner = [o.get("base_optimizer_state") for o in opt]
    _check(all(isinstance(f, list) and len(f) == len(shapes) and all(torch.is_tensor(t) and t.dim() == 1 for t in f)
               for f in flats), f"{folder}: fp32 partitions do not match the {len(shapes)} groups of param_shapes")
    # Per flat group (sub): its DeepSpeed param group and its optimizer states, on every rank.
    sub_group, states, scalars, groups = [], [[] for _ in range(world)], [], []
    if isinstance(inner[0], dict):  # torch's optimizer state dict over the flat partitions
        for g, pg in enumerate(inner[0]["param_groups"]):
            groups.append({k: v for k, v in pg.items() if k != "params"})
            for idx in pg["params"]:
                sub_group.append((g, idx))
        for r in range(world):
            for _, idx in sub_group:
                states[r].append(inner[r]["state"].get(idx, {}))
    else:  # DeepSpeed's elastic form (stages 1-2): a lean state per group, the step beside
        step = opt[0].get("base_optimizer_state_step")
        for g in range(len(inner[0])):
            sub_group.append((g, g))
            groups.append({})
        for r in range(world):
            states[r] = [dict(s) for s in inner[r]]
        for r in range(world):
            for s in states[r]:
                s.setdefault("step", step)
    _check(len(sub_group) == len(shapes), f"{folder}: {len(sub_group)} optimizer groups for {len(shapes)} flat groups")
    per_elem, group_scalars = [], {}
    for sub, (g, _) in enumerate(sub_group):
        first = states[0][sub]
        keys = sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() == 1)
        per_elem.append(keys)
        group_scalars.setdefault(g, {k: (v.item() if torch.is_tensor(v) else v) for k, v in first.items()
                                     if k not in keys})
    scalars = [group_scalars.get(g, {}) for g in range(len(groups))]
    params = {}
    for sub, names in enumerate(shapes):
        g = sub_group[sub][0]
        offset = 0
        flat_len = flats[0][sub].numel()
        for name, shape in names.items():
            _check(isinstance(name, str) and all(isinstance(d, int) and d >= 0 for d in shape),
                   f"{folder}: param_shapes entry {name!r}: {shape!r}")
            numel = math.prod(shape)
            if stage == 3:
                per = -(-numel // world)
                params[name] = _Param(name, tuple(shape), g, sub, offset, per, True)
                offset += per
            else:
                params[name] = _Param(name, tuple(shape), g, sub, offset, flat_len, False)
                offset += numel
        if stage == 3:
            _check(all(f[sub].numel() == offset for f in flats), f"{folder}: flat sub-group {sub} holds "
                                                                 f"{[f[sub].numel() for f in flats]} elements per "
                                                                 f"rank, the parameters' partitions {offset}")
        else:
            _check(world * flat_len >= offset and all(f[sub].numel() <= flat_len for f in flats),
                   f"{folder}: group {sub}'s partitions ({[f[sub].numel() for f in flats]}) cannot hold its "
                   f"{offset} elements")
        for r in range(world):
            for key in per_elem[sub]:
                _check(torch.is_tensor(states[r][sub].get(key)), f"{folder}: rank {r} has no {key} for group {sub}")
    ckpt = _Checkpoint(folder, stage, world, ms, flats, states, scalars, groups, params)
    ckpt.scaler = opt[0].get("loss_scaler")
    return ckpt


@dataclass
class _Loaded:
    masters: list  # (slice, tensor)
    states: list  # (slice, key, tensor)
    replicated: dict  # name -> tensor
    targets: dict
    frozen: list  # (FrozenSlice, tensor)


def load_deepspeed(path: PathLike, model: nn.Module, optimizer) -> dict:
    """Restore a DeepSpeed ZeRO checkpoint into zerodp's `model` and `optimizer` (any world
    size and stage): weights, fp32 masters, optimizer states and step, hyperparameters, the
    loss scale, buffers and frozen parameters. Returns DeepSpeed's client state with
    `global_steps`, `global_samples`, `skipped_steps`, `lr_scheduler`, `ds_config` and
    `ds_version`. Every rank must call it; a fault raises on every rank before anything
    changes. RNG states are not in DeepSpeed's checkpoint and are left as they are."""
    model = plain_module(model)
    background.wait_in_flight(optimizer)
    comm = ranks_of(optimizer)
    path = os.path.abspath(os.fsdecode(os.fspath(path)))

    def read():
        if optimizer.comm.topology.tp_size > 1:
            raise CheckpointError("DeepSpeed checkpoints are read without tensor parallelism (tensor_parallel_size=1)")
        ckpt = _open(path)
        loaded = _read_for_rank(ckpt, model, optimizer)
        names = hashlib.sha256("\0".join(sorted(ckpt.params)).encode()).hexdigest()
        return (ckpt, loaded), {"checkpoint": (os.path.basename(ckpt.folder), ckpt.model_states.get("global_steps"),
                                               ckpt.world, ckpt.stage, names)}

    ckpt, loaded = read_on_every_rank(comm, read, f"load of DeepSpeed checkpoint {path}",
                                      "every rank must read the same DeepSpeed checkpoint")
    _apply(ckpt, loaded, optimizer)
    ms = ckpt.model_states
    log.info("rank %d: loaded DeepSpeed checkpoint %s (step %s, ZeRO stage %d, %d ranks)", comm.rank, ckpt.folder,
             ms.get("global_steps"), ckpt.stage, ckpt.world)
    deepspeed_keys = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                      "frozen_param_fragments", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                      "dp_world_size", "mp_world_size"}
    return {k: v for k, v in ms.items() if k not in deepspeed_keys}


def _read_for_rank(ckpt: _Checkpoint, model: nn.Module, optimizer) -> _Loaded:
    ms, folder = ckpt.model_states, ckpt.folder
    view = model_view(model, optimizer)
    slices = optimizer.owned_slices()
    expected = {n: None for n in view.trainable}
    for s in slices:
        expected[s.name] = list(s.shape)
    found = {n: list(p.shape) for n, p in ckpt.params.items()}
    problem = name_mismatch(folder, "DeepSpeed checkpoint (trainable parameters)", expected, found)
    if problem:
        raise CheckpointError(problem)
    groups = optimizer.inner.param_groups
    if len(ckpt.scalars) != len(groups):
        raise CheckpointError(f"{folder} has {len(ckpt.scalars)} param groups; the optimizer has {len(groups)}")
    moved = sorted(s.name for s in slices if ckpt.params[s.name].group != s.group)
    if moved:
        raise CheckpointError(f"{folder}: parameters {moved[:10]} are in another param group than in DeepSpeed's")
    _check_hyperparameters(folder, ckpt.groups, optimizer.param_groups)
    masters, states = [], []
    keys = {k for rank in ckpt.states for sub in rank for k, v in sub.items() if torch.is_tensor(v) and v.dim() == 1}
    for s in slices:
        if s.numel == 0:
            continue
        p = ckpt.params[s.name]
        masters.append((s, ckpt.elements(p, None, s.start, s.numel)))
        for key in sorted(keys):
            states.append((s, key, ckpt.elements(p, key, s.start, s.numel)))
    buffers = set(ms.get("buffer_names") or [])
    module = ms.get("module") or {}
    frozen_shapes = dict(ms.get("frozen_param_shapes") or {})
    frozen_full = _frozen_values(ckpt, module, frozen_shapes)
    replicated = {}
    for k, t in view.replicated.items():
        value = module.get(k) if k in buffers else frozen_full.get(k)
        if value is None or list(value.shape) != list(t.shape):
            raise CheckpointError(f"{folder} has no {'buffer' if k in buffers else 'frozen parameter'} {k} of shape "
                                  f"{list(t.shape)} (found {None if value is None else list(value.shape)})")
        replicated[k] = value
    frozen = []
    for s in frozen_runs(model, optimizer):
        value = frozen_full.get(s.name)
        if value is None or value.numel() < s.start + s.numel:
            raise CheckpointError(f"{folder} has no frozen parameter {s.name} of shape {list(s.shape)}")
        frozen.append((s, value.reshape(-1)[s.start:s.start + s.numel]))
    return _Loaded(masters, states, replicated, view.replicated, frozen)


def _frozen_values(ckpt: _Checkpoint, module: dict, shapes: dict) -> dict:
    """Frozen parameters whole: from the fragments (stages 2-3, at stage 3 each rank's
    partition of ceil(numel / N)) or from the module's state dict (stage 1)."""
    out = {}
    names = set(shapes) | {k for k in module if k not in set(ckpt.model_states.get("buffer_names") or [])
                           and k not in ckpt.params}
    for name in names:
        shape = list(shapes.get(name, module[name].shape if name in module else []))
        numel = math.prod(shape)
        if ckpt.stage == 3 and ckpt.frozen_fragments and name in ckpt.frozen_fragments[0]:
            parts = [f[name].reshape(-1) for f in ckpt.frozen_fragments]
            out[name] = torch.cat(parts)[:numel].view(shape)
        elif name in (ckpt.model_states.get("frozen_param_fragments") or {}):
            out[name] = ckpt.model_states["frozen_param_fragments"][name].reshape(shape)
        elif name in module and module[name].numel() == numel:
            out[name] = module[name]
    return out


def _check_hyperparameters(folder: str, saved: list, groups: list) -> None:
    for gi, (values, group) in enumerate(zip(saved, groups)):
        for k, v in values.items():
            if k not in group or k == "params":
                continue
            live = group[k]
            number = (int, float)
            fits = (isinstance(live, bool) == isinstance(v, bool)) and (
                (isinstance(live, number) or torch.is_tensor(live)) and isinstance(v, number) and math.isfinite(v)
                or isinstance(live, (tuple, list)) and isinstance(v, (tuple, list)) and len(v) == len(live)
                or live is None or v is None or type(v) is type(live))
            if not fits:
                raise CheckpointError(f"{folder}: param group {gi}'s {k}={v!r} does not fit the optimizer's "
                                      f"{live!r}: load into the optimizer DeepSpeed trained (same type and groups)")


@torch.no_grad()
def _apply(ckpt: _Checkpoint, loaded: _Loaded, optimizer) -> None:
    """Write what _read_for_rank read: the only part that changes state."""
    optimizer.materialize_state()  # the states exist before they are written, as torch DCP creates them
    live = {(s.name, s.start): s for s in optimizer.owned_slices()}
    missing = sorted({(s.name, key) for s, key, _ in loaded.states if key not in live[(s.name, s.start)].states})
    if missing:  # the same on every rank: the optimizer's type decides its states
        raise CheckpointError(f"the DeepSpeed checkpoint holds optimizer state {missing[0][1]!r} for {missing[0][0]}, "
                              f"which this optimizer ({type(optimizer.inner).__name__}) does not keep: load into the "
                              f"optimizer DeepSpeed trained")
    restore_hyperparameters(optimizer, ckpt.groups)
    for s, value in loaded.masters:
        s.write(s.master, value)
    for s, key, value in loaded.states:
        s = live[(s.name, s.start)]
        s.write(s.states[key], value)
    optimizer.load_scalar_states([{k: v for k, v in g.items() if isinstance(v, (int, float))} for g in ckpt.scalars])
    ms = ckpt.model_states
    scaler = getattr(ckpt.scaler, "state", None) or {}
    if optimizer.config.uses_loss_scaling and scaler.get("dynamic"):
        clean = int(scaler.get("cur_iter", 0)) - int(scaler.get("last_overflow_iter", -1)) - 1
        optimizer.scaler.load_state_dict({"scale": float(scaler["cur_scale"]), "clean_steps": max(0, clean),
                                          "skipped_steps": int(ms.get("skipped_steps") or 0)})
    optimizer.step_count = int(ms.get("global_steps") or 0)
    write_replicated(loaded.replicated, loaded.targets)
    for s, value in loaded.frozen:
        s.write(value)
    optimizer.sync_params_from_master("checkpoint")
