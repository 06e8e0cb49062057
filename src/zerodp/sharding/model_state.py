"""`model.state_dict()` and `model.load_state_dict()` of a stage-3 model.

Between uses a stage-3 parameter is a 1-D view of the rank's shard ([Note: unit storage]
in flat_unit.py), which torch's own state dict would return as it is: each rank's shards,
mis-shaped, a dict that loads nowhere. So the model's state dict hooks replace every unit
parameter, under each of its names, by its value in the form of [Note: row shards]
(rows.py): a DTensor of the parameter's full shape, this rank holding its rows, which
torch.distributed.checkpoint saves and reshards, and `get_state_dict` can gather whole.
Loading takes the same DTensors, or full tensors (each rank keeps what it owns, no
collective). Replicated parameters and buffers are torch's business, untouched.
`state_dict(keep_vars=True)` asks for the model's own variables and gets them: the
shard-viewing parameters, as zerodp's own checkpoint code reads them.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..distributed.agreement import raise_if_any_failed
from .flat_unit import FlatUnit, UnitState
from .rows import RowSharding, gather_runs

__all__ = ["install_state_dict_hooks", "install_whole_load_hook", "full_unit_tensors"]


def _aliases(model: nn.Module, units: list[FlatUnit]) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in the model's state dict (tied weights: several)."""
    ours = {id(p) for u in units for p in u.params}
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in ours:
            out.setdefault(id(p), []).append(name)
    return out


def full_unit_tensors(unit: FlatUnit, phase: str = "checkpoint") -> list[torch.Tensor]:
    """Every parameter of the unit, whole, on every rank (one all-gather per segment)."""
    wanted = {i: (0, slot.numel) for i, slot in enumerate(unit.layout.slots)}
    runs = gather_runs(unit.layout, unit.gather_source(), unit.collectives, wanted, phase, label=f"unit {unit.name}")
    unit.release_staged()
    return [runs[i].view(slot.shape) for i, slot in enumerate(unit.layout.slots)]


def install_state_dict_hooks(model: nn.Module, units: list[FlatUnit], rows: RowSharding,
                             on_loaded: Callable[[], None], settle: Callable[[], None]) -> None:
    """Make the model's state dict the sharded one described above; `on_loaded` runs after
    a load changed parameters (the optimizer restarts its fp32 master from them), `settle`
    before the parameters are read or written (a delayed optimizer update lands first)."""
    aliases = _aliases(model, units)

    # A gathered unit (inside gathered_parameters) holds its parameters whole, in place:
    # torch's own state dict and load are right for it, so the hooks leave it alone.
    asked_for_vars = [False]  # state_dict(keep_vars=...) of the call in progress

    def state_dict_pre_hook(module, prefix, keep_vars):
        asked_for_vars[0] = keep_vars
        if not keep_vars:  # the collective form, called by every rank
            rows.refuse_tensor_parallel("the stage-3 model's state_dict()")
            settle()

    def state_dict_hook(module, state_dict, prefix, local_metadata):
        if asked_for_vars[0]:
            return
        for u in units:
            if u.empty or (u.state is not UnitState.SHARDED and u.exact):
                continue  # gathered exactly: torch's own state dict took the full values
            if rows.sharded:
                wanted = {i: rows.row_range(slot.shape) for i, slot in enumerate(u.layout.slots)}
                local = gather_runs(u.layout, u.gather_source(), u.collectives, wanted, "checkpoint",
                                    label=f"unit {u.name}")
                u.release_staged()
            else:  # one rank holds the unit whole
                local = {i: u.shard[s.offset: s.offset + s.numel] for i, s in enumerate(u.layout.slots)}
            for i, p in enumerate(u.params):
                value = rows.wrap(local[i].detach(), u.layout.slots[i].shape)
                for name in aliases[id(p)]:
                    if prefix + name in state_dict:
                        state_dict[prefix + name] = value

    def _found(state_dict, prefix) -> list:
        """(unit, {slot: (kind, value)}) of every sharded unit the state dict has keys of."""
        out = []
        for u in units:
            if u.state is not UnitState.SHARDED:
                continue
            found = {}
            for i, p in enumerate(u.params):
                key = next((prefix + n for n in aliases[id(p)] if prefix + n in state_dict), None)
                if key is not None:
                    found[i] = rows.unwrap(state_dict[key], u.layout.slots[i].shape, key)
            if found:
                out.append((u, found))
        return out

    def load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs):
        rows.refuse_tensor_parallel("the stage-3 model's load_state_dict()")
        settle()
        todo, problem = [], None
        try:
            todo = _found(state_dict, prefix)
        except Exception as e:  # noqa: BLE001 - raised on every rank, before any collective
            problem = e
        raise_if_any_failed(rows.comm, problem, "model.load_state_dict", "checkpoint")
        with torch.no_grad():
            for u, found in todo:  # the same keys on every rank
                shard = rows.into_shard(u.layout, found, u.collectives, u.shard.dtype, u.device,
                                        label=f"unit {u.name}")
                for i in found:
                    for _, s, n in u.layout.slot_pieces(i, u.rank):
                        u.shard[s: s + n].copy_(shard[s: s + n])
                u.drop_secondary()  # hpZ's copy holds the values before the load
                for i, p in enumerate(u.params):  # what torch's own load then copies: itself
                    for n in aliases[id(p)]:
                        if prefix + n in state_dict:
                            state_dict[prefix + n] = p.detach()
        if todo:
            pending.append(True)

    pending: list = []

    def load_post_hook(module, incompatible_keys):
        if pending:
            pending.clear()
            on_loaded()

    model.register_state_dict_pre_hook(state_dict_pre_hook)
    model.register_state_dict_post_hook(state_dict_hook)
    model.register_load_state_dict_pre_hook(load_pre_hook)
    model.register_load_state_dict_post_hook(load_post_hook)


def install_whole_load_hook(model: nn.Module, rows: RowSharding, on_loaded: Callable[[], None],
                            settle: Callable[[], None]) -> None:
    """Stages 0-2 hold the parameters whole, so torch's own state dict is right; loading
    takes a sharded (DTensor) state dict too, gathered whole first, and `on_loaded` then
    restarts the optimizer's fp32 master from the loaded parameters (`settle` first lands a
    delayed update, which would otherwise overwrite them)."""

    def load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs):
        settle()
        for key in sorted(k for k, v in state_dict.items() if isinstance(v, DTensor)):  # same order on every rank
            state_dict[key] = rows.whole(state_dict[key], key)

    model.register_load_state_dict_pre_hook(load_pre_hook)
    model.register_load_state_dict_post_hook(lambda module, incompatible_keys: on_loaded())
