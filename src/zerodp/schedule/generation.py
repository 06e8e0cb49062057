"""Generation at stage 3 without an all-gather of every unit per new token.

[Note: kept for generation]
A decoder's `generate` runs one forward per new token, and at stage 3 each forward gathers
every unit and frees it again (stage3.py: a forward without gradients frees each unit at
its end), so a rollout of T tokens all-gathers the model T times. `generation_context`
instead gathers the units it keeps once, when it opens, and holds them until it closes.
Which units: the root first (every forward begins and ends in it), then the others in
registration order, each whose bytes (`FlatUnit.full_nbytes`, trainable and frozen parts)
still fit `max_gathered_bytes`; None keeps every unit, i.e. the whole model gathered on
every rank for the block, as DeepSpeed's hybrid engine and FSDP's `summon_full_params` do;
0 keeps none. The units' sizes and order are the same on every rank, so every rank keeps
the same ones and issues the same collectives. Opening is collective (a sync point, so
that a rank that does not open it is named rather than waited for): it starts every kept
unit's gather at once without waiting, and each unit's first forward waits for its own,
so the transfer of the later units overlaps the first forward's compute instead of one
gather and one wait per unit in turn (which, with other processes on the cores, costs a
scheduling delay per unit on every rank). Inside the block the engine asks the keeper,
after each forward without gradients, whether a gathered unit stays gathered
(`Stage3Engine.keeper`); units not kept are gathered and freed per forward, as outside it.
With every unit kept, a forward issues no collective, so ranks may run different numbers
of forwards (a rank whose sequences all ended stops early), which per-forward gathers
forbid (Hugging Face's `synced_gpus`). On exit the kept units are freed and the pool gives
back the buffers the block added (as `gathered_parameters` does), so training's peak is
unchanged: the kept units cost memory only while the block is open. They are not kept
from one block to the next: the optimizer step between two rollouts (GRPO, PPO, RLOO)
changes every shard, so they would be stale, and kept they would hold the model gathered
through training. Several `generate` calls with no step between share one block. A
forward with gradients inside is refused: it would train on units whose gathered values
the optimizer step after it would leave stale. (These are not the units a training
backward gathers on every rank, [Note: units run on some ranks] in stage3.py.)
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from ..distributed.sync_points import CollectiveCall
from ..sharding.flat_unit import UnitState

__all__ = ["KeptUnits", "generation_context"]

GENERATION_CONTEXT = CollectiveCall(
    "zerodp.generation_context(model, optimizer)",
    verb=("enter", "entered"),
    fix="Enter it on every rank, each around its own generate (every rank generates its own prompts), or pass "
    "max_gathered_bytes=0 for a block that gathers nothing on entry (each forward inside then gathers, so the "
    "forwards too must run on every rank).")


class KeptUnits:
    """The units one `generation_context` keeps gathered, within its byte budget
    ([Note: kept for generation])."""

    def __init__(self, engine, max_gathered_bytes: Optional[int]):
        self.engine, self.max_gathered_bytes = engine, max_gathered_bytes
        self.units: list[int] = []  # unit indices, in the order they are gathered
        self.nbytes = 0
        root = len(engine.units) - 1
        for ui in [root, *range(root)]:
            unit = engine.units[ui]
            if max_gathered_bytes is None or self.nbytes + unit.full_nbytes <= max_gathered_bytes:
                self.units.append(ui)
                self.nbytes += unit.full_nbytes
        self._kept = set(self.units)

    def __call__(self, ui: int) -> bool:
        """Whether unit `ui` stays gathered after the forward that ran it (the engine's question)."""
        return ui in self._kept and self.engine.units[ui].state is not UnitState.SHARDED

    def gather(self) -> None:
        """Start every kept unit's gather, in the same order on every rank; each lands at its
        unit's first forward."""
        for ui in self.units:
            self.engine.start_gather(ui)

    def release(self) -> None:
        for ui in self.units:
            self.engine.units[ui].reshard()
        self.units, self._kept, self.nbytes = [], set(), 0


def _refuse_training_forward(rank: int):
    def hook(module, args):
        if torch.is_grad_enabled():
            raise RuntimeError(f"rank {rank}: a forward with gradients inside zerodp.generation_context: the kept units "
                               f"would be stale after the step that follows it. Generate inside the block (under "
                               f"torch.no_grad()) and train outside it")
    return hook


@contextlib.contextmanager
def generation_context(model: nn.Module, optimizer, *, max_gathered_bytes: Optional[int] = None) -> Iterator:
    """Within the block, forwards without gradients (`model.generate(...)`) find the stage-3
    units it keeps gathered: gathered once on entry, freed on exit ([Note: kept for
    generation]). `max_gathered_bytes` is the memory it may hold: None (the default) the
    whole model's parameters, gathered on every rank, as DeepSpeed's
    `ds3_gather_for_generation` and FSDP's `summon_full_params`; a number of bytes, the
    units that fit (the root first, then registration order), the others gathered per
    forward; 0 none, each forward gathering a unit at a time as outside the block. Every
    rank enters it: entering is collective when it keeps a unit, leaving never is. Yields
    the `KeptUnits` (which units it keeps, their bytes), or None outside stage 3, where the
    parameters are whole already."""
    engine = optimizer.stage3
    if engine is None:
        yield None
        return
    if max_gathered_bytes is not None and max_gathered_bytes < 0:
        raise ValueError(f"max_gathered_bytes must be >= 0 or None (every unit), got {max_gathered_bytes}")
    root = engine.units[-1].module
    plain = getattr(model, "_orig_mod", model)  # a torch.compile'd model: the module it wraps
    if not any(m is root for m in plain.modules()) and not any(m is plain for m in root.modules()):
        raise ValueError(f"rank {engine.comm.rank}: {type(model).__name__} is not the model this optimizer trains")
    if engine.keeper is not None:
        raise RuntimeError(f"rank {engine.comm.rank}: zerodp.generation_context is already open on this model")
    optimizer.settle()  # a delayed update lands before the units are gathered and kept
    kept = KeptUnits(engine, max_gathered_bytes)
    pools = {id(u.pool): u.pool for u in engine.units}
    marks = [(pool, pool.mark()) for pool in pools.values()]
    guard = root.register_forward_pre_hook(_refuse_training_forward(engine.comm.rank), prepend=True)
    engine.keeper = kept
    try:
        if kept.units:
            engine.comm.sync_points.call(GENERATION_CONTEXT, "at stage 3 (entering gathers the units it keeps)")
            kept.gather()
        yield kept
    finally:
        engine.keeper = None
        guard.remove()
        kept.release()
        for pool, mark in marks:
            pool.release_since(mark)
