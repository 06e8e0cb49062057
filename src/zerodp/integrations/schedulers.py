"""LR schedulers built on a script's optimizer, moved onto the optimizer `zerodp.initialize`
returns: Accelerate's `prepare` and Lightning's Trainer shard a model with the optimizer the
script built, after its schedulers were built on it.

[Note: a scheduler built before initialize]
torch's LRScheduler keeps its optimizer in `.optimizer` and wraps that optimizer's `step` to
notice a scheduler step taken before the optimizer's (`_opt_called`). zerodp.initialize
refuses an optimizer a scheduler already wraps (the scheduler would drive the optimizer
zerodp wraps, not the one it returns), so an integration removes that wrapper first
(`drop_scheduler_mark`), initializes, then points `.optimizer` of each scheduler (and of
those a SequentialLR or ChainedScheduler holds) at zerodp's optimizer and wraps its `step`
the same way (`move_schedulers`). Nothing else moves: zerodp's param groups are the script's,
in order, with the hyperparameters the scheduler already set (`lr`, `initial_lr`), so
`base_lrs`, `last_epoch` and the schedule continue unchanged. A scheduler the integration is
not handed cannot be re-pointed: Accelerate's `prepare` refuses an optimizer wrapped by a
scheduler that is not in the same call.
"""
from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch

__all__ = ["drop_scheduler_mark", "move_schedulers", "scheduler_wrapped_step", "schedulers_of"]


def schedulers_of(scheduler) -> list:
    """The scheduler and those it composes (SequentialLR, ChainedScheduler)."""
    return [scheduler, *[s for child in getattr(scheduler, "_schedulers", ()) for s in schedulers_of(child)]]


def scheduler_wrapped_step(optimizer: torch.optim.Optimizer):
    """The `step` an LR scheduler set on this optimizer instance, if any."""
    step = vars(optimizer).get("step")
    return step if step is not None and hasattr(step, "_wrapped_by_lr_sched") else None


def drop_scheduler_mark(optimizer: torch.optim.Optimizer) -> Optional[object]:
    """Remove the `step` wrapper an LR scheduler put on `optimizer`; returns it (None if there
    was none), for putting back should initialize fail."""
    wrapped = scheduler_wrapped_step(optimizer)
    if wrapped is not None:
        del optimizer.step
    return wrapped


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """What torch's LRScheduler does to the optimizer it is built on: `step` marks
    `_opt_called`, which the scheduler's first step reads to warn of the wrong order."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)
    func = type(optimizer).step

    @functools.wraps(func)
    def step(*args, **kwargs):
        opt = ref()
        opt._opt_called = True
        return func(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    optimizer.step = step


def move_schedulers(schedulers: list, plain: torch.optim.Optimizer, zero: torch.optim.Optimizer) -> None:
    """Point every scheduler of `schedulers` built on `plain` (and those a SequentialLR or
    ChainedScheduler holds) at `zero`: [Note: a scheduler built before initialize]."""
    moved = False
    for scheduler in (s for top in schedulers for s in schedulers_of(top)):
        if getattr(scheduler, "optimizer", None) is plain:
            scheduler.optimizer = zero
            moved = True
    if moved:
        _track_step_called(zero)
