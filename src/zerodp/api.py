"""`initialize`: turn a model and an optimizer into their ZeRO counterparts, in place."""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from .agreement import check_ranks_agree, describe
from .comm import Comm
from .config import Config
from .materialize import default_device, has_meta, materialize
from .optimizer import ZeroOptimizer, check_elementwise
from .reducer import FlatParamGroup, GradReducer

log = logging.getLogger(__name__)

OptimizerSpec = Union[type, Callable[[list], torch.optim.Optimizer]]

# Models already turned into flat shards; weak, so models die normally.
_INITIALIZED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def build_optimizer(optimizer: OptimizerSpec, params: list, kwargs: dict) -> torch.optim.Optimizer:
    """The user's optimizer over the model's own parameters: a class with its keyword
    arguments (`params=` may give param groups), or a callable `params -> optimizer`."""
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        kwargs = dict(kwargs)
        groups = kwargs.pop("params", None)
        return optimizer(groups if groups is not None else params, **kwargs)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        if kwargs:
            raise ValueError(f"keyword arguments {sorted(kwargs)} are only for an optimizer class; "
                             f"a callable params -> optimizer sets its own hyperparameters")
        opt = optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt
    raise TypeError(f"optimizer={optimizer!r} must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW) "
                    f"or a callable params -> optimizer; an optimizer instance cannot be re-sharded")


def _grouped_params(inner: torch.optim.Optimizer, named: list) -> list[list[int]]:
    """For each optimizer param group, the indices into `named` of its parameters."""
    index = {id(p): i for i, (_, p) in enumerate(named)}
    groups, seen = [], set()
    for gi, group in enumerate(inner.param_groups):
        if not group["params"]:
            raise ValueError(f"param group {gi} of {type(inner).__name__} has no parameters: drop it, or give it "
                             f"the parameters it was meant for")
        idx = []
        for p in group["params"]:
            if id(p) not in index:
                raise ValueError(f"param group {gi} holds a tensor of shape {tuple(p.shape)} that is not a "
                                 f"trainable parameter of the model: build the optimizer from model.parameters()")
            idx.append(index[id(p)])
            seen.add(id(p))
        groups.append(idx)
    missing = [n for n, p in named if id(p) not in seen]
    if missing:
        raise ValueError(f"parameters {missing[:5]} require grad but are in no optimizer param group: "
                         f"add them to a group or set requires_grad=False")
    return groups


def _cast_forward_inputs(dtype: torch.dtype):
    """Floating-point inputs follow the compute dtype, as FSDP's MixedPrecisionPolicy does."""
    def cast(x):
        return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x

    def hook(module, args, kwargs):
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
    return hook


@torch.no_grad()
def replicate_from_rank0(model: nn.Module, comm: Comm, skip: set) -> None:
    """Parameters not in `skip`, and every buffer, start from rank 0's values, as DDP does
    at construction."""
    for p in model.parameters():
        if id(p) not in skip:
            comm.broadcast(p.data, 0, "init")
    for b in model.buffers():
        comm.broadcast(b.data, 0, "init")


@torch.no_grad()
def apply_compute_dtype(model: nn.Module, dtype: torch.dtype, skip: set, cast_buffers: bool) -> None:
    """Replicated fp32 parameters (those not in `skip`, i.e. frozen ones) take the compute
    dtype, and so do floating inputs of the model's forward. Buffers keep their dtype unless
    `cast_buffers`, as under FSDP2's MixedPrecisionPolicy: a buffer is state the model
    computes with on its own terms (a rotary `inv_freq` kept in fp32), not a weight to round."""
    for p in model.parameters():
        if id(p) not in skip and p.dtype == torch.float32:
            p.data = p.data.to(dtype)
    if cast_buffers:
        for m in model.modules():
            for name, b in m.named_buffers(recurse=False):
                if b.is_floating_point():
                    setattr(m, name, b.to(dtype))
    if dtype != torch.float32:
        model.register_forward_pre_hook(_cast_forward_inputs(dtype), with_kwargs=True)


def check_param_dtypes(named: list, config: Config) -> None:
    """Trainable parameters are fp32 (the master's dtype) or already in the compute dtype;
    any other would silently be rounded (float64) or change dtype (bf16 under fp32) in the
    flat buffers."""
    allowed = {torch.float32, config.compute_dtype}
    bad = [(n, p.dtype) for n, p in named if p.dtype not in allowed]
    if bad:
        shown = ", ".join(f"{n} ({str(d).replace('torch.', '')})" for n, d in bad[:3])
        raise TypeError(f"trainable parameters {shown}{' ...' if len(bad) > 3 else ''} are neither float32 nor "
                        f"the compute dtype of Config.mixed_precision={config.mixed_precision!r}: zerodp keeps "
                        f"an fp32 master and computes in {config.compute_dtype}, so they would be rounded or change dtype. Cast "
                        f"them (model.float()) or freeze them (requires_grad_(False)) before zerodp.initialize")


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
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError(f"model is wrapped in {type(model).__name__}: zerodp replaces it; pass the plain module "
                        f"(model.module) to zerodp.initialize")
    if model in _INITIALIZED:
        raise RuntimeError(f"this {type(model).__name__} was already passed to zerodp.initialize: its parameters are "
                           f"already flat shards. Keep the model and optimizer it returned, or build a new model")
    if config.stage < 3 and has_meta(model):  # built under zerodp.init: materialise it whole
        materialize(model, default_device(), on_param=lambda old, new: None)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    device = named[0][1].device if named else default_device()
    comm = Comm(process_group, device=default_device() if device.type == "meta" else device)
    # A rank whose model or optimizer is wrong must not leave the others waiting in the
    # agreement collective: its error travels with it (agreement.py).
    inner, group_indices, described, problem = None, None, None, None
    try:
        if not named:
            raise ValueError(f"{type(model).__name__} has no trainable parameters (none with requires_grad=True): "
                             f"there is nothing for zerodp to shard or train")
        check_param_dtypes(named, config)
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"trainable parameters lie on several devices {sorted(map(str, devices))}: "
                             f"move the model to one device before zerodp.initialize")
        inner = build_optimizer(optimizer, [p for _, p in named], optimizer_kwargs)
        group_indices = _grouped_params(inner, named)
        described = describe(model, inner, config)
    except Exception as e:  # noqa: BLE001  (re-raised on this rank by check_ranks_agree)
        problem = e
    check_ranks_agree(comm, described, problem)
    check_elementwise(inner)

    if config.stage == 3:
        from .stage3 import shard_model

        model, opt = shard_model(model, inner, named, group_indices, comm, config)
        _INITIALIZED.add(model)
        return model, opt

    trainable = {id(p) for _, p in named}
    replicate_from_rank0(model, comm, skip=set())  # trainable ones too: they are flattened next
    apply_compute_dtype(model, config.compute_dtype, skip=trainable, cast_buffers=config.cast_buffers)
    dtype = config.compute_dtype

    # Backward finishes parameters roughly in reverse registration order; laying each group
    # out in that order lets its buckets fill one after another.
    backward_order = {id(p): len(named) - 1 - i for i, (_, p) in enumerate(named)}
    groups = []
    for idx in group_indices:
        idx = sorted(idx, reverse=True)
        groups.append(FlatParamGroup([named[i][1] for i in idx], [named[i][0] for i in idx], comm,
                                     config.stage, dtype, config.grad_reduce_dtype, config.bucket_bytes))
    reducer = GradReducer(groups, comm, config.grad_accumulation_steps, config.overlap_comm, backward_order,
                          config.reduce_each_micro_batch)
    model.register_forward_pre_hook(lambda module, args: reducer.check_no_open_backward())
    model.register_forward_hook(lambda module, args, output: reducer.watch_outputs(output)
                                if torch.is_grad_enabled() else None)
    opt = ZeroOptimizer(inner, [[g] for g in groups], comm, config, reducer, trainable=named)
    _INITIALIZED.add(model)
    log.info("rank %d: stage %d over %d ranks, %d trainable elements in %d groups", comm.rank,
             config.stage, comm.world_size, sum(g.layout.numel for g in groups), len(groups))
    return model, opt
