"""Several optimizers over disjoint parameter sets, seen as one: the standard Muon recipe
(Muon for the hidden matrices, AdamW for the rest) through `zerodp.initialize`, which
shards one optimizer.

[Note: optimizer list]
`OptimizerList` is a torch.optim.Optimizer whose `param_groups` are its members' own group
dicts, concatenated (the same objects, not copies), and whose `state` is one dict every
member writes into (keys are parameters, which the members do not share). So everything
zerodp does to an optimizer's groups (swap their parameters for master pieces, copy the
user's hyperparameters in, step a bucket of one group at a time) reaches each member
unchanged, and each member steps only its own groups with its own update rule. A group
knows its member (`member_of`), which decides whether the group's parameters are stepped
whole ([Note: whole-parameter alignment] in memory/layout.py).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch

__all__ = ["OptimizerList", "member_of", "split_hidden_matrices"]


class OptimizerList(torch.optim.Optimizer):
    """Optimizers over disjoint parameters stepped as one ([Note: optimizer list])."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        optimizers = list(optimizers)
        if not optimizers:
            raise ValueError("the optimizer list is empty: give at least one torch.optim.Optimizer")
        for i, opt in enumerate(optimizers):
            if not isinstance(opt, torch.optim.Optimizer) or isinstance(opt, OptimizerList):
                raise TypeError(f"optimizer list item {i} is {type(opt).__name__}: give torch.optim.Optimizer "
                                f"instances (one per parameter set), not nested lists")
            if len(opt.state):
                raise ValueError(f"optimizer list item {i} ({type(opt).__name__}) has already stepped: zerodp "
                                 f"shards a fresh optimizer; build it just before zerodp.initialize")
        seen: dict[int, int] = {}
        for i, opt in enumerate(optimizers):
            for g in opt.param_groups:
                for p in g["params"]:
                    if seen.setdefault(id(p), i) != i:
                        raise ValueError(f"a parameter of shape {tuple(p.shape)} is in optimizer list items "
                                         f"{seen[id(p)]} and {i}: each parameter belongs to one optimizer")
        # torch's constructor (hooks, step patching) over placeholder groups, then the members' own.
        super().__init__([{"params": list(g["params"])} for opt in optimizers for g in opt.param_groups], {})
        self.optimizers = optimizers
        self.param_groups = [g for opt in optimizers for g in opt.param_groups]
        self.state = defaultdict(dict)
        for opt in optimizers:
            opt.state = self.state

    def __repr__(self) -> str:
        return f"OptimizerList({', '.join(type(o).__name__ for o in self.optimizers)})"

    @torch.no_grad()
    def step(self, closure=None):
        """Each member's own step, without torch's step hooks (the list's own run once)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            if any(g["params"] for g in opt.param_groups):
                step = type(opt).step
                getattr(step, "__wrapped__", step)(opt)
        return loss


def member_of(inner: torch.optim.Optimizer, group: int) -> tuple[torch.optim.Optimizer, int]:
    """The optimizer that owns param group `group` of `inner`, and the group's index in it."""
    if not isinstance(inner, OptimizerList):
        return inner, group
    for opt in inner.optimizers:
        if group < len(opt.param_groups):
            return opt, group
        group -= len(opt.param_groups)
    raise IndexError(f"param group {group} is past the optimizer list's groups")


def split_hidden_matrices(model: torch.nn.Module, exclude: Sequence[str] = ()) -> tuple[list, list]:
    """(hidden matrices, the rest) of `model`'s trainable parameters, for the Muon recipe:
    Muon's orthogonalized update is meant for the 2-D weights of hidden layers (Keller
    Jordan's Muon post; torch.optim.Muon's docstring), so embeddings (every nn.Embedding), the
    output head (`get_output_embeddings()` where the model has it, as Hugging Face models
    do), 1-D norms and biases, and any parameter whose name contains one of `exclude` go to
    the rest. A weight tied between embedding and head is listed once, with the embedding."""
    outside = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            outside.update(id(p) for p in module.parameters())
    head = getattr(model, "get_output_embeddings", None)
    head = head() if callable(head) else None
    if head is not None:
        outside.update(id(p) for p in head.parameters())
    hidden, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 2 and id(p) not in outside and not any(x in name for x in exclude):
            hidden.append(p)
        else:
            rest.append(p)
    return hidden, rest
