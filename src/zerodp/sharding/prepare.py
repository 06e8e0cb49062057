"""Model preparation before sharding: the dtype policy and the replication DDP does at
construction. Trainable parameters are then flattened (flat_group.py) or cut into units
(units.py, flat_unit.py); what is left (frozen parameters, buffers) stays replicated."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..policies import PrecisionPolicy
from ..distributed import Comm

__all__ = ["apply_compute_dtype", "check_param_dtypes", "replicate_from_rank0"]


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


def check_param_dtypes(named: list, precision: PrecisionPolicy) -> None:
    """Trainable parameters are fp32 (the master's dtype) or already in the compute dtype;
    any other would silently be rounded (float64) or change dtype (bf16 under fp32) in the
    flat buffers."""
    allowed = {torch.float32, precision.compute_dtype}
    bad = [(n, p.dtype) for n, p in named if p.dtype not in allowed]
    if bad:
        shown = ", ".join(f"{n} ({str(d).replace('torch.', '')})" for n, d in bad[:3])
        raise TypeError(f"trainable parameters {shown}{' ...' if len(bad) > 3 else ''} are neither float32 nor "
                        f"the compute dtype of Config.mixed_precision={precision.name!r}: zerodp keeps "
                        f"an fp32 master and computes in {precision.compute_dtype}, so they would be rounded or change dtype. Cast "
                        f"them (model.float()) or freeze them (requires_grad_(False)) before zerodp.initialize")
