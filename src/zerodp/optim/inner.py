"""The user's optimizer: built over the model's own parameters, grouped, and checked to be
elementwise, before the sharded optimizer swaps its parameters for master shards."""
from __future__ import annotations

import logging
from typing import Callable, Union

import torch

log = logging.getLogger(__name__)

__all__ = ["OptimizerSpec", "build_optimizer", "check_elementwise", "elementwise_state_dtypes", "grouped_params"]

OptimizerSpec = Union[type, Callable[[list], torch.optim.Optimizer]]


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


def grouped_params(inner: torch.optim.Optimizer, named: list) -> list[list[int]]:
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


def _fresh_parts(inner: torch.optim.Optimizer, group: int = 0) -> tuple:
    """What a probe builds a fresh instance of the user's optimizer from: its class, param
    group `group`'s hyperparameters, and its step without torch's step hooks (a probe's
    step is not a user step)."""
    cls = type(inner)
    hyper = {k: v for k, v in inner.param_groups[group].items() if k != "params"}
    return cls, hyper, getattr(cls.step, "__wrapped__", cls.step)


def check_elementwise(inner: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose update is not elementwise (LBFGS, Adafactor, Muon, ...):
    on flat shards each rank steps 1-D pieces of parameters, which only gives the same
    result if the update of every element depends on that element alone. Tested, not
    looked up by name: a fresh instance with the first group's hyperparameters steps a 2-D
    tensor and, separately, its flattened halves, three times; the results must agree."""
    cls, hyper, step = _fresh_parts(inner)
    device = inner.param_groups[0]["params"][0].device
    if device.type == "meta":  # born sharded: not materialised yet
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(6, 4, generator=gen)
    grads = [torch.randn(6, 4, generator=gen) for _ in range(3)]
    whole = start.clone().to(device).requires_grad_()
    halves = [start.reshape(-1)[:10].clone().to(device).requires_grad_(),
              start.reshape(-1)[10:].clone().to(device).requires_grad_()]
    try:
        on_whole = cls([{"params": [whole], **hyper}])
    except Exception as e:  # a constructor that needs more than a param group: cannot probe
        log.warning("cannot check that %s is elementwise (building it from a param group raised %s: %s); "
                    "zerodp assumes it is", cls.__name__, type(e).__name__, e)
        return
    why = None
    try:
        on_halves = cls([{"params": halves, **hyper}])  # 1-D pieces, as a shard holds them
        for g in grads:
            whole.grad = g.clone().to(device)
            halves[0].grad, halves[1].grad = (t.clone().to(device) for t in (g.reshape(-1)[:10], g.reshape(-1)[10:]))
            step(on_whole)
            step(on_halves)
        diff = float((torch.cat([h.detach().reshape(-1) for h in halves]) - whole.detach().reshape(-1)).abs().max())
        if not diff <= 1e-6:
            why = f"stepping a tensor's pieces gives another result than stepping the tensor (max difference {diff:.3g})"
    except Exception as e:  # the optimizer could not step 1-D pieces at all
        why = f"it cannot step 1-D pieces of a parameter ({type(e).__name__}: {e})"
    if why is not None:
        raise ValueError(f"{cls.__name__} is not elementwise: {why}. zerodp steps each rank's flat 1-D shard, "
                         f"so it needs an optimizer whose update treats every element on its own, such as "
                         f"AdamW, Adam, SGD, Adagrad or RMSprop")


def elementwise_state_dtypes(inner: torch.optim.Optimizer, group: int = 0) -> dict:
    """The per-element states (name -> dtype) the optimizer creates for an fp32 parameter
    of param group `group`, found by stepping a fresh instance with that group's
    hyperparameters once on a throwaway tensor; {} if it cannot be built that way (they
    are then allocated at the first step)."""
    cls, hyper, step = _fresh_parts(inner, group)
    probe = torch.zeros(4, requires_grad=True)
    try:
        opt = cls([{"params": [probe], **hyper}])
        probe.grad = torch.zeros(4)
        step(opt)
    except Exception:  # noqa: BLE001 - a constructor that needs more than a param group
        return {}
    return {k: v.dtype for k, v in opt.state[probe].items()
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == probe.shape}
