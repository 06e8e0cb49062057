"""`state_dict()` and `load_state_dict()` of a zerodp model and of any of its submodules.

[Note: weight loading]
Every way weights come in (`load_state_dict` on the model or a submodule, torch DCP's
`set_state_dict`, which calls it, `load_pretrained`, `gathered_parameters(modify=True)`)
ends the same way: the compute parameters hold the values in their dtype, and the
optimizer's fp32 master is restarted from them, taking the values as they were given
where they carry more precision than the parameters keep (fp32 weights into a bf16 model:
`LoadedValues`, used by optim/master.py's `MasterShard.refresh_from_params`). The
optimizer's states and the gradients are left alone, as a load into a DDP model leaves
them. Before anything is read or written, `settle` lands a delayed update in flight
(optim/delayed.py), which would otherwise overwrite the load, or be missing from the state
dict. torch runs the hooks of every module of the subtree a call is made on, so each module
has them; only the outermost call's hooks act, on its whole subtree (`_Outermost`), so
each unit is converted once, not once per module.

Stage 3: between uses a parameter is a 1-D view of the rank's shard ([Note: unit storage]
in flat_unit.py), which torch's own state dict would return as it is: each rank's shards,
mis-shaped, a dict that loads nowhere. So the state dict hooks replace every unit
parameter, under each of its names, by its value in the form of [Note: row shards]
(rows.py): a DTensor of the parameter's full shape, this rank holding its rows, which
torch.distributed.checkpoint saves and reshards, and `get_state_dict` can gather whole.
Loading takes the same DTensors, or full tensors (each rank keeps what it owns, no
collective). Replicated parameters and buffers are torch's business, untouched.
`state_dict(keep_vars=True)` asks for the model's own variables and gets them: the
shard-viewing parameters, as zerodp's own checkpoint code reads them (nor does it settle).

Stages 0-2 hold the parameters whole, so torch's own state dict and copy are right; a
sharded (DTensor) state dict is gathered whole first. Under tensor parallelism a split
parameter is the rank's slice at every stage: its state dict value is a DTensor of the
original's shape over the (tp, shard) mesh, and a load cuts the slice out of any form.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch
import torch.nn as nn

from ..distributed.agreement import raise_if_any_failed
from ..distributed.sync_points import MODEL_LOAD_STATE_DICT, MODEL_STATE_DICT
from .flat_unit import FlatUnit, UnitState
from .rows import RowSharding, gather_runs, is_dtensor

__all__ = ["LoadedValues", "install_state_dict_hooks", "install_whole_load_hook", "full_unit_tensors",
           "serving_whole"]

# Model -> {id(parameter): its whole value}, while `serving_whole` holds: the state dicts of
# the model and its submodules are then those values, with no collective.
_SERVED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def serving_whole(model: nn.Module, values: dict):
    """Within the block, `state_dict()` of the stage-3 `model` or of any submodule returns
    `values` (whole tensors gathered once, by id(parameter)) on this rank alone: for code
    that calls it on one rank only, such as a PEFT model's save_pretrained on the main process."""
    _SERVED[model] = values
    try:
        yield
    finally:
        _SERVED.pop(model, None)


@dataclass(frozen=True)
class LoadedValues:
    """What a load gave one trainable parameter: `runs` of (start in the flattened parameter,
    values), covering at least the elements this rank owns, when the values came in a dtype
    other than the parameter's (they then keep what the parameter rounded away); no runs
    when they came in the parameter's own dtype."""

    runs: tuple = ()

    def values(self, start: int, numel: int) -> Optional[torch.Tensor]:
        """Elements [start, start + numel) as they were loaded, or None: take the parameter's."""
        for lo, v in self.runs:
            if lo <= start and start + numel <= lo + v.numel():
                return v[start - lo: start - lo + numel]
        return None


OnLoaded = Callable[[Mapping[str, LoadedValues]], None]  # by the parameter's name in the optimizer


class _Outermost:
    """The state_dict() or load_state_dict() call in progress and what it gathered. torch runs
    the pre hooks of the called module, then of each module below it (their prefixes
    extending the caller's), then the post hooks; only the outermost call's hooks act. A
    call that raised between its hooks leaves a stale entry, which the next call replaces:
    a new call starts with its own prefix, never one extending a stale one's."""

    def __init__(self):
        self._outer: Optional[tuple] = None  # (module, prefix, ids of the modules below it)
        self.loaded: dict[str, LoadedValues] = {}
        self.keep_vars = False

    def enter(self, module: nn.Module, prefix: str) -> bool:
        """Whether this call is an outermost one (it then becomes the call in progress)."""
        if self._outer is not None:
            _, outer_prefix, below = self._outer
            if id(module) in below and len(prefix) > len(outer_prefix) and prefix.startswith(outer_prefix):
                return False
        self._outer = (module, prefix, {id(m) for m in module.modules() if m is not module})
        self.loaded = {}
        return True

    def leave(self, module: nn.Module, prefix: Optional[str] = None) -> bool:
        """Whether this is the end of the outermost call (torch's load post hooks get no prefix)."""
        if self._outer is None or self._outer[0] is not module or prefix not in (None, self._outer[1]):
            return False
        self._outer = None
        return True

    def abandon(self) -> None:
        self._outer, self.loaded = None, {}


def _refuse_assign(local_metadata: dict) -> None:
    if local_metadata.get("assign_to_params_buffers"):
        raise RuntimeError("load_state_dict(..., assign=True) would replace the parameters of a zerodp model by the "
                           "state dict's tensors, which zerodp's shards and optimizer do not hold: load without "
                           "assign (the values are copied into the parameters)")


def _aliases(module: nn.Module, ours: set) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in `module`'s state dict (tied weights: several)."""
    out: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in ours:
            out.setdefault(id(p), []).append(name)
    return out


def full_unit_tensors(unit: FlatUnit, phase: str = "checkpoint", parts: Optional[list] = None) -> list[torch.Tensor]:
    """Every parameter of the unit's `parts` (all of them by default: `unit.all_params()`,
    trainable then frozen), whole, on every rank (one all-gather per part)."""
    out = []
    for part in unit.parts() if parts is None else parts:
        wanted = {i: (0, slot.numel) for i, slot in enumerate(part.layout.slots)}
        runs = gather_runs(part.layout, part.gather_source(), part.collectives, wanted, phase, label=unit.label)
        part.release_staged()
        out += [runs[i].view(slot.shape) for i, slot in enumerate(part.layout.slots)]
    return out


def _finer(value: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a loaded value holds more than a parameter of `dtype` keeps: the master takes it."""
    return value.is_floating_point() and value.dtype != dtype


def _load_post_hook(loading: "_Outermost", on_loaded: OnLoaded):
    """The outermost load's end hands what it loaded to `on_loaded` (the master's refresh)."""
    def hook(module, incompatible_keys):
        if loading.leave(module) and loading.loaded:
            loaded, loading.loaded = loading.loaded, {}
            on_loaded(loaded)
    return hook


def install_state_dict_hooks(model: nn.Module, units: list[FlatUnit], rows: RowSharding, on_loaded: OnLoaded,
                             settle: Callable[[], None]) -> None:
    """Stage 3: the state dict of the model and of each submodule is the sharded one the
    module docstring describes; a load calls `on_loaded` with what it gave each parameter."""
    ours = {id(p) for u in units for p in u.all_params()}
    saving, loading = _Outermost(), _Outermost()

    def gathers(module) -> bool:
        """Whether the module's state dict runs a collective: a unit of its subtree not held
        whole (its rows are gathered), or a packed projection under tensor parallelism."""
        mine = {id(p) for p in module.parameters()}
        return any(id(p) in mine and ((rows.sharded and (unit.state is UnitState.SHARDED or not unit.exact)) or
                                      (n in rows.splits and rows.splits[n].parts > 1))
                   for unit in units for u in unit.parts() for p, n in zip(u.params, u.names))

    def present(u, state_dict, prefix, aliases) -> dict[int, list[str]]:
        """Slot -> the keys of the state dict that name that parameter of the unit's part
        `u` (the same keys on every rank: a unit outside the subtree is skipped by all)."""
        out = {}
        for i, p in enumerate(u.params):
            keys = [prefix + n for n in aliases.get(id(p), []) if prefix + n in state_dict]
            if keys:
                out[i] = keys
        return out

    def state_dict_pre_hook(module, prefix, keep_vars):
        if not saving.enter(module, prefix):
            return
        saving.keep_vars = keep_vars
        if not keep_vars and model not in _SERVED:  # the collective form, called by every rank
            if gathers(module):  # [Note: sync points] in distributed/sync_points.py
                rows.comm.sync_points.call(MODEL_STATE_DICT, "at stage 3 (each unit's parameters are gathered)")
            settle()

    def state_dict_hook(module, state_dict, prefix, local_metadata):
        if not saving.leave(module, prefix) or saving.keep_vars:
            return
        aliases = _aliases(module, ours)
        served = _SERVED.get(model)
        if served is not None:
            for pid, names in aliases.items():
                for key in (prefix + n for n in names):
                    if key in state_dict:
                        state_dict[key] = served[pid]
            return
        for unit in units:
            # A gathered unit (inside gathered_parameters) holds its parameters whole, in
            # place: torch's own state dict took the full values (of a split parameter, the
            # rank's slice, given the original's shape as at stages 0-2).
            if unit.state is not UnitState.SHARDED and unit.exact:
                for u, i, keys in _split_slots(unit, state_dict, prefix, aliases):
                    value = rows.of(u.names[i]).wrap_slice(state_dict[keys[0]], u.names[i])
                    for key in keys:
                        state_dict[key] = value
                continue
            for u in unit.parts():
                named = present(u, state_dict, prefix, aliases)
                if not named:
                    continue
                cut = rows.of_storage(u.names)
                if cut.sharded:
                    wanted = {i: cut.range_of(u.layout.slots[i].shape, u.names[i]) for i in named}
                    local = gather_runs(u.layout, u.gather_source(), u.collectives, wanted, "checkpoint",
                                        label=unit.label)
                    u.release_staged()
                else:  # one rank holds the unit whole
                    local = {i: u.shard[u.layout.slots[i].offset: u.layout.slots[i].offset + u.layout.slots[i].numel]
                             for i in named}
                for i, keys in named.items():
                    value = cut.wrap(local[i].detach(), u.layout.slots[i].shape, u.names[i])
                    for key in keys:
                        state_dict[key] = value

    def _split_slots(unit, state_dict, prefix, aliases):
        """(part, slot, keys) of the unit's parameters tensor parallelism split, in the state dict."""
        return [(u, i, keys) for u in unit.parts() for i, keys in present(u, state_dict, prefix, aliases).items()
                if rows.is_split(u.names[i])]

    def found_in(state_dict, prefix, aliases) -> list:
        """(unit, {slot: unwrap's (kind, value)}) of every sharded unit the state dict has keys
        of; of a tied parameter's names the last one present, whose value torch copies last."""
        out = []
        for unit in units:
            if unit.state is not UnitState.SHARDED:
                continue
            for u in unit.parts():
                named = present(u, state_dict, prefix, aliases)
                if named:
                    out.append((u, {i: rows.of(u.names[i]).unwrap(state_dict[keys[-1]], u.layout.slots[i].shape,
                                                                  keys[-1], u.names[i])
                                    for i, keys in named.items()}))
        return out

    def load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs):
        if not loading.enter(module, prefix):
            return
        aliases, todo, problem = _aliases(module, ours), [], None
        try:
            rows.comm.sync_points.call(MODEL_LOAD_STATE_DICT, "at stage 3 (the ranks check the state dict together, "
                                                             "and each keeps its shard)")
            settle()
            try:
                _refuse_assign(local_metadata)
                todo = found_in(state_dict, prefix, aliases)
            except Exception as e:  # noqa: BLE001 - raised on every rank, before any collective
                problem = e
            raise_if_any_failed(rows.comm, problem, "model.load_state_dict", "checkpoint")
        except BaseException:
            loading.abandon()
            raise
        for unit in units:  # a gathered unit: torch copies into its whole parameters (a split one's slice)
            if unit.state is not UnitState.SHARDED:
                for u in unit.parts():
                    for i, keys in present(u, state_dict, prefix, aliases).items():
                        split = rows.is_split(u.names[i])
                        for key in keys:  # in the same order on every rank: DTensors gather
                            value = state_dict[key]
                            if is_dtensor(value) or (split and
                                                     tuple(value.shape) != tuple(u.layout.slots[i].shape)):
                                state_dict[key] = rows.of(u.names[i]).whole(value, key, u.layout.slots[i].shape,
                                                                            u.names[i] if split else None)
        with torch.no_grad():
            for u, found in todo:  # the same keys on every rank
                loading.loaded.update(_into_unit(u, found, rows))
                for i, keys in present(u, state_dict, prefix, aliases).items():
                    for key in keys:  # what torch's own load then copies: the parameter itself
                        state_dict[key] = u.params[i].detach()

    load_post_hook = _load_post_hook(loading, on_loaded)

    for m in model.modules():
        m.register_state_dict_pre_hook(state_dict_pre_hook)
        m.register_state_dict_post_hook(state_dict_hook)
        m.register_load_state_dict_pre_hook(load_pre_hook)
        m.register_load_state_dict_post_hook(load_post_hook)


def _into_unit(u, found: dict, rows: RowSharding) -> dict[str, LoadedValues]:
    """Write `found`'s values into the shard of a unit's part `u` (this rank's elements of
    them); what they were, for the master, by trainable parameter's name. Values finer than
    the shard (fp32 into bf16) travel in fp32, so that the master gets them unrounded."""
    trainable = isinstance(u, FlatUnit)  # else a FrozenPart: no master to refresh
    finer = {i for i, (_, v) in found.items() if trainable and _finer(v, u.shard.dtype)}
    dtype = torch.float32 if finer else u.shard.dtype
    shard = rows.of_storage(u.names).into_shard(u.layout, found, u.collectives, dtype, u.device, label=u.label)
    loaded = {}
    for i in found:
        pieces = u.layout.slot_pieces(i, u.rank)
        for _, s, n in pieces:
            u.shard[s: s + n].copy_(shard[s: s + n])
        if trainable:
            loaded[u.names[i]] = LoadedValues(tuple((start, shard[s: s + n]) for start, s, n in pieces)
                                              if i in finer else ())
    if trainable:
        u.drop_secondary()  # hpZ's copy holds the values before the load
    return loaded


def install_whole_load_hook(model: nn.Module, rows: RowSharding, on_loaded: OnLoaded,
                            settle: Callable[[], None]) -> None:
    """Stages 0-2: torch's own state dict and load, on the model and each submodule, after
    `settle`; a sharded (DTensor) value is gathered whole first; a load calls `on_loaded`
    with what it gave each trainable parameter. Under tensor parallelism a split parameter
    is its slice: the state dict gives it as a DTensor of the original's shape
    (`RowSharding.wrap_slice`) and a load takes any form of the original, keeping the slice."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}  # the optimizer's names
    split = {id(p): n for n, p in model.named_parameters() if rows.is_split(n)}
    joined = {i for i, n in split.items() if rows.of(n).splits[n].parts > 1}  # held whole: gathered by the state dict
    loading, saving = _Outermost(), _Outermost()

    def state_dict_pre_hook(module, prefix, keep_vars):
        if split and saving.enter(module, prefix):
            saving.keep_vars = keep_vars
            if not keep_vars and model not in _SERVED and any(id(p) in joined for p in module.parameters()):
                rows.comm.sync_points.call(MODEL_STATE_DICT, "under tensor parallelism (packed projections are "
                                                             "gathered whole)")  # [Note: sync points]
        if not keep_vars:
            settle()

    def state_dict_hook(module, state_dict, prefix, local_metadata):
        if not saving.leave(module, prefix) or saving.keep_vars:
            return
        served = _SERVED.get(model)
        if served is not None:  # inside `serving_whole`: the whole values given, on this rank alone, no collective
            for name, p in module.named_parameters(remove_duplicate=False):
                if id(p) in served and prefix + name in state_dict:
                    state_dict[prefix + name] = served[id(p)]
            return
        done: dict = {}  # a tied parameter is wrapped once (a collective for packed projections)
        for name, p in module.named_parameters(remove_duplicate=False):  # the same order on every rank
            if id(p) in split and prefix + name in state_dict:
                if id(p) not in done:
                    done[id(p)] = rows.of(split[id(p)]).wrap_slice(p.detach(), split[id(p)])
                state_dict[prefix + name] = done[id(p)]

    def load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs):
        if not loading.enter(module, prefix):
            return
        try:
            _refuse_assign(local_metadata)
        except RuntimeError:
            loading.abandon()
            raise
        settle()
        for name, p in module.named_parameters(remove_duplicate=False):  # the same order on every rank
            key, value = prefix + name, state_dict.get(prefix + name)
            # A plain tensor of the slice's shape is this rank's slice (a per-rank state dict, or
            # the model's own variables); anything else is the original, in any form.
            if id(p) in split and torch.is_tensor(value) and (is_dtensor(value) or value.shape != p.shape):
                state_dict[key] = rows.of(split[id(p)]).whole(value, key, tuple(p.shape), split[id(p)])
        for key in sorted(k for k, v in state_dict.items() if is_dtensor(v)):  # same order on every rank
            state_dict[key] = rows.whole(state_dict[key], key)
        # In torch's order of copies, so that of a tied parameter's names the last one wins.
        for name, p in module.named_parameters(remove_duplicate=False):
            value = state_dict.get(prefix + name)
            if id(p) in names and torch.is_tensor(value) and value.shape == p.shape:  # else torch refuses it
                whole = value.detach().reshape(-1)
                loading.loaded[names[id(p)]] = LoadedValues(((0, whole),) if _finer(value, p.dtype) else ())

    load_post_hook = _load_post_hook(loading, on_loaded)

    for m in model.modules():
        m.register_state_dict_pre_hook(state_dict_pre_hook)
        if split:
            m.register_state_dict_post_hook(state_dict_hook)
        m.register_load_state_dict_pre_hook(load_pre_hook)
        m.register_load_state_dict_post_hook(load_post_hook)
