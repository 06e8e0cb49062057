"""The optimizer's state by parameter: `owned_slices` (what zerodp's own checkpoints read and
write) and `ZeroOptimizer.state_dict()` / `load_state_dict()`, torch's form, sharded.

The form is torch's own: {"state": {i: {name: value}}, "param_groups": [{..., "params":
[i, ...]}]}, where i numbers the model's trainable parameters in param-group order (what
`optimizer.param_groups` lists), so `torch.distributed.checkpoint.state_dict` maps them to
the model's names as for any optimizer. Each per-element state (Adam's exp_avg, ...) has its
parameter's full shape, a DTensor holding this rank's rows ([Note: row shards] in
sharding/rows.py); scalar states (Adam's step) are plain. As in torch's, a parameter has
states once a step updated it: none before the first step, none for a parameter no step
has reached. Under bf16/fp16 each parameter also has "master": its fp32 master weights,
which the compute-dtype model state dict rounds; loading restores them exactly. Loading
accepts the same DTensors or full tensors (from a full state dict), at any world size and
stage, and leaves the optimizer with the dict's states, as torch's does. Under tensor
parallelism the DTensors have the original's shape on the (tp, shard) mesh ([Note: row
shards] in sharding/rows.py), so they load at any tensor-parallel size too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from ..distributed.agreement import raise_if_any_failed
from ..memory.ledger import is_elementwise_state, scalar_state
from ..sharding.rows import RowSharding, gather_runs
from .master import piece_runs

__all__ = ["MASTER", "OwnedSlice", "owned_slices", "sharded_state_dict", "load_sharded_state_dict"]

MASTER = "master"  # the fp32 master weights' key under mixed precision
# Under fp16 the loss scaler travels as scalar states of every parameter: torch's checkpoint
# helpers keep only "state" and "param_groups" of an optimizer state dict.
SCALER_PREFIX = "loss_scaler."


@dataclass
class OwnedSlice:
    """Elements [start, start+numel) of one flattened parameter that this rank owns, with
    views of its compute value, fp32 master and per-element optimizer states. The master
    and states are read and written through `read`/`write`, which go through their
    placement ([Note: master placement] in master.py): they may live in host memory or a file."""

    name: str
    shape: tuple
    group: int
    start: int
    numel: int
    param: torch.Tensor
    master: torch.Tensor
    states: dict
    placement: object = None

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """The master or one of the states, as a CPU tensor for a checkpoint."""
        return self.placement.read(tensor)

    def write(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """Values from a checkpoint (CPU, fp32) into the master or one of the states."""
        self.placement.write(tensor, value)


def owned_slices(shards: list, state: dict) -> list[OwnedSlice]:
    """Every run of parameter elements this rank owns, by parameter name, in `shards` (per
    param group, the master shards) with their optimizer `state`; independent of the world
    size and stage, so a checkpoint written from it can be read by any other."""
    out = []
    for gi, group in enumerate(shards):
        for shard in group:
            st = shard.storage
            params, pieces = st.owned_params(), st.owned_pieces()
            for pi, si, a, b in piece_runs(st):
                master_t, slot = shard.master_tensors[pi], st.layout.slots[si]
                states = {k: v.reshape(-1)[a:b] for k, v in state.get(master_t, {}).items()
                          if is_elementwise_state(v, master_t)}
                out.append(OwnedSlice(
                    name=st.names[si], shape=slot.shape, group=gi, start=pieces[pi].flat_start + a - slot.offset,
                    numel=b - a, param=params[pi].reshape(-1)[a:b], master=master_t.reshape(-1)[a:b], states=states,
                    placement=shard.placement))
    return out


def _pid_of(opt) -> tuple[dict, dict]:
    """id(parameter) -> its number in the state dict, and name -> number."""
    params = list(chain.from_iterable(g["params"] for g in opt.param_groups))
    pid = {id(p): i for i, p in enumerate(params)}
    return pid, {n: pid[id(p)] for n, p in opt.trainable}


@dataclass
class _GroupStates:
    """One param group's states as every rank agrees on them: the per-element state names
    (with their dtypes), and each parameter that has states, with its scalar states."""

    dtypes: dict = field(default_factory=dict)  # state name -> dtype name
    params: dict = field(default_factory=dict)  # parameter name -> {scalar state: value}


def _local_states(opt, group) -> _GroupStates:
    out = _GroupStates()
    for shard in group:
        st = shard.storage
        for pi, si, _, _ in piece_runs(st):
            t = shard.master_tensors[pi]
            state = opt.stepper.inner.state.get(t)
            if not state:
                continue
            scalars = out.params.setdefault(st.names[si], {})
            for k, v in state.items():
                if is_elementwise_state(v, t):
                    out.dtypes[k] = str(v.dtype).removeprefix("torch.")
                else:
                    scalars.setdefault(k, scalar_state(k, v, t, st.names[si]))
    return out


def _agreed_states(opt) -> list[_GroupStates]:
    """Per param group, what `_GroupStates` says. A rank may own no element of a parameter
    (at stage 3, a few norm weights) and then holds none of its states; the ranks pool what
    they hold (one small exchange), so every rank runs the same collectives and writes the
    same entries."""
    local = [_local_states(opt, group) for group in opt.stepper.shards]
    if opt.comm.world_size == 1 or not opt.rows.sharded:  # every rank holds every state (stage 0): local
        return local
    pooled = opt.comm.all_gather_object([(g.dtypes, g.params) for g in local], "checkpoint",
                                        label="optimizer state names")
    out = []
    for gi in range(len(local)):
        agreed = _GroupStates()
        for rank in pooled:
            dtypes, params = rank[gi]
            agreed.dtypes.update(dtypes)
            for name, scalars in params.items():
                agreed.params.setdefault(name, {}).update(scalars)
        out.append(agreed)
    return out


def _master_key(opt) -> list[str]:
    # In fp32 the parameters are the master's values (an offloaded master is a copy of
    # them), so the state dict has no master: the same whatever the placement.
    return [] if opt.config.compute_dtype == torch.float32 else [MASTER]


def _piece_tensors(opt, shard, key: str) -> list:
    """Each owned piece's tensor of `key` (None where the piece has no such state)."""
    if key == MASTER:
        return shard.master_tensors
    return [opt.stepper.inner.state.get(t, {}).get(key) for t in shard.master_tensors]


def _local_values(rows: RowSharding, shard, tensors: list, dtype: torch.dtype, device) -> dict[int, torch.Tensor]:
    """Slot index -> this rank's rows of that parameter (flat), for one storage's state
    (zero where a piece has none)."""
    st = shard.storage
    layout, pieces = st.layout, st.owned_pieces()
    sharded = rows.sharded
    local = torch.zeros(layout.shard_numel if sharded else layout.padded_numel, dtype=dtype, device=device)
    for p, t in zip(pieces, tensors):
        if t is not None:
            at = p.shard_start if sharded else p.flat_start
            local[at: at + p.numel].copy_(t.reshape(-1))
    if sharded:
        wanted = {i: rows.range_of(layout.slots[i].shape, st.names[i]) for i in st.indices}
        return gather_runs(layout, local, st.collectives, wanted, "checkpoint")
    return {i: local[layout.slots[i].offset: layout.slots[i].offset + layout.slots[i].numel] for i in st.indices}


def _scalar(v):
    return torch.tensor(v, dtype=torch.float32) if isinstance(v, float) else v


@torch.no_grad()
def sharded_state_dict(opt, rows: RowSharding) -> dict:
    """The optimizer's state dict, as the module docstring describes (collective). Like
    torch's, it creates nothing: before the first step it holds no state (under bf16/fp16
    the master only). torch DCP's `get_state_dict` has the states created first, by a step
    at learning rate 0 (`ZeroOptimizer._is_state_probe`), as on any torch optimizer."""
    pid_of, pid_of_name = _pid_of(opt)
    scaler = {SCALER_PREFIX + k: torch.tensor(float(v)) for k, v in opt.guard.scaler.state_dict().items()} \
        if opt.config.uses_loss_scaling else {}
    state: dict = {}
    for group, agreed in zip(opt.stepper.shards, _agreed_states(opt)):
        keys = [(k, getattr(torch, d)) for k, d in sorted(agreed.dtypes.items())] + \
               [(k, torch.float32) for k in _master_key(opt)]
        for shard in group:
            st = shard.storage
            cut = rows.of_storage(st.names)
            for key, dtype in keys:
                values = _local_values(cut, shard, _piece_tensors(opt, shard, key), dtype, opt.comm.device)
                for i in st.indices:
                    if key == MASTER or st.names[i] in agreed.params:
                        state.setdefault(pid_of_name[st.names[i]], {})[key] = cut.wrap(
                            values[i].clone(), st.layout.slots[i].shape, st.names[i])
            for i in st.indices:
                scalars = agreed.params.get(st.names[i])
                if scalars is not None:
                    state.setdefault(pid_of_name[st.names[i]], {}).update({k: _scalar(v) for k, v in scalars.items()})
                if scaler:
                    state.setdefault(pid_of_name[st.names[i]], {}).update(scaler)
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
    if not isinstance(sd["state"], dict) or not all(isinstance(v, dict) for v in sd["state"].values()):
        raise ValueError("the optimizer state dict's 'state' must map each parameter to a dict of its states")


def _has_states(entry: dict) -> bool:
    """Whether a parameter's entry holds optimizer states, not only the master or the loss
    scaler (a parameter no step has reached yet)."""
    return any(k != MASTER and not str(k).startswith(SCALER_PREFIX) for k in entry)


@dataclass
class _Plan:
    """What a checked state dict writes: (shard, key, dtype, {slot: unwrapped value}) per
    state, (master tensor, {scalar state: value}) per owned piece, the master tensors whose
    parameters have no states in the dict, and the loss scaler's state."""

    writes: list
    scalars: list
    dropped: list
    scaler: dict


def _plan_load(opt, sd: dict, rows: RowSharding) -> _Plan:
    """Check `sd` against this optimizer, whose states exist for every parameter the dict
    has states of; raises, changing nothing, when anything is missing or mis-shaped."""
    _, pid_of_name = _pid_of(opt)
    entries = {pid_of_name.get(k, k) if isinstance(k, str) else k: v for k, v in sd["state"].items()}
    plan = _Plan([], [], [], {})
    for group, agreed in zip(opt.stepper.shards, _agreed_states(opt)):
        scalar_keys = {k for scalars in agreed.params.values() for k in scalars}
        keys = [(k, getattr(torch, d)) for k, d in sorted(agreed.dtypes.items())] + \
               [(k, torch.float32) for k in _master_key(opt)]
        for shard in group:
            st = shard.storage
            entry_of = {i: entries.get(pid_of_name[st.names[i]], {}) for i in st.indices}
            stateful = {i for i, e in entry_of.items() if _has_states(e)}
            for key, dtype in keys:
                found = {}
                for i in (st.indices if key == MASTER else sorted(stateful)):
                    if key not in entry_of[i]:
                        if key == MASTER:
                            continue  # saved in fp32: the master restarts from the model's weights
                        raise ValueError(f"the optimizer state dict has no {key!r} for {st.names[i]}: load a state "
                                         f"dict saved from the same optimizer")
                    found[i] = rows.of(st.names[i]).unwrap(entry_of[i][key], st.layout.slots[i].shape,
                                                           f"{st.names[i]}.{key}", st.names[i])
                if found:
                    plan.writes.append((shard, key, dtype, found))
            kept = set()
            for pi, si, _, _ in piece_runs(st):
                if si in stateful:
                    kept.add(pi)
                    values = {k: float(v) if torch.is_tensor(v) else v for k, v in entry_of[si].items()
                              if k in scalar_keys}
                    plan.scalars.append((shard.master_tensors[pi], values))
            plan.dropped += [t for pi, t in enumerate(shard.master_tensors) if pi not in kept]
    first_entry = next(iter(entries.values()), {})
    plan.scaler = {k[len(SCALER_PREFIX):]: float(v) for k, v in first_entry.items()
                   if str(k).startswith(SCALER_PREFIX)}
    return plan


@torch.no_grad()
def load_sharded_state_dict(opt, sd: dict, rows: RowSharding) -> None:
    """Restore what `sharded_state_dict` returned (or its full form), then publish the
    parameters. As torch's, the optimizer's states become the dict's: a parameter without
    states in it has none after (a dict saved before the first step leaves none at all, and
    the next step is a first step). A bad state dict raises on every rank (they compare
    notes first), before anything changes."""
    problem = None
    try:
        _check_structure(opt, sd)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        problem = e
    raise_if_any_failed(opt.comm, problem, "optimizer.load_state_dict", "checkpoint")
    had = {id(t) for shard in opt.stepper.all_shards() for t in shard.master_tensors if opt.stepper.inner.state.get(t)}
    if any(_has_states(entry) for entry in sd["state"].values()):
        opt.materialize_state()  # the tensors the dict fills, as the first step creates them
    plan = None
    try:
        plan = _plan_load(opt, sd, rows)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        problem = e
    try:
        raise_if_any_failed(opt.comm, problem, "optimizer.load_state_dict", "checkpoint")
    except Exception:
        opt.stepper.drop_states([t for shard in opt.stepper.all_shards() for t in shard.master_tensors if id(t) not in had])
        raise
    _apply(opt, sd, plan, rows)


def _apply(opt, sd: dict, plan: _Plan, rows: RowSharding) -> None:
    _restore_hyperparameters(opt, sd["param_groups"])
    opt.stepper.drop_states(plan.dropped)
    state = opt.stepper.inner.state
    for shard, key, dtype, found in plan.writes:
        _write_values(rows, shard, _piece_tensors(opt, shard, key), found, dtype, opt.comm.device)
        if key == MASTER:
            shard.restored = True
    for t, values in plan.scalars:
        for k, v in values.items():
            if torch.is_tensor(state[t].get(k)):
                state[t][k].fill_(v)
            else:
                state[t][k] = v
    if plan.scaler and opt.config.uses_loss_scaling:
        opt.guard.scaler.load_state_dict(plan.scaler)
    opt.sync_params_from_master("checkpoint")


def _write_values(rows: RowSharding, shard, tensors: list, found: dict, dtype: torch.dtype, device) -> None:
    """The values of `found`'s parameters into this rank's pieces of them (other
    parameters' elements of the same pieces untouched); collective when they are rows,
    with the same slots and dtype on every rank."""
    st = shard.storage
    layout, pieces = st.layout, st.owned_pieces()
    rows = rows.of_storage(st.names)
    if rows.sharded:
        local = rows.into_shard(layout, found, st.collectives, dtype, device)
        base = [p.shard_start for p in pieces]
    else:
        local = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        for i, (_, v) in found.items():
            slot = layout.slots[i]
            local[slot.offset: slot.offset + slot.numel].copy_(v)
        base = [p.flat_start for p in pieces]
    for pi, si, a, b in piece_runs(st):
        if si in found:
            tensors[pi].view(-1)[a:b].copy_(local[base[pi] + a: base[pi] + b])


def _restore_hyperparameters(opt, saved: list) -> None:
    for group, values in zip(opt.param_groups, saved):
        for k, v in values.items():
            if k == "params":
                continue
            if torch.is_tensor(group.get(k)):
                group[k].fill_(v)
            else:
                group[k] = v
