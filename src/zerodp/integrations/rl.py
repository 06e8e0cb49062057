"""TRL's online trainers (GRPOTrainer, RLOOTrainer) through `with_zerodp`: the rollout's
`generate` in zerodp's generation context, and vLLM's weight sync from zerodp's stream.

TRL reaches its distributed backend through two seams, both replaced here on a trainer
zerodp prepares (`install_trl_seams`, called once the model is sharded):

- `trainer._dist` (trl.distributed.DistributedBackend): its `summon_full_params(model)`
  encloses every `generate` of a rollout (FSDP1's gather there). zerodp's enters
  `generation_context`, so at stage 3 the units are gathered once per rollout rather than
  once per new token ([Note: kept for generation] in schedule/generation.py). Its budget follows
  TRL's own switch for ZeRO-3: `args.ds3_gather_for_generation=True` (the default) keeps
  the whole model gathered for the rollout, False keeps none (each forward gathers, as without the
  context); `trainer._dist.max_gathered_bytes` may be set to any byte budget between.
- `trainer.vllm_generation._iter_named_params` (vLLM, colocated or a server): TRL's own
  gathers the whole PEFT base at once to merge it (trl #5766), or reads a sharded
  parameter as it is; zerodp's is `iter_full_params`, one unit at a time, adapters merged,
  tied weights once (vLLM's `load_weights` takes each name once).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch
from torch import nn

from ..checkpoint.streaming import iter_full_params
from ..schedule.generation import generation_context

__all__ = ["ZeroGenerationBackend", "install_trl_seams", "vllm_weights"]


def vllm_weights(model: nn.Module, optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights vLLM's `load_weights` takes: `iter_full_params` on every rank with each
    tensor once (a tied weight under its first name only)."""
    last = None
    for name, t in iter_full_params(model, optimizer):
        if t is not last:  # a tied weight's names come one after the other, as one tensor
            yield name, t
        last = t


class ZeroGenerationBackend:
    """TRL's DistributedBackend with `summon_full_params` (around each rollout's `generate`)
    replaced by zerodp's generation context; everything else is the backend TRL detected."""

    def __init__(self, original, model: nn.Module, optimizer, max_gathered_bytes: Optional[int]):
        self.original, self.model, self.optimizer = original, model, optimizer
        self.max_gathered_bytes = max_gathered_bytes

    def __getattr__(self, name: str):
        return getattr(self.original, name)

    @contextlib.contextmanager
    def summon_full_params(self, module, **kwargs):
        with generation_context(self.model, self.optimizer, max_gathered_bytes=self.max_gathered_bytes):
            yield


def install_trl_seams(trainer) -> None:
    """Point a TRL trainer's generation and weight sync at zerodp's (module docstring); a
    trainer without those seams (SFT, DPO, the HF Trainer) is left as it is."""
    try:
        from trl.distributed import DistributedBackend
    except ImportError:  # no TRL, or one without the backend seam
        return
    original = getattr(trainer, "_dist", None)
    if isinstance(original, DistributedBackend):
        budget = None if getattr(trainer.args, "ds3_gather_for_generation", True) else 0
        trainer._dist = ZeroGenerationBackend(original, trainer.model, trainer.optimizer, budget)
    vllm = getattr(trainer, "vllm_generation", None)
    if vllm is not None and hasattr(vllm, "_iter_named_params"):
        vllm._iter_named_params = functools.partial(vllm_weights, trainer.model, trainer.optimizer)
