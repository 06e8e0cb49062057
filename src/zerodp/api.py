"""`initialize`: turn a model and an optimizer into their ZeRO counterparts, in place.

The layers meet here, once: the config gives the topology (distributed/), the model is
prepared and sharded (sharding/), a schedule drives its backward (schedule/), the sharded
optimizer steps it (optim/), and every collective goes through the comm (distributed/).
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import Config, ConfigError
from .distributed import Comm, Topology
from .distributed.topology import ranks_per_node
from .distributed.agreement import check_ranks_agree, describe, raise_if_any_failed
from .memory.diskmem import OffloadDir
from .optim import ZeroOptimizer
from .optim.inner import OptimizerSpec, build_optimizer, check_elementwise, grouped_params
from .schedule.reducer import GradReducer
from .schedule.stage3 import Stage3Engine
from .sharding.model_state import install_state_dict_hooks, install_whole_load_hook
from .sharding.meta_init import default_device, has_meta, materialize
from .sharding.prepare import check_param_dtypes
from .sharding.shard import flatten_groups, shard_units
from .tensor_parallel import parallelize

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
    check_param_dtypes(named, config)
    devices = {p.device for _, p in named}
    if len(devices) != 1:
        raise ValueError(f"trainable parameters lie on several devices {sorted(map(str, devices))}: "
                         f"move the model to one device before zerodp.initialize")
    inner = build_optimizer(optimizer, [p for _, p in named], optimizer_kwargs)
    if hasattr(inner.step, "_wrapped_by_lr_sched"):  # torch's LRScheduler marks the step it wraps
        raise ValueError(f"an LR scheduler was built on this {type(inner).__name__} before zerodp.initialize; "
                         f"it would drive the optimizer zerodp wraps, not the one it returns. Build the "
                         f"scheduler on the optimizer zerodp.initialize returns")
    return inner, grouped_params(inner, named), describe(model, inner, config)


def _resolve_nodes(config: Config, process_group) -> Config:
    """Config.replicate_size="nodes" as a number: one row of the mesh per torchrun node."""
    distributed = dist.is_available() and dist.is_initialized()
    if config.tensor_parallel_size > 1 and process_group is not None and process_group != dist.group.WORLD:
        raise ConfigError(f"Config.tensor_parallel_size={config.tensor_parallel_size} splits every process into "
                          f"data- and tensor-parallel groups itself: pass no process_group")
    if distributed and dist.get_world_size() > 1 and (config.hpz or config.quantize_grads is not None):
        local = ranks_per_node("Config.hpz / quantize_grads")  # raises here, before any collective
        if dist.get_world_size() % local or (process_group is not None and process_group != dist.group.WORLD):
            raise ConfigError(f"Config.hpz / quantize_grads split the ranks by node: {dist.get_world_size()} "
                              f"ranks are not whole nodes of {local}, or a process_group of your own was given")
    if config.replicate_size != "nodes":
        return config
    if not distributed:
        return dataclasses.replace(config, replicate_size=1)
    if process_group is not None and process_group != dist.group.WORLD:
        raise ConfigError("Config.replicate_size='nodes' needs the default process group (torchrun's ranks); "
                          "with a process_group of your own, give the number of rows")
    local, world = ranks_per_node(), dist.get_world_size()
    if world % local:
        raise ConfigError(f"Config.replicate_size='nodes': {world} ranks are not whole nodes of {local}")
    return dataclasses.replace(config, replicate_size=world // local)


def _param_files(config: Config, comm: Comm) -> Optional[OffloadDir]:
    """Config.offload_params="disk": the rank's offload directory, opened before the units
    are built (the optimizer's states go in it too); every rank raises if any cannot."""
    if config.offload_params != "disk":
        return None
    files, problem = None, None
    try:
        files = OffloadDir(config.offload_dir, comm.rank)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        problem = e
    try:
        raise_if_any_failed(comm, problem, "opening Config.offload_dir", "init")
    except Exception:
        if files is not None:
            files.close()
        raise
    return files


def initialize(model: nn.Module, optimizer: OptimizerSpec, config: Union[Config, dict, None] = None, *,
               process_group: Optional[Any] = None, **optimizer_kwargs) -> tuple[nn.Module, ZeroOptimizer]:
    """Shard `model`'s training state across the data-parallel ranks; returns (model, optimizer).

    The model is changed in place and returned: it is used exactly as before (its
    state_dict keeps its own names). `optimizer` is a torch.optim.Optimizer subclass
    (keyword arguments follow) or a callable params -> optimizer; its param groups keep
    their hyperparameters. Frozen parameters are left alone, replicated.
    """
    if config is None:
        config = Config()
    elif isinstance(config, dict):
        config = Config.from_dict(config)
    elif not isinstance(config, Config):
        raise TypeError(f"config must be a zerodp.Config or a dict, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if config.tensor_parallel_size > 1 and has_meta(model):
        raise ConfigError(f"Config.tensor_parallel_size={config.tensor_parallel_size}: the model is on the meta "
                          f"device (built under zerodp.init); tensor parallelism splits real weights: build the "
                          f"model normally, or without zerodp.init")
    if config.stage < 3 and has_meta(model):  # built under zerodp.init: materialise it whole
        materialize(model, default_device(), on_param=lambda old, new: None)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    device = named[0][1].device if named else default_device()
    # The ranks agree on everything (distributed/agreement.py) before any other collective;
    # a rank whose model, optimizer or Config is wrong must not leave the others waiting in
    # that collective: its error travels with it.
    comm_device = default_device() if device.type == "meta" else device
    inner, group_indices, described, problem = None, None, None, None
    try:
        comm = Comm(topology=Topology.build(process_group, comm_device, timeout_s=config.collective_timeout_s))
    except Exception as e:  # noqa: BLE001  (zerodp's own group failed: the error goes over the plain one)
        comm, problem = Comm(process_group, device=comm_device), e
    if problem is None:
        try:
            config = _resolve_nodes(config, process_group)  # compared by the agreement below
            inner, group_indices, described = _build_and_describe(model, optimizer, config, named, optimizer_kwargs)
        except Exception as e:  # noqa: BLE001  (re-raised on this rank by check_ranks_agree)
            problem = e
    check_ranks_agree(comm, described, problem)
    check_elementwise(inner)
    if config.replicate_size > 1:  # hybrid sharding: now that every rank agrees on the mesh's shape
        comm = Comm(topology=Topology.build(process_group, comm_device, config.replicate_size,
                                            timeout_s=config.collective_timeout_s), ledger=comm.ledger)
    if config.hpz or config.quantize_grads is not None:  # ZeRO++'s hierarchy: the shard axis by node
        comm = Comm(topology=comm.topology.with_node_axes(), ledger=comm.ledger)
    if config.tensor_parallel_size > 1:  # [Note: tensor-parallel axis]; ZeRO then shards over data ranks
        comm = Comm(topology=Topology.build_tensor_parallel(config.tensor_parallel_size, comm_device,
                                                             config.collective_timeout_s), ledger=comm.ledger)
    tensor_parallel = parallelize(model, comm, config)

    if config.stage == 3:
        files = _param_files(config, comm)
        try:
            sharded = shard_units(model, named, group_indices, comm, config, files)
            schedule = Stage3Engine(sharded.units, comm, config, sharded.pool, sharded.secondary_pool)
            opt = ZeroOptimizer(inner, sharded.group_views, comm, config, schedule, trainable=sharded.trainable,
                                group_indices=group_indices, stage3=schedule, files=files,
                                tensor_parallel=tensor_parallel)
        except BaseException:
            if files is not None:  # the directory can be used again at once
                files.close()
            raise
        install_state_dict_hooks(model, sharded.units, opt.rows, on_loaded=opt.refresh_master_from_params,
                                 settle=opt.settle)
        log.info("rank %d: stage 3 over %d ranks, %d units (%s)", comm.rank, comm.world_size, len(sharded.units),
                 ", ".join(u.name for u in sharded.units[:4]) + (" ..." if len(sharded.units) > 4 else ""))
    else:
        flat = flatten_groups(model, named, group_indices, comm, config)
        reducer = GradReducer(flat.groups, comm, config.grad_accumulation_steps, config.overlap_comm,
                              flat.backward_order, config.reduce_each_micro_batch)
        model.register_forward_pre_hook(lambda module, args: reducer.check_no_open_backward())
        model.register_forward_hook(lambda module, args, output: reducer.watch_outputs(output)
                                    if torch.is_grad_enabled() else None)
        opt = ZeroOptimizer(inner, [[g] for g in flat.groups], comm, config, reducer, trainable=named,
                            group_indices=group_indices, tensor_parallel=tensor_parallel)
        install_whole_load_hook(model, opt.rows, on_loaded=opt.refresh_master_from_params, settle=opt.settle)
        log.info("rank %d: stage %d over %d ranks, %d trainable elements in %d groups", comm.rank,
                 config.stage, comm.world_size, sum(g.layout.numel for g in flat.groups), len(flat.groups))
    _INITIALIZED.add(model)
    return model, opt
