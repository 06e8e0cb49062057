"""What `p.grad` is once a step's gradients are reduced and sharded: a handle that torch's own
gradient utilities read exactly.

[Note: torch's utilities on sharded gradients]
A DDP script clips with `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`
(nanoGPT's train.py, Accelerate, the HF Trainer under DDP). Under DDP every `p.grad` is the
whole averaged gradient, so the norm torch computes is the global one. Under ZeRO (stages
1-3 over more than one rank) a rank holds only its shard of each reduced gradient; a whole
`p.grad` exists nowhere, and a norm of whatever `.grad` holds would be silently wrong (at
stage 1 it would read the rank's unreduced local sums).

FSDP2 answers with DTensor gradients. zerodp's shards are flat runs, not a DTensor
placement, so `p.grad` is a `ShardedGrad`: a zero-memory handle of the parameter's shape
([Note: gradient clearing] in base.py) whose `__torch_function__` answers the calls torch's
utilities make from the shards, through the optimizer (`GradAccess`):
- norms (`torch.linalg.vector_norm`, `torch.norm`, `Tensor.norm`, `torch._foreach_norm`):
  the parameter's exact norm; the first call after the gradients change computes every
  parameter's norm in one small all-reduce (a float per parameter), so
  `clip_grad_norm_`, `get_total_norm` and a loop logging per-parameter norms cost one
  collective, as the ranks all call them;
- in-place scaling (`mul_`, `div_`, their foreach forms) and clamping (`clamp_`,
  `clamp_min_`, `clamp_max_`, their foreach forms): applied to the rank's shard, which is
  what the step reads;
- `zero_`, `requires_grad_`, `detach_` and metadata (shape, dtype, device, `grad_fn`): as
  on any tensor (the engine reads a zeroing as a clearing).
Anything else that reads the values (`p.grad.clone()`, `.abs()`, arithmetic) raises at
once, on every rank that does it, naming what works: the values are not on this rank.
So `clip_grad_norm_`, `clip_grad_value_` and `get_total_norm` over the model's parameters
give DDP's result at every stage, and nothing else can silently read a shard as a whole.
The norm and the scaling are collective in the sense the ranks' norms are pooled: every rank
must call them, as every rank calls `clip_grad_norm_` in a data-parallel loop.
"""
from __future__ import annotations

import weakref
from typing import Optional, Protocol

import torch
import torch.nn as nn

__all__ = ["GradAccess", "ShardedGrad", "make_handle"]


class GradAccess(Protocol):
    """What the optimizer offers the handles ([Note: torch's utilities on sharded gradients])."""

    def norms(self, params: list[nn.Parameter], norm_type: float) -> list[torch.Tensor]: ...

    def scale(self, params: list[nn.Parameter], factor) -> None: ...

    def clamp(self, params: list[nn.Parameter], low, high) -> None: ...

    def refusal(self, what: str, param: nn.Parameter) -> str: ...


_NORMS = {torch.linalg.vector_norm, torch.norm, torch.Tensor.norm}
_FOREACH_NORMS = {torch._foreach_norm}
_SCALES = {torch.Tensor.mul_: False, torch.Tensor.div_: True}
_FOREACH_SCALES = {torch._foreach_mul_: False, torch._foreach_div_: True}
_CLAMPS = {torch.Tensor.clamp_, torch.Tensor.clip_}
_CLAMP_ONE_SIDE = {torch.Tensor.clamp_min_: "low", torch.Tensor.clamp_max_: "high"}
_FOREACH_CLAMPS = {torch._foreach_clamp_min_: "low", torch._foreach_clamp_max_: "high"}
# As on any tensor: what reads no value, and the in-place changes the engine observes.
_AS_ANY_TENSOR = {torch.Tensor.zero_, torch.Tensor.requires_grad_, torch.Tensor.detach_, torch.Tensor.size,
                  torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.is_contiguous,
                  torch.Tensor.element_size, torch.Tensor.__len__, torch.Tensor.untyped_storage,
                  torch.Tensor.data_ptr, torch.Tensor.storage_offset, torch.Tensor.is_floating_point,
                  torch.Tensor.is_complex, torch.Tensor.__repr__, torch.Tensor.__format__, torch.Tensor.__hash__,
                  torch.Tensor.get_device, torch.Tensor.nelement, torch.Tensor.ndimension}


class ShardedGrad(torch.Tensor):
    """`p.grad` while the parameter's reduced gradient is sharded ([Note: torch's utilities on
    sharded gradients]). Its elements alias one zero; `_zerodp_param` and `_zerodp_access`
    say whose gradient it stands for and who holds it."""

    _zerodp_param: "weakref.ref"
    _zerodp_access: GradAccess

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__" or func in _AS_ANY_TENSOR:
            return _plain(func, args, kwargs)
        if func in _NORMS:
            handle, rest = args[0], args[1:]
            if isinstance(handle, ShardedGrad) and _whole_norm(func, rest, kwargs):
                order = _norm_order(func, rest, kwargs)
                return handle._zerodp_access.norms([handle.param], order)[0].to(_norm_dtype(handle))
        elif func in _FOREACH_NORMS:
            tensors = list(args[0])
            order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
            if all(isinstance(t, ShardedGrad) for t in tensors) and kwargs.get("dtype") is None:
                access = tensors[0]._zerodp_access
                return [n.to(_norm_dtype(t)) for n, t in zip(access.norms([t.param for t in tensors], float(order)),
                                                             tensors)]
        elif func in _SCALES and isinstance(args[0], ShardedGrad) and len(args) == 2 and not kwargs:
            handle, factor = args
            handle._zerodp_access.scale([handle.param], _reciprocal(factor) if _SCALES[func] else factor)
            return handle
        elif func in _FOREACH_SCALES and len(args) == 2 and not kwargs:
            tensors, factor = list(args[0]), args[1]
            if all(isinstance(t, ShardedGrad) for t in tensors) and not isinstance(factor, (list, tuple)):
                tensors[0]._zerodp_access.scale([t.param for t in tensors],
                                                _reciprocal(factor) if _FOREACH_SCALES[func] else factor)
                return None
        elif func in _CLAMPS and isinstance(args[0], ShardedGrad):
            handle = args[0]
            low = args[1] if len(args) > 1 else kwargs.get("min")
            high = args[2] if len(args) > 2 else kwargs.get("max")
            handle._zerodp_access.clamp([handle.param], low, high)
            return handle
        elif func in _CLAMP_ONE_SIDE and isinstance(args[0], ShardedGrad) and len(args) == 2:
            handle, bound = args
            low, high = (bound, None) if _CLAMP_ONE_SIDE[func] == "low" else (None, bound)
            handle._zerodp_access.clamp([handle.param], low, high)
            return handle
        elif func in _FOREACH_CLAMPS and len(args) == 2 and not kwargs:
            tensors, bound = list(args[0]), args[1]
            if all(isinstance(t, ShardedGrad) for t in tensors) and not isinstance(bound, (list, tuple)):
                low, high = (bound, None) if _FOREACH_CLAMPS[func] == "low" else (None, bound)
                tensors[0]._zerodp_access.clamp([t.param for t in tensors], low, high)
                return None
        handle = _first_handle(args, kwargs)
        raise RuntimeError(handle._zerodp_access.refusal(getattr(func, "__name__", str(func)), handle.param))

    @property
    def param(self) -> nn.Parameter:
        with torch._C.DisableTorchFunctionSubclass():
            param = self._zerodp_param()
        if param is None:
            raise RuntimeError("this gradient handle outlived its parameter")
        return param


def make_handle(param: nn.Parameter, storage: torch.UntypedStorage, access: Optional[GradAccess]) -> torch.Tensor:
    """A tensor of `param`'s shape whose elements all alias element 0 of `storage` (no memory
    of its own; its own version counter, so a zeroing in place is seen); a `ShardedGrad` when
    an optimizer answers for it ([Note: torch's utilities on sharded gradients])."""
    handle = torch.empty(0, dtype=param.dtype, device=param.device).set_(storage, 0, param.shape, [0] * param.dim())
    if access is None:
        return handle
    handle = handle.as_subclass(ShardedGrad)
    handle._zerodp_param = weakref.ref(param)
    handle._zerodp_access = access
    return handle


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _norm_dtype(handle: torch.Tensor) -> torch.dtype:
    """fp32 for a 16-bit parameter: under mixed precision the gradient the step uses is the
    fp32 master's, as DDP with autocast keeps fp32 gradients; a norm rounded to bf16 would move
    the clip coefficient by up to 0.4%."""
    return torch.promote_types(handle.dtype, torch.float32)


def _whole_norm(func, rest, kwargs) -> bool:
    """Whether a norm call is over the whole tensor (no dim, no dtype), as torch's utilities call it."""
    dims = kwargs.get("dim", rest[1] if len(rest) > 1 else None)
    return (dims is None and not kwargs.get("keepdim", False) and kwargs.get("dtype") is None
            and kwargs.get("out") is None)


def _norm_order(func, rest, kwargs) -> float:
    key = "ord" if func is torch.linalg.vector_norm else "p"
    order = rest[0] if rest else kwargs.get(key, 2)
    if order is None or order == "fro":
        return 2.0
    return float(order)


def _reciprocal(factor):
    return 1.0 / factor


def _first_handle(args, kwargs) -> ShardedGrad:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, ShardedGrad):
            return a
        if isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, ShardedGrad):
                    return t
    raise AssertionError("a ShardedGrad's __torch_function__ ran without one")
