"""Turn a prepared model's trainable parameters into sharded storage: flat param groups
(stages 0-2) or stage-3 units. What comes out is what the schedule drives and the
optimizer steps; nothing here installs a hook or knows the optimizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch.nn as nn

from ..policies import OffloadPolicy, PrecisionPolicy, UnitPolicy, ZeroPPPolicy
from ..distributed import Comm
from ..memory import hostmem
from ..memory.diskmem import Arena
from ..memory.layout import FlatLayout
from ..memory.placement import Placement, open_placement
from ..memory.pool import BufferPool
from .flat_group import FlatParamGroup
from ..distributed.quantized import QuantizedCollectives
from .flat_unit import ONE_SEGMENT, FlatUnit, SecondaryPartition, UnitGroupView
from .frozen import frozen_dtype
from .meta_init import check_same_initialisation, default_device, has_meta, materialize
from .prepare import apply_compute_dtype, replicate_from_rank0
from .units import assign_params, encloses, select_units

__all__ = ["ExpertShards", "FlatGroups", "ShardedUnits", "flatten_groups", "shard_units"]


@dataclass(frozen=True)
class ExpertShards:
    """Expert parallelism's banks ([Note: expert-parallel axes] in distributed/topology.py):
    sharded over `comm`, the expert-data-parallel ranks, in flat groups (stages 1-2) or units
    (stage 3) of their own, their gradients averaged over all `data_size` data-parallel ranks
    (each rank's bank gradient already holds its expert-parallel group's tokens: docs/moe.md)."""

    param_ids: frozenset  # id() of every bank parameter (this rank's experts)
    modules: tuple  # the experts modules, each a stage-3 unit
    comm: Comm
    data_size: int


@dataclass(frozen=True)
class FlatGroups:
    """Stages 0-2: one flat group per optimizer param group."""

    groups: list  # FlatParamGroup per param group (with expert parallelism, its banks' another)
    backward_order: dict  # id(parameter) -> expected rank among backward's finished parameters
    storages: list  # per param group: its flat groups


@dataclass(frozen=True)
class ShardedUnits:
    """Stage 3: the units, each param group's parts of them, and the trainable parameters
    as they are after materialisation (name, parameter)."""

    units: list  # FlatUnit, the root last
    group_views: list  # per param group: the UnitGroupViews of the units it has parameters in
    trainable: list
    pool: BufferPool
    secondary_pool: BufferPool  # hpZ's node-sharded copies (empty without it)
    placement: Placement  # where the units' shards live (Config.offload_params)


def flatten_groups(model: nn.Module, named: list, group_indices: list[list[int]], comm: Comm, stage: int,
                   precision: PrecisionPolicy, bucket_bytes: int, whole: Sequence[bool] = (),
                   experts: Optional[ExpertShards] = None) -> FlatGroups:
    """Replicate the model from rank 0, cast what stays replicated, and lay out each param
    group's parameters in one flat buffer; those flagged in `whole` (per entry of `named`)
    each inside one rank's chunk ([Note: whole-parameter alignment] in memory/layout.py).
    With `experts`, each group's banks go to a flat group of their own over their ranks."""
    trainable = {id(p) for _, p in named}
    # Trainable ones too: they are flattened next; the banks were replicated before their split.
    replicate_from_rank0(model, comm, skip=set(experts.param_ids) if experts is not None else set())
    apply_compute_dtype(model, precision.compute_dtype, skip=trainable, cast_buffers=precision.cast_buffers)
    # Backward finishes parameters roughly in reverse registration order; laying each group
    # out in that order lets its buckets fill one after another.
    backward_order = {id(p): len(named) - 1 - i for i, (_, p) in enumerate(named)}
    groups, storages = [], []
    for idx in group_indices:
        idx = sorted(idx, reverse=True)
        parts = [(comm, idx)]
        if experts is not None:  # the banks in a flat group of their own, over their ranks
            parts = [(comm, [i for i in idx if id(named[i][1]) not in experts.param_ids]),
                     (experts.comm, [i for i in idx if id(named[i][1]) in experts.param_ids])]
        mine = []
        for over, part in parts:
            if part or experts is None:
                mine.append(FlatParamGroup([named[i][1] for i in part], [named[i][0] for i in part], over, stage,
                                           precision.compute_dtype, precision.reduce_dtype, bucket_bytes,
                                           [whole[i] for i in part] if whole else ()))
        groups += mine
        storages.append(mine)
    return FlatGroups(groups, backward_order, storages)


@dataclass(frozen=True)
class _UnitBuild:
    """What building the units needs besides the model: the Config's parts."""

    comm: Comm
    precision: PrecisionPolicy
    zeropp: ZeroPPPolicy
    placement: Placement
    whole: list  # per trainable parameter: stepped whole ([Note: whole-parameter alignment])
    experts: Optional[ExpertShards] = None


def shard_units(model: nn.Module, named: list, group_indices: list[list[int]], comm: Comm, units_policy: UnitPolicy,
                precision: PrecisionPolicy, offload: OffloadPolicy, zeropp: ZeroPPPolicy,
                whole: Sequence[bool] = (), experts: Optional[ExpertShards] = None) -> ShardedUnits:
    """Split `model` into units and shard each unit's parameters, trainable ones (`named`)
    and frozen ones ([Note: frozen parameters] in frozen.py). A model built
    under `zerodp.init` is materialised unit by unit, each sharded as soon as it is whole.
    Their shards live where Config.offload_params says (`ShardedUnits.placement`): a
    directory opened here is closed again if anything fails. `whole`: as for `flatten_groups`.
    With `experts`, each experts module is a unit of its own, over the banks' ranks."""
    whole = list(whole) if whole else [False] * len(named)
    # Offloaded shards leave a sharded parameter's device on the host: a model that moves its
    # ids to the embedding weight's device before calling it (Llama 4) needs it gathered there.
    units = select_units(model, units_policy.unit_modules, units_policy.unit_min_params,
                         embedding_unit=offload.params == "none")
    if experts is not None:
        units = _with_expert_units(model, units, experts)
    trainable = {id(p) for _, p in named}
    frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in trainable]
    everything = named + frozen  # index < len(named): trainable
    assignment = assign_params(model, units, everything)
    # A unit with no parameter is not built, except the root, whose hooks begin
    # and end every pass (it may own none: `unit_modules=(nn.Linear,)` leaves it nothing).
    to_build = [ui for ui, idx in enumerate(assignment) if idx or ui == len(units) - 1]
    placement = shard_placement(offload, precision, comm,
                                [[everything[i][1] for i in assignment[ui]] for ui in to_build],
                                [[i >= len(named) for i in assignment[ui]] for ui in to_build],
                                [[whole[i] for i in assignment[ui] if i < len(named)] for ui in to_build])
    try:
        return _shard_units(model, everything, len(named), group_indices,
                            _UnitBuild(comm, precision, zeropp, placement, whole, experts), units, assignment,
                            to_build)
    except BaseException:
        placement.close()  # the directory can be used again at once
        raise


def _shard_units(model: nn.Module, everything: list, n_trainable: int, group_indices: list[list[int]],
                 build_with: _UnitBuild, units: list, assignment: list, to_build: list) -> ShardedUnits:
    comm, precision, placement = build_with.comm, build_with.precision, build_with.placement
    names = [n for n, _ in everything]
    unit_of = {i: ui for ui, idx in enumerate(assignment) for i in idx}
    remaining = [len(idx) for idx in assignment]
    current = {i: p for i, (_, p) in enumerate(everything)}
    built: dict[int, FlatUnit] = {}
    pool, secondary_pool = BufferPool(), BufferPool()
    transfer = training_collectives(comm, build_with.zeropp)
    secondary = SecondaryPartition(comm.collectives("node"), secondary_pool) if build_with.zeropp.hpz else None
    # A model born on the meta device is initialised identically on every rank from the
    # seed (meta_init.py), so its units need no broadcast from rank 0.
    born_sharded = has_meta(model)

    experts = build_with.experts
    expert_modules = {id(m) for _, m in experts.modules} if experts is not None else set()

    def build(ui: int) -> None:
        idx = [i for i in assignment[ui] if i < n_trainable]
        frozen = tuple((names[i], current[i]) for i in assignment[ui] if i >= n_trainable)
        bank = id(units[ui][1]) in expert_modules  # gathered and reduced over the banks' ranks
        built[ui] = FlatUnit(units[ui][0], units[ui][1], [current[i] for i in idx], [names[i] for i in idx],
                             experts.comm if bank else comm, precision.compute_dtype, precision.reduce_dtype, pool,
                             sync_from_rank0=not born_sharded,
                             transfer=experts.comm.collectives("shard") if bank else transfer,
                             secondary=None if bank else secondary, placement=placement, frozen=frozen,
                             whole=[build_with.whole[i] for i in idx],
                             grad_divisor=experts.data_size if bank else None)
        if built[ui].device.type == "cpu":  # the unit's full copies were just freed: [Note: long-lived host buffers]
            hostmem.release_free_heap()

    if born_sharded:
        old_index = {id(p): i for i, (_, p) in enumerate(everything)}

        def on_param(old, new):
            i = old_index.get(id(old))
            if i is None:
                return
            current[i] = new
            ui = unit_of[i]
            remaining[ui] -= 1
            if remaining[ui] == 0 and ui != len(units) - 1:
                build(ui)  # shard as soon as the unit is complete, freeing its full copy
        materialize(model, default_device(), on_param)
    for ui in to_build:
        if ui not in built:
            build(ui)
    flat_units = [built[ui] for ui in sorted(built)]
    root = units[-1][1]
    if born_sharded:
        check_same_initialisation(flat_units, comm)
    for u in flat_units:
        u.outer = any(v is not u and encloses(u.name if u.module is not root else "", v.name) for v in flat_units)
    sharded = {id(p) for u in flat_units for p in u.all_params()}
    replicate_from_rank0(model, comm, skip=sharded)  # the units broadcast their own
    apply_compute_dtype(model, precision.compute_dtype, skip=sharded, cast_buffers=precision.cast_buffers)
    name_index = {n: i for i, n in enumerate(names)}
    group_views = []
    for idx in group_indices:
        chosen = set(idx)
        views = []
        for u in flat_units:
            local = [k for k in range(len(u.params)) if name_index[u.names[k]] in chosen]
            if local:
                views.append(UnitGroupView(u, local))
        group_views.append(views)
    return ShardedUnits(flat_units, group_views, [(n, current[i]) for i, n in enumerate(names[:n_trainable])], pool,
                        secondary_pool, placement)


def _with_expert_units(model: nn.Module, units: list, experts: ExpertShards) -> list:
    """`units` with each experts module a unit of its own, in the model's module order,
    the root last."""
    chosen = {id(m) for _, m in units}
    extra = {id(m): (n, m) for n, m in experts.modules if id(m) not in chosen}
    order = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    inner = sorted([u for u in units[:-1]] + list(extra.values()), key=lambda u: order[id(u[1])])
    return inner + [units[-1]]


def shard_placement(offload: OffloadPolicy, precision: PrecisionPolicy, comm: Comm, unit_params: list,
                    unit_frozen: list, unit_whole: list = ()) -> Placement:
    """Where the units' shards live (Config.offload_params; [Note: placement] in
    memory/placement.py). On disk, the parameter, gradient and frozen shards of every unit
    to be built (`unit_params`: each one's parameters; `unit_frozen`: which are frozen) are
    reserved now, so that a disk too small fails here, on every rank, before any unit is built."""
    if offload.params != "disk":
        return open_placement(offload.params, comm)
    # The layout each unit is built with: a unit with no parameter still keeps a shard of
    # one element per rank (its layout is padded to the shard size), as FlatUnit lays it out.
    numels, frozen_shards = [], []
    unit_whole = unit_whole or [()] * len(unit_params)
    for params, frozen, w in zip(unit_params, unit_frozen, unit_whole):
        numels.append(FlatLayout([p.shape for p, f in zip(params, frozen) if not f], comm.shard_size,
                                 ONE_SEGMENT, w).shard_numel)
        by_dtype: dict = {}
        for p, f in zip(params, frozen):
            if f:
                by_dtype.setdefault(frozen_dtype(p, precision.compute_dtype), []).append(p.shape)
        frozen_shards += [(FlatLayout(shapes, comm.shard_size, ONE_SEGMENT).shard_numel, dtype)
                          for dtype, shapes in by_dtype.items()]
    reserve = [(purpose, Arena.nbytes_for([(n, dtype) for n in numels]))
               for purpose, dtype in (("params", precision.compute_dtype), ("grads", precision.reduce_dtype))]
    if frozen_shards:
        reserve.append(("frozen", Arena.nbytes_for(frozen_shards)))
    return open_placement("disk", comm, offload.directory, reserve=reserve,
                          what="placing the parameter shards (Config.offload_params='disk')")


def training_collectives(comm: Comm, zeropp: ZeroPPPolicy):
    """The strategy of stage 3's training gathers and reduce-scatters: ZeRO++'s quantized
    one where Config asks for qwZ or qgZ ([Note: blockwise quantization] in
    distributed/quantized.py), else the shard axis's own."""
    exact = comm.collectives("shard")
    if not zeropp.quantized:
        return exact
    hierarchical = zeropp.grad_bits is not None
    return QuantizedCollectives(exact, zeropp.weight_bits, zeropp.grad_bits,
                                zeropp.block_size, comm.collectives("node") if hierarchical else None,
                                comm.collectives("cross_node") if hierarchical else None)
