"""The user's optimizer: built over the model's own parameters, grouped, and checked to be
elementwise or declared to need whole parameters, before the sharded optimizer swaps its
parameters for master shards.

[Note: whole-parameter optimizers]
An optimizer whose update of a parameter needs the whole parameter (Muon orthogonalizes
the whole momentum matrix; Adafactor factors the second moment into row and column means)
says so, and zerodp then packs each of its parameters whole into one rank's chunk ([Note:
whole-parameter alignment] in memory/layout.py) and hands it over in its own shape. It is
declared by the class: a class attribute `zerodp_whole_params = True` (a user's own
optimizer, or False for a subclass that is elementwise again), else membership of
`WHOLE_PARAMETER_OPTIMIZERS` (torch's, which zerodp cannot annotate). A declaration, not a
probe: stepping pieces of a tensor tells whether an update is elementwise, but not what an
optimizer that refuses 1-D tensors would accept. Any other optimizer is probed by
`check_elementwise` and refused if its update is not elementwise.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable, Optional, Sequence, Union

import torch

from .multi import OptimizerList, member_of

log = logging.getLogger(__name__)

__all__ = ["OptimizerSpec", "WHOLE_PARAMETER_OPTIMIZERS", "build_optimizer", "check_elementwise",
           "elementwise_state_dtypes", "grouped_params", "needs_whole_params", "take_carried_state",
           "whole_param_flags"]

OptimizerSpec = Union[type, Callable[[list], torch.optim.Optimizer], Sequence]

# [Note: whole-parameter optimizers]; torch's own, which cannot carry the class attribute.
WHOLE_PARAMETER_OPTIMIZERS: tuple = tuple(getattr(torch.optim, name) for name in ("Muon", "Adafactor")
                                          if hasattr(torch.optim, name))


def needs_whole_params(optimizer) -> bool:
    """Whether an optimizer (class or instance) steps each parameter whole ([Note:
    whole-parameter optimizers])."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    declared = getattr(cls, "zerodp_whole_params", None)
    if declared is not None:
        return bool(declared)
    return issubclass(cls, WHOLE_PARAMETER_OPTIMIZERS)


def whole_param_flags(inner: torch.optim.Optimizer, group_indices: list[list[int]], count: int) -> list[bool]:
    """Per trainable parameter (indices of `group_indices`), whether its optimizer steps it whole."""
    flags = [False] * count
    for gi, idx in enumerate(group_indices):
        if needs_whole_params(member_of(inner, gi)[0]):
            for i in idx:
                flags[i] = True
    return flags


def build_optimizer(optimizer: OptimizerSpec, params: list, kwargs: dict) -> torch.optim.Optimizer:
    """The user's optimizer over the model's own parameters: a class with its keyword
    arguments (`params=` may give param groups), the script's own instance, or a callable
    `params -> optimizer`; or a list of optimizers (instances not yet stepped, or such callables) over disjoint
    parameters, stepped as one ([Note: optimizer list] in multi.py)."""
    if isinstance(optimizer, (list, tuple)):
        if kwargs:
            raise ValueError(f"keyword arguments {sorted(kwargs)} are only for one optimizer class; give each "
                             f"optimizer of the list its own hyperparameters")
        built = [o if isinstance(o, torch.optim.Optimizer) else build_optimizer(o, params, {}) for o in optimizer]
        return OptimizerList(built)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        kwargs = dict(kwargs)
        groups = kwargs.pop("params", None)
        return optimizer(groups if groups is not None else params, **kwargs)
    if isinstance(optimizer, torch.optim.Optimizer):
        if kwargs:
            raise ValueError(f"keyword arguments {sorted(kwargs)} were given with an optimizer instance, which "
                             f"already has its hyperparameters: set them on its param groups instead")
        return optimizer  # [Note: the script's own optimizer]
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        if kwargs:
            raise ValueError(f"keyword arguments {sorted(kwargs)} are only for an optimizer class; "
                             f"a callable params -> optimizer sets its own hyperparameters")
        opt = optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt
    raise TypeError(f"optimizer={optimizer!r} must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), "
                    f"an instance built over the model's parameters, or a callable params -> optimizer")


# [Note: the script's own optimizer]
# A DDP script builds its optimizer over the plain model (nanoGPT's `configure_optimizers`:
# weight-decay groups by dimension), and on resume loads its checkpoint into it before
# wrapping. `initialize` takes that instance as it is (DeepSpeed takes a client optimizer
# the same way): the instance itself becomes the inner optimizer, so its class, param
# groups, hyperparameters and step hooks are the script's without being rebuilt. Any state
# it holds is keyed by the model's parameters, which the sharded optimizer replaces with
# master pieces: `take_carried_state` takes it out in torch's form before that, and the
# sharded optimizer loads it back (a full state dict, which loads at any stage).


def take_carried_state(inner: torch.optim.Optimizer) -> Optional[dict]:
    """The state an instance already holds (torch's full state dict), removed from it; None
    if it never stepped. Its param groups stay: they are the ones zerodp shards."""
    if not any(inner.state.values()):
        return None
    carried = inner.state_dict()
    if isinstance(inner, OptimizerList):
        inner.state.clear()  # the members write into this one dict ([Note: optimizer list])
    else:
        inner.state = defaultdict(dict)
    return carried


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
    member, local = member_of(inner, group)
    cls = type(member)
    hyper = {k: v for k, v in member.param_groups[local].items() if k != "params"}
    return cls, hyper, getattr(cls.step, "__wrapped__", cls.step)


def check_elementwise(inner: torch.optim.Optimizer) -> None:
    """Each member of an optimizer list on its own (below); an optimizer declared to need whole
    parameters is not probed ([Note: whole-parameter optimizers])."""
    for gi in range(len(inner.param_groups)):
        member, local = member_of(inner, gi)
        if local == 0 and not needs_whole_params(member):
            _check_elementwise(member)


def _check_elementwise(inner: torch.optim.Optimizer) -> None:
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
                         f"AdamW, Adam, SGD, Adagrad or RMSprop; if {cls.__name__}'s update needs each "
                         f"parameter whole (as Muon's does), declare it with the class attribute "
                         f"zerodp_whole_params = True and zerodp steps every parameter whole on one rank")


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
