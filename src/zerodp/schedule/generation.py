"""Generation at stage 3 without an all-gather of every unit per new token.

[Note: kept for generation]
A decoder's `generate` runs one forward per new token, and at stage 3 each forward gathers
every unit and frees it again (stage3.py: a forward without gradients frees each unit at
its end), so a rollout of T tokens all-gathers the model T times. Inside
`generation_context` the engine asks a keeper, after each forward without gradients,
whether a gathered unit stays gathered (`Stage3Engine.keeper`): the keeper keeps units in
the order their forwards end until their bytes (`FlatUnit.full_nbytes`, trainable and
frozen parts) would pass `max_gathered_bytes`, and the units it keeps are gathered once for
the whole block; the others are gathered and freed per forward, as outside it. Every rank
runs the same units in the same order, so every rank keeps the same ones and issues the
same collectives. With every unit kept, a forward issues none, so ranks may run different
numbers of forwards (a rank whose sequences all ended stops early), which per-forward
gathers forbid (Hugging Face's `synced_gpus`). On exit the kept units are freed and the pool
gives back the buffers the block added (as `gathered_parameters` does), so training's peak
is unchanged. A forward with gradients inside is refused: it would train on units whose
gathered values the optimizer step after it would leave stale. (These are not the units a
training backward gathers on every rank, [Note: units run on some ranks] in stage3.py.)
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from ..sharding.flat_unit import UnitState

__all__ = ["KeptUnits", "generation_context"]


class KeptUnits:
    """The units one `generation_context` keeps gathered, within its byte budget."""

    def __init__(self, engine, max_gathered_bytes: Optional[int]):
        self.engine, self.max_gathered_bytes = engine, max_gathered_bytes
        self.units: list[int] = []  # unit indices, in the order they were kept
        self.nbytes = 0

    def __call__(self, ui: int) -> bool:
        """Whether unit `ui` stays gathered after the forward that ran it (the engine's question)."""
        unit = self.engine.units[ui]
        if unit.state is UnitState.SHARDED:
            return False
        if ui in self.units:
            return True
        budget = self.max_gathered_bytes
        if budget is not None and self.nbytes + unit.full_nbytes > budget:
            return False
        self.units.append(ui)
        self.nbytes += unit.full_nbytes
        return True

    def release(self) -> None:
        for ui in self.units:
            self.engine.units[ui].reshard()
        self.units, self.nbytes = [], 0


def _refuse_training_forward(rank: int):
    def hook(module, args):
        if torch.is_grad_enabled():
            raise RuntimeError(f"rank {rank}: a forward with gradients inside zerodp.generation_context: the kept units "
                               f"would be stale after the step that follows it. Generate inside the block (under "
                               f"torch.no_grad()) and train outside it")
    return hook


@contextlib.contextmanager
def generation_context(model: nn.Module, optimizer, *, max_gathered_bytes: Optional[int] = None) -> Iterator:
    """Within the block, forwards without gradients (`model.generate(...)`) keep the stage-3
    units they gather, up to `max_gathered_bytes` of them (None: every unit the model runs,
    as DeepSpeed's `ds3_gather_for_generation`; 0: none, each forward gathers as outside the
    block), and free them on exit ([Note: kept for generation]). Every rank enters it;
    entering and leaving are no collective. Yields the `KeptUnits` (which units it keeps,
    their bytes), or None outside stage 3, where the parameters are whole already."""
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
        yield kept
    finally:
        engine.keeper = None
        guard.remove()
        kept.release()
        for pool, mark in marks:
            pool.release_since(mark)
