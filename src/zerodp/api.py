"""`initialize`: turn a model and an optimizer into their ZeRO counterparts, in place.

The layers meet here, once: the config gives the topology (distributed/), the model is
prepared and sharded (sharding/), a schedule drives its backward (schedule/), the sharded
optimizer steps it (optim/), and every collective goes through the comm (distributed/).
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .checkpoint.full_state import install_save_pretrained
from .config import Config
from .config_world import WorldFacts, check_world
from .distributed import Comm, Topology
from .distributed.agreement import check_ranks_agree, describe
from .expert_parallel import ExpertParallelModel, apply_expert_parallel
from .expert_parallel.plan import ep_plan_of
from .peft_guard import refuse_in_place_merges
from .optim import ZeroOptimizer
from .optim.optimizer import ShardedModel
from .optim.inner import (OptimizerSpec, build_optimizer, check_elementwise, grouped_params, take_carried_state,
                          whole_param_flags)
from .schedule.base import eager_hook
from .sequence_parallel import apply_sequence_parallel, apply_tiled_loss, apply_tiled_mlp
from .sequence_parallel import check_model as check_sequence_parallel_model
from .schedule.compile import compile_forwards, drop_training_cache
from .schedule.reducer import GradReducer
from .schedule.stage3 import Stage3Engine
from .sharding.model_state import install_state_dict_hooks, install_whole_load_hook
from .sharding.meta_init import default_device, has_meta, materialize
from .sharding.prepare import check_param_dtypes
from .sharding.shard import ExpertShards, flatten_groups, shard_units
from .tensor_parallel import parallelize
from .tensor_parallel.plan import plan_of

log = logging.getLogger(__name__)

__all__ = ["initialize"]

# Models already turned into flat shards; weak, so models die normally.
_INITIALIZED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _build_and_describe(model: nn.Module, optimizer: OptimizerSpec, config: Config, named: list,
                        optimizer_kwargs: dict) -> tuple:
    """Everything initialize checks on its own before the ranks compare notes: the user's
    optimizer, its param groups, and the description every rank must share."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError(f"model is wrapped in {type(model).__name__}: zerodp replaces it; pass the plain module "
                        f"(model.module) to zerodp.initialize")
    if model in _INITIALIZED:
        raise RuntimeError(f"this {type(model).__name__} was already passed to zerodp.initialize: its parameters are "
                           f"already flat shards. Keep the model and optimizer it returned, or build a new model")
    if not named:
        raise ValueError(f"{type(model).__name__} has no trainable parameters (none with requires_grad=True): "
                         f"there is nothing for zerodp to shard or train")
    check_param_dtypes(named, config.precision)
    if config.expert_parallel_size > 1 and has_meta(model):
        raise ValueError(f"Config.expert_parallel_size={config.expert_parallel_size}: the model was built on the "
                         f"meta device (zerodp.init), and its expert banks are split from rank 0's whole values: "
                         f"build the model on a device")
    devices = {p.device for _, p in named}
    if len(devices) != 1:
        raise ValueError(f"trainable parameters lie on several devices {sorted(map(str, devices))}: "
                         f"move the model to one device before zerodp.initialize")
    inner = build_optimizer(optimizer, [p for _, p in named], optimizer_kwargs)
    if hasattr(inner.step, "_wrapped_by_lr_sched"):  # torch's LRScheduler marks the step it wraps
        raise ValueError(f"an LR scheduler was built on this {type(inner).__name__} before zerodp.initialize; "
                         f"it would drive the optimizer zerodp wraps, not the one it returns. Build the "
                         f"scheduler on the optimizer zerodp.initialize returns")
    groups = grouped_params(inner, named)
    carried = take_carried_state(inner)  # [Note: the script's own optimizer] in optim/inner.py
    described = describe(model, inner, config)
    # Ranks that split different modules, or the same ones another way, build layers whose
    # collectives do not pair: the first forward would wait out the collective timeout.
    if config.tensor_parallel_size > 1:
        described["tensor-parallel plan (module pattern, style)"] = list(plan_of(model).items())
    if config.expert_parallel_size > 1:  # as above: ranks that split other banks would not pair their exchanges
        described["expert-parallel plan (name pattern, style)"] = list(ep_plan_of(model).items())
    if config.sequence_parallel_size > 1:  # before any rank installs an attention the others would refuse
        check_sequence_parallel_model(model, config.sequence_parallel_size)
    described["optimizer state carried in"] = carried is not None  # loading it is collective
    return inner, groups, described, carried


class RefuseDDP:
    """Stands as a zerodp model's `_ddp_params_and_buffers_to_ignore`, the names
    DistributedDataParallel's constructor reads from its module, first and before any
    collective (`set(module._ddp_params_and_buffers_to_ignore)`). A wrapper that puts the model
    in DDP on its own (accelerate's `Accelerator.prepare`, which zerodp cannot change) then
    raises on every rank instead of reducing every gradient a second time."""

    def __init__(self, model_name: str):
        self.model_name = model_name

    def __iter__(self):
        raise TypeError(
            f"this {self.model_name} was passed to zerodp.initialize, which reduces and shards its gradients "
            f"itself: DistributedDataParallel must not wrap it (it would reduce them again). With Hugging Face "
            f"Accelerate use `from zerodp.integrations.accelerate import Accelerator` (Accelerator(..., "
            f"zerodp_config=zerodp.Config(...)), which prepares the plain model and shards it itself); with the "
            f"Trainer, zerodp.integrations.hf.Trainer; in a torch loop, use the model zerodp.initialize returns as "
            f"it is")


def install_ddp_accumulation(model: nn.Module, schedule) -> None:
    """DDP's `require_backward_grad_sync` attribute and `no_sync()` context manager on the
    model, read by the root forward ([Note: DDP's accumulation flag] in schedule/base.py);
    and DDP's constructor refused on it (`RefuseDDP`)."""
    model._ddp_params_and_buffers_to_ignore = RefuseDDP(type(model).__name__)
    model.require_backward_grad_sync = True

    @contextlib.contextmanager
    def no_sync():
        """As DDP's: backward passes inside accumulate; the first one outside is the boundary."""
        old = model.require_backward_grad_sync
        model.require_backward_grad_sync = False
        try:
            yield
        finally:
            model.require_backward_grad_sync = old

    model.no_sync = no_sync
    model.register_forward_pre_hook(eager_hook(
        lambda module, args: schedule.note_forward(module.require_backward_grad_sync)
        if torch.is_grad_enabled() else None))


def _split_experts(model: nn.Module, comm: Comm, ep_size: int) -> tuple[Comm, ExpertParallelModel]:
    """The comm with the ``ep`` axis, and the model's banks split over it, their comm over the
    expert-data-parallel ranks beside (the same ledger): [Note: expert-parallel axes]."""
    topology, expert_topology = comm.topology.with_expert_parallel(ep_size)
    comm = Comm(topology=topology, ledger=comm.ledger)
    return comm, apply_expert_parallel(model, comm, Comm(topology=expert_topology, ledger=comm.ledger))


def _world_facts(model: nn.Module, process_group, on_meta: bool) -> WorldFacts:
    """What `check_world` needs to know of this process's world, the same on every rank."""
    distributed = dist.is_available() and dist.is_initialized()
    first = next((p for p in model.parameters() if p.requires_grad), None)
    device = default_device() if first is None or first.device.type == "meta" else first.device
    return WorldFacts.from_environ(world_size=dist.get_world_size(process_group) if distributed else 1,
                                   default_group=process_group is None or process_group == dist.group.WORLD,
                                   device_type=device.type, model_on_meta=on_meta)


def initialize(model: nn.Module, optimizer: OptimizerSpec, config: Union[Config, dict, None] = None, *,
               process_group: Optional[Any] = None, **optimizer_kwargs) -> tuple[nn.Module, ZeroOptimizer]:
    """Shard `model`'s training state across the data-parallel ranks; returns (model, optimizer).

    The model is changed in place and returned: it is used exactly as before (its
    state_dict keeps its own names). `optimizer` is a torch.optim.Optimizer subclass
    (keyword arguments follow), the script's own instance built over the model's parameters
    (its groups, hyperparameters and any state carried over: use the returned optimizer from
    then on), or a callable params -> optimizer; its param groups keep their hyperparameters. Frozen parameters (requires_grad=False) are sharded with their
    unit at stage 3 and replicated at stages 0-2, as the paper defines the stages; they get
    no gradient, master or optimizer state ([Note: frozen parameters] in sharding/frozen.py).
    """
    if config is None:
        config = Config()
    elif isinstance(config, dict):
        config = Config.from_dict(config)
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a zerodp.Config or a dict, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    # What this world cannot run (config_world.py), raised on every rank through the ranks'
    # agreement below; it also resolves replicate_size="nodes", which the agreement compares.
    on_meta, world_problem = has_meta(model), None
    try:
        config = check_world(config, _world_facts(model, process_group, on_meta))
    except Exception as e:  # noqa: BLE001  (re-raised on every rank by check_ranks_agree)
        world_problem = e
    if world_problem is None and config.stage < 3 and on_meta:  # built under zerodp.init: materialise it whole
        materialize(model, default_device(), on_param=lambda old, new: None)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    device = named[0][1].device if named else default_device()
    # The ranks agree on everything (distributed/agreement.py) before any other collective;
    # a rank whose model, optimizer or Config is wrong must not leave the others waiting in
    # that collective: its error travels with it.
    comm_device = default_device() if device.type == "meta" else device
    inner, group_indices, described, carried, problem = None, None, None, None, None
    try:
        comm = Comm(topology=Topology.build(process_group, comm_device, timeout_s=config.collective_timeout_s))
    except Exception as e:  # noqa: BLE001  (zerodp's own group failed: the error goes over the plain one)
        comm, problem = Comm(process_group, device=comm_device), e
    problem = problem or world_problem
    if problem is None:
        try:
            inner, group_indices, described, carried = _build_and_describe(model, optimizer, config, named,
                                                                           optimizer_kwargs)
        except Exception as e:  # noqa: BLE001  (re-raised on this rank by check_ranks_agree)
            problem = e
    try:
        check_ranks_agree(comm, described, problem)
        check_elementwise(inner)
    except BaseException:
        if carried is not None:  # the script's optimizer keeps what it held
            inner.load_state_dict(carried)
        raise
    if config.replicate_size > 1:  # hybrid sharding: now that every rank agrees on the mesh's shape
        comm = Comm(topology=Topology.build(process_group, comm_device, config.replicate_size,
                                            timeout_s=config.collective_timeout_s), ledger=comm.ledger)
    if config.hpz or config.quantize_grads is not None:  # ZeRO++'s hierarchy: the shard axis by node
        comm = Comm(topology=comm.topology.with_node_axes(), ledger=comm.ledger)
    if config.tensor_parallel_size > 1:  # [Note: tensor-parallel axis]; ZeRO then shards over data ranks
        comm = Comm(topology=Topology.build_tensor_parallel(config.tensor_parallel_size, comm_device,
                                                             config.collective_timeout_s, config.replicate_size),
                    ledger=comm.ledger)
    tensor_parallel = parallelize(model, comm, config.tensor_parallel)
    experts, expert_parallel = None, None
    if config.expert_parallel_size > 1:  # [Note: expert-parallel axes]; docs/moe.md
        comm, expert_parallel = _split_experts(model, comm, config.expert_parallel_size)
        experts = ExpertShards(expert_parallel.param_ids, tuple(expert_parallel.modules.items()),
                               expert_parallel.expert_comm, comm.world_size)
    sequence_parallel = None
    if config.sequence_parallel_size > 1:  # [Note: sequence-parallel axis]; docs/long_context.md
        comm = Comm(topology=comm.topology.with_sequence_parallel(config.sequence_parallel_size), ledger=comm.ledger)
        sequence_parallel = apply_sequence_parallel(model, comm)
    if config.tiled_loss:  # after the sequence split, whose labels it reads: [Note: tiled logits and loss]
        apply_tiled_loss(model)
    if config.tiled_mlp:  # [Note: tiled MLP]: inside each layer's call, so inside its stage-3 unit
        apply_tiled_mlp(model)

    if config.stage == 3:
        sharded = shard_units(model, named, group_indices, comm, config.units, config.precision, config.offload,
                              config.zeropp, whole=whole_param_flags(inner, group_indices, len(named)),
                              experts=experts)
        try:
            schedule = Stage3Engine(sharded.units, comm, config.backward, config.units, sharded.pool,
                                    sharded.secondary_pool)
            units = sharded.units
            opt = ZeroOptimizer(inner, ShardedModel(sharded.group_views, sharded.trainable, group_indices, schedule,
                                                    stage3=schedule, files=sharded.placement.files,
                                                    tensor_parallel=tensor_parallel,
                                                    expert_parallel=expert_parallel,
                                                    frozen=lambda: [part.shard for u in units for part in u.frozen]),
                                comm, config)
        except BaseException:
            sharded.placement.close()  # the directory can be used again at once
            raise
        install_state_dict_hooks(model, sharded.units, opt.rows, on_loaded=opt.refresh_master_from_params,
                                 settle=opt.settle)
        install_save_pretrained(model, opt)  # a state dict of DTensors is not what it writes
        log.info("rank %d: stage 3 over %d ranks, %d units (%s)", comm.rank, comm.world_size, len(sharded.units),
                 ", ".join(u.name for u in sharded.units[:4]) + (" ..." if len(sharded.units) > 4 else ""))
    else:
        flat = flatten_groups(model, named, group_indices, comm, config.stage, config.precision,
                              config.bucket_bytes, whole=whole_param_flags(inner, group_indices, len(named)),
                              experts=experts)
        reducer = GradReducer(flat.groups, comm, config.backward, flat.backward_order)
        model.register_forward_pre_hook(eager_hook(lambda module, args: reducer.check_no_open_backward()))
        model.register_forward_hook(eager_hook(lambda module, args, output: reducer.watch_outputs(output)
                                               if torch.is_grad_enabled() else None))
        frozen = [p for p in model.parameters() if not p.requires_grad]
        opt = ZeroOptimizer(inner, ShardedModel(flat.storages, named, group_indices, reducer,
                                                tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                                                frozen=lambda: frozen), comm, config)
        install_whole_load_hook(model, opt.rows, on_loaded=opt.refresh_master_from_params, settle=opt.settle)
        if comm.topology.tp_size > 1 or experts is not None:  # split parameters are gathered whole
            install_save_pretrained(model, opt)
        log.info("rank %d: stage %d over %d ranks, %d trainable elements in %d groups", comm.rank,
                 config.stage, comm.world_size, sum(g.layout.numel for g in flat.groups), len(flat.groups))
    if config.compile_units:  # docs/compile.md: the hooks above stay outside the compiled code
        if config.stage == 3:
            drop_training_cache(model)
        compile_forwards([u.module for u in sharded.units] if config.stage == 3 else [model])
    opt.sequence_parallel = sequence_parallel  # the input split and the attention it registered
    install_ddp_accumulation(model, opt.grad_sync)
    if carried is not None:  # the state the script's own optimizer held, now in the shards
        opt.load_state_dict(carried)
    refuse_in_place_merges(model, comm.rank)  # [Note: in-place merges refused] in peft_guard.py
    _INITIALIZED.add(model)
    return model, opt
