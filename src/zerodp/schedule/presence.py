"""Which trainable parameters have a gradient, and what the loop did to `.grad` since the
engine last set it ([Note: gradient clearing] in schedule/base.py)."""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import Comm
from .grad_handle import GradAccess, make_handle


def _handle(param: nn.Parameter, shared: dict, access: Optional[GradAccess]) -> torch.Tensor:
    """A zero tensor of `param`'s shape whose elements all alias one element of `shared`'s
    storage for its dtype and device ([Note: gradient clearing]): no memory of its own, and
    a version counter of its own, so that zeroing it in place is seen; torch's gradient
    utilities read it exactly ([Note: torch's utilities on sharded gradients] in grad_handle.py)."""
    key = (param.dtype, param.device)
    if key not in shared:
        shared[key] = torch.zeros(1, dtype=param.dtype, device=param.device).untyped_storage()
    return make_handle(param, shared[key], access)


def clear_by_owner(owner: dict, indices: list[int]) -> None:
    """Clear the gradients of the tracked parameters `indices`, one call per storage that holds
    them (`owner[k]` is the (flat group or unit, local index) of parameter k)."""
    by_storage: dict = {}
    for k in indices:
        storage, i = owner[k]
        by_storage.setdefault(id(storage), (storage, []))[1].append(i)
    for storage, local in by_storage.values():
        storage.clear_grads(local)


class GradPresence:
    """Which trainable parameters have a gradient, as DDP's `p.grad is not None` says, and
    what the loop did to `.grad` since the engine last set it ([Note: gradient clearing])."""

    def __init__(self, comm: Comm, params: list[nn.Parameter], clear: Callable[[list[int]], None],
                 views: Optional[list[torch.Tensor]] = None):
        self.comm, self.params = comm, params
        self.views = views  # stages 0-1: each parameter's view of the flat gradient; else handles
        # Stage 1 over several ranks: once reduced, the view holds the rank's unreduced sums
        # outside its owned chunk, so a final gradient is shown as a handle there too.
        self.handles_when_final = False
        # The optimizer, which answers for the handles ([Note: torch's utilities on sharded
        # gradients] in grad_handle.py); None: plain handles that read as zeros.
        self.access: Optional[GradAccess] = None
        self._clear = clear  # zero what the engine holds of these parameters' gradients
        self.index = {id(p): k for k, p in enumerate(params)}
        self.present = [False] * len(params)  # as DDP before the first backward
        self._left: list = [None] * len(params)  # weak references to what the engine left in .grad
        self._versions = [0] * len(params)
        self._handles = [False] * len(params)  # what it left is a handle
        self._stripped: list = []  # (index, handle) taken out of the way of the pass in progress
        self.absent_seen = False  # a parameter without a gradient began this window
        self.remember()

    def has_grad(self, param: nn.Parameter) -> bool:
        return self.present[self.index[id(param)]]

    def any_grad(self) -> bool:
        return any(self.present)

    def remember(self) -> None:
        """Whatever each `.grad` holds now is the engine's doing."""
        for k, p in enumerate(self.params):
            g = p.grad
            self._left[k] = weakref.ref(g) if g is not None else None
            self._versions[k] = g._version if g is not None else 0

    def observe(self, backward: bool) -> None:
        """Take in what the loop did to each `.grad`; with `backward` (a pass begins), also
        get `.grad` ready for autograd: the flat gradient's view at stages 0-1, no handle."""
        cleared, zeroed, assigned = [], [], []
        for k, p in enumerate(self.params):
            g = p.grad
            had = self._left[k] is not None  # a cleared handle is gone: its weak reference is dead
            if g is None:
                if had:
                    cleared.append(k)
                    self.present[k], self._handles[k] = False, False
            elif had and g is self._left[k]():
                if self._handles[k] and g._version != self._versions[k]:
                    zeroed.append(k)
            else:  # a tensor of the loop's own replaces the gradient
                assigned.append((k, g))
                self.present[k], self._handles[k] = True, False
        if cleared or zeroed or assigned:
            self._clear(sorted(cleared + zeroed + [k for k, _ in assigned]))
        for k, g in assigned if self.views is not None else ():  # stages 0-1: into the flat gradient
            self.views[k].copy_(g)
            self.params[k].grad = self.views[k]
        if backward:
            self._ready_for_autograd()
            self.absent_seen = self.absent_seen or not all(self.present)
        self.remember()

    def _ready_for_autograd(self) -> None:
        for k, p in enumerate(self.params):
            if self.views is not None:
                if p.grad is None:  # zero since it was cleared: autograd adds in place
                    p.grad = self.views[k]
                elif self._handles[k]:  # stage 1: the final gradient's handle, kept: add to the view
                    p.grad = self.views[k]
                    self._handles[k] = False
            elif self._handles[k] and p.grad is not None:
                self._stripped.append((k, p.grad))
                p.grad = None
                self._handles[k] = False

    def restore(self) -> None:
        """A pass that reached no parameter ended: the handles it took away are put back."""
        for k, handle in self._stripped:
            if self.params[k].grad is None:
                self.params[k].grad = handle
                self._handles[k] = True
        self._stripped.clear()
        self.remember()

    def note_used(self, param_ids) -> None:
        for i in param_ids:
            k = self.index.get(i)
            if k is not None:
                self.present[k] = True

    def settle(self) -> None:
        """A step's gradients are final: every rank agrees which parameters have one (a
        parameter that a backward reached on any rank), and `.grad` shows it."""
        if self.absent_seen and self.comm.world_size > 1:
            t = torch.tensor(self.present, dtype=torch.uint8, device=self.comm.device)
            self.comm.all_reduce(t, "control", op=dist.ReduceOp.MAX, label="parameters with a gradient")
            self.present = [bool(v) for v in t.tolist()]
        self.absent_seen = False
        self.publish(views_always=False, final=True)

    def reset(self, set_to_none: bool) -> None:
        """optimizer.zero_grad(set_to_none): no gradient anywhere, or a zero one where there
        was one. torch's zero_grad(set_to_none=False) zeroes the gradients that exist and
        leaves a None gradient None, so a parameter no backward has reached is still not
        stepped (no weight decay, no momentum). With set_to_none `.grad` is None, as DDP's
        (torch DCP's state probe relies on it); the next backward hands autograd the flat
        gradient's view again (stages 0-1)."""
        self.present = [False] * len(self.params) if set_to_none else list(self.present)
        self.absent_seen = False
        self._stripped.clear()
        self.publish(views_always=False)

    def publish(self, views_always: bool, final: bool = False) -> None:
        """`.grad` as the engine leaves it; `final`: the step's gradients are reduced."""
        shared: dict = {}
        as_views = self.views is not None and not (final and self.handles_when_final)
        for k, p in enumerate(self.params):
            if as_views:
                p.grad = self.views[k] if self.present[k] or views_always else None
                self._handles[k] = False
            else:
                p.grad = _handle(p, shared, self.access) if self.present[k] else None
                self._handles[k] = self.present[k]
        self._stripped.clear()
        self.remember()
