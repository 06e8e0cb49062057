"""The optimizer's state by parameter: `owned_slices` (what zerodp's own checkpoints read and
write) and `ZeroOptimizer.state_dict()` / `load_state_dict()`, torch's form, sharded.

The form is torch's own: {"state": {i: {name: value}}, "param_groups": [{..., "params":
[i, ...]}]}, where i numbers the model's trainable parameters in param-group order (what
`optimizer.param_groups` lists), so `torch.distributed.checkpoint.state_dict` maps them to
the model's names as for any optimizer. Each per-element state (Adam's exp_avg, ...) has its
parameter's full shape, a DTensor holding this rank's rows ([Note: row shards] in
sharding/rows.py); scalar states (Adam's step) are plain. Under bf16/fp16 each parameter
also has "master": its fp32 master weights, which the compute-dtype model state dict
rounds; loading restores them exactly. Loading accepts the same DTensors or full tensors
(from a full state dict), at any world size and stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from ..distributed.agreement import raise_if_any_failed
from ..memory.ledger import is_elementwise_state
from ..sharding.rows import RowSharding, gather_runs

__all__ = ["MASTER", "OwnedSlice", "owned_slices", "sharded_state_dict", "load_sharded_state_dict"]

MASTER = "master"  # the fp32 master weights' key under mixed precision


@dataclass
class OwnedSlice:
    """Elements [start, start+numel) of one flattened parameter that this rank owns, with
    views of its compute value, fp32 master and per-element optimizer states."""

    name: str
    shape: tuple
    group: int
    start: int
    numel: int
    param: torch.Tensor
    master: torch.Tensor
    states: dict


def owned_slices(opt) -> list[OwnedSlice]:
    """Every run of parameter elements this rank owns, by parameter name; independent of
    the world size and stage, so a checkpoint written from it can be read by any other."""
    out = []
    for gi, group in enumerate(opt.shards):
        for shard in group:
            st = shard.storage
            params = st.owned_params()
            for pi, piece in enumerate(st.owned_pieces()):
                master_t = shard.master_tensors[pi]
                states = {k: v for k, v in opt.inner.state.get(master_t, {}).items()
                          if is_elementwise_state(v, master_t)}
                for si, slot in enumerate(st.layout.slots):
                    lo = max(slot.offset, piece.flat_start)
                    hi = min(slot.offset + slot.numel, piece.flat_start + piece.numel)
                    if lo >= hi:
                        continue
                    a, b = lo - piece.flat_start, hi - piece.flat_start
                    out.append(OwnedSlice(
                        name=st.names[si], shape=slot.shape, group=gi, start=lo - slot.offset, numel=hi - lo,
                        param=params[pi].reshape(-1)[a:b],
                        master=master_t.reshape(-1)[a:b],
                        states={k: v.reshape(-1)[a:b] for k, v in states.items()}))
    return out


def _pid_of(opt) -> tuple[dict, dict]:
    """id(parameter) -> its number in the state dict, and name -> number."""
    params = list(chain.from_iterable(g["params"] for g in opt.param_groups))
    pid = {id(p): i for i, p in enumerate(params)}
    return pid, {n: pid[id(p)] for n, p in opt.trainable}


def _agreed_states(opt) -> list[tuple[list[str], dict]]:
    """Per param group: its per-element state names and its scalar states (Adam's step).
    A rank may own no element of a small group (at stage 3, a few norm weights), and then
    holds none of its states; the ranks pool what they hold (one small exchange), so every
    rank runs the same collectives and writes the same entries."""
    local = []
    for group, scalars in zip(opt.shards, opt.scalar_states()):
        keys = {k for shard in group for t in shard.master_tensors for k, v in opt.inner.state.get(t, {}).items()
                if is_elementwise_state(v, t)}
        local.append((sorted(keys), scalars))
    if opt.comm.world_size > 1:
        pooled = opt.comm.all_gather_object(local, "checkpoint", label="optimizer state names")
        local = [(sorted({k for rank in pooled for k in rank[gi][0]}),
                  next((rank[gi][1] for rank in pooled if rank[gi][1]), {})) for gi in range(len(local))]
    # In fp32 the parameters are the master's values (an offloaded master is a copy of
    # them), so the state dict has no master: the same whatever the placement.
    full_precision = opt.config.compute_dtype == torch.float32
    return [(keys + ([] if full_precision else [MASTER]), scalars) for keys, scalars in local]


def _piece_tensors(opt, shard, key: str) -> list[torch.Tensor]:
    if key == MASTER:
        return shard.master_tensors
    return [opt.inner.state[t][key] for t in shard.master_tensors]


def _local_values(rows: RowSharding, shard, tensors: list[torch.Tensor], device) -> dict[int, torch.Tensor]:
    """Slot index -> this rank's rows of that parameter (flat), for one storage's state."""
    st = shard.storage
    layout, pieces = st.layout, st.owned_pieces()
    dtype = tensors[0].dtype if tensors else torch.float32
    if rows.sharded:
        local = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
        for p, t in zip(pieces, tensors):
            local[p.shard_start: p.shard_start + p.numel].copy_(t.reshape(-1))
        wanted = {i: rows.row_range(layout.slots[i].shape) for i in st.indices}
        return gather_runs(layout, local, st.collectives, wanted, "checkpoint")
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    for p, t in zip(pieces, tensors):
        flat[p.flat_start: p.flat_start + p.numel].copy_(t.reshape(-1))
    return {i: flat[layout.slots[i].offset: layout.slots[i].offset + layout.slots[i].numel] for i in st.indices}


# Under fp16 the loss scaler travels as scalar states of every parameter: torch's checkpoint
# helpers keep only "state" and "param_groups" of an optimizer state dict.
SCALER_PREFIX = "loss_scaler."


@torch.no_grad()
def sharded_state_dict(opt, rows: RowSharding) -> dict:
    """The optimizer's state dict, as the module docstring describes (collective). States
    that the first step would create are created first (`materialize_state`), so that a
    never-stepped optimizer's state dict has every entry a loaded one must fill."""
    rows.refuse_tensor_parallel("optimizer.state_dict()")
    opt.materialize_state()
    pid_of, pid_of_name = _pid_of(opt)
    scaler = {SCALER_PREFIX + k: torch.tensor(float(v)) for k, v in opt.scaler.state_dict().items()} \
        if opt.config.uses_loss_scaling else {}
    state: dict = {}
    for gi, (group, (keys, scalars)) in enumerate(zip(opt.shards, _agreed_states(opt))):
        for shard in group:
            st = shard.storage
            for key in keys:
                values = _local_values(rows, shard, _piece_tensors(opt, shard, key), opt.comm.device)
                for i in st.indices:
                    state.setdefault(pid_of_name[st.names[i]], {})[key] = rows.wrap(
                        values[i].clone(), st.layout.slots[i].shape)
            for i in st.indices:
                entry = state.setdefault(pid_of_name[st.names[i]], {})
                for k, v in scalars.items():
                    entry[k] = torch.tensor(v, dtype=torch.float32) if isinstance(v, float) else v
                entry.update(scaler)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [pid_of[id(p)] for p in g["params"]]}
              for g in opt.param_groups]
    return {"state": {k: v for k, v in sorted(state.items()) if v}, "param_groups": groups}


def _check_structure(opt, sd) -> None:
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("an optimizer state dict is a dict with 'state' and 'param_groups' (what "
                         "optimizer.state_dict() returns); got " + type(sd).__name__)
    ours, theirs = opt.param_groups, sd["param_groups"]
    if len(ours) != len(theirs) or any(len(a["params"]) != len(b["params"]) for a, b in zip(ours, theirs)):
        raise ValueError(f"the state dict's param groups hold {[len(g['params']) for g in theirs]} parameters, "
                         f"this optimizer's {[len(g['params']) for g in ours]}: load a state dict of the same "
                         f"model and param groups")


def _plan_load(opt, sd: dict, rows: RowSharding) -> tuple[list, list, dict]:
    """Check `sd` against this optimizer; (what to write, each group's scalar states, the
    loss scaler's state). Raises, changing nothing, when anything is missing or mis-shaped."""
    _check_structure(opt, sd)
    _, pid_of_name = _pid_of(opt)
    entries = {pid_of_name.get(k, k) if isinstance(k, str) else k: v for k, v in sd["state"].items()}
    plan, scalars_out = [], []
    for group, (keys, scalars) in zip(opt.shards, _agreed_states(opt)):
        names = [st.names[i] for st in (s.storage for s in group) for i in st.indices]
        first = entries.get(pid_of_name[names[0]], {}) if names else {}
        scalars_out.append({k: float(first[k]) if torch.is_tensor(first[k]) else first[k]
                            for k in scalars if k in first})
        for shard in group:
            st = shard.storage
            for key in keys:
                found = {}
                for i in st.indices:
                    entry = entries.get(pid_of_name[st.names[i]], {})
                    if key not in entry:
                        if key == MASTER:
                            break  # saved in fp32: the master restarts from the model's weights
                        raise ValueError(f"the optimizer state dict has no {key!r} for {st.names[i]}: load a state "
                                         f"dict saved from the same optimizer")
                    found[i] = rows.unwrap(entry[key], st.layout.slots[i].shape, f"{st.names[i]}.{key}")
                else:
                    plan.append((shard, key, found))
    first_entry = next(iter(entries.values()), {})
    scaler = {k[len(SCALER_PREFIX):]: float(v) for k, v in first_entry.items() if k.startswith(SCALER_PREFIX)}
    return plan, scalars_out, scaler


@torch.no_grad()
def load_sharded_state_dict(opt, sd: dict, rows: RowSharding) -> None:
    """Restore what `sharded_state_dict` returned (or its full form), then publish the
    parameters. A bad state dict raises on every rank (they compare notes first), before
    anything changes."""
    rows.refuse_tensor_parallel("optimizer.load_state_dict()")
    opt.materialize_state()
    plan, problem = None, None
    try:
        plan = _plan_load(opt, sd, rows)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        problem = e
    raise_if_any_failed(opt.comm, problem, "optimizer.load_state_dict", "checkpoint")
    writes, scalars, scaler = plan
    _restore_hyperparameters(opt, sd["param_groups"])
    for shard, key, found in writes:
        _write_values(rows, shard, _piece_tensors(opt, shard, key), found, opt.comm.device)
    opt.load_scalar_states(scalars)
    if scaler and opt.config.uses_loss_scaling:
        opt.scaler.load_state_dict(scaler)
    opt.sync_params_from_master("checkpoint")


def _write_values(rows: RowSharding, shard, tensors: list[torch.Tensor], found: dict, device) -> None:
    st = shard.storage
    layout, pieces = st.layout, st.owned_pieces()
    dtype = tensors[0].dtype if tensors else torch.float32
    if rows.sharded:
        local = rows.into_shard(layout, found, st.collectives, dtype, device)
        for p, t in zip(pieces, tensors):
            t.view(-1).copy_(local[p.shard_start: p.shard_start + p.numel])
        return
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    for i, (_, v) in found.items():
        slot = layout.slots[i]
        flat[slot.offset: slot.offset + slot.numel].copy_(v)
    for p, t in zip(pieces, tensors):
        t.view(-1).copy_(flat[p.flat_start: p.flat_start + p.numel])


def _restore_hyperparameters(opt, saved: list) -> None:
    for group, values in zip(opt.param_groups, saved):
        for k, v in values.items():
            if k == "params":
                continue
            if torch.is_tensor(group.get(k)):
                group[k].fill_(v)
            else:
                group[k] = v
