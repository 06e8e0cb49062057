"""peft's in-place merges refused on a model zerodp trains (installed by `initialize`).

[Note: in-place merges refused]
peft's own merges (`merge_and_unload`, `unload`, `merge_adapter`, `unmerge_adapter`, and a
LoRA layer's `merge`/`unmerge`) are refused on a model zerodp trains, at every stage, before
they touch anything (`refuse_in_place_merges`, installed by `initialize`). Making them work
unit by unit instead would not give a model worth training on:
- at stage 3, outside a unit's gather, each weight is a flat piece of this rank's shard:
  peft's merge computes on those pieces and fails at a layer that depends on the rank,
  after marking the layers before it merged (their forward then skips the adapters): the
  ranks hold different, half-merged models, and the next training step is silently wrong;
- `merge_and_unload` and `unload` take the LoRA modules out of the model, while the
  optimizer's shards, the master weights, the units' hooks and the checkpoint's layout
  hold their parameters;
- `merge_adapter` at stages 0-2 (whole weights) does compute the merge, but `zerodp.save`
  checkpoints the frozen base with the adapters and not peft's `merged` flag: a checkpoint
  taken while merged resumes with the delta applied twice; and an unmerge (W + ΔW - ΔW)
  leaves the base rounded away from the one trained.
Everything these calls are used for outside training (a merged export, the weights an
inference engine reads) `merged_state_dict` and `save_merged` give, one unit gathered at a
time and the training model unchanged. Refused at stages 0-2 too, so that a script behaves
the same at every stage. The check needs no collective: every rank refuses alike.
"""
from __future__ import annotations

import sys

from torch import nn

from .checkpoint.format import plain_module

__all__ = ["refuse_in_place_merges"]


# The methods of a PEFT model that rewrite its base weights or its modules in place, on the
# tuner (peft's BaseTuner, which PeftModel forwards them to) and on each adapter layer.
_TUNER_METHODS = ("merge_and_unload", "unload", "merge_adapter", "unmerge_adapter")
_LAYER_METHODS = ("merge", "unmerge")


class RefusedMerge:
    """Stands in for one of peft's in-place merge methods on a model zerodp trains (a
    class rather than a closure, so the model still pickles)."""

    def __init__(self, owner: str, method: str, rank: int):
        self.owner, self.method, self.rank = owner, method, rank

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"rank {self.rank}: {self.owner}.{self.method}() is refused on a model trained with zerodp: it rewrites "
            f"the model in place (at stage 3 the base weights are shards, and a merge stops halfway), which would "
            f"leave the model and its checkpoints wrong. Nothing was changed. For the merged model call "
            f"zerodp.integrations.peft.save_merged(model, directory, optimizer) on every rank (rank 0 writes a "
            f"folder from_pretrained loads), or merged_state_dict(model, optimizer) for the merged weights; they "
            f"gather one unit at a time and leave the training model as it is (docs/finetuning.md, Merging)")


def refuse_in_place_merges(model: nn.Module, rank: int) -> None:
    """Replace peft's in-place merge methods on `model` (a PEFT model, else nothing to do)
    with ones that raise before changing anything: [Note: in-place merges refused]."""
    if "peft" not in sys.modules:  # a model built without importing peft is not a PEFT model
        return
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

    for module in plain_module(model).modules():
        names = (_TUNER_METHODS if isinstance(module, BaseTuner) else _LAYER_METHODS
                 if isinstance(module, BaseTunerLayer) else ())
        for name in names:
            if callable(getattr(module, name, None)):
                setattr(module, name, RefusedMerge(type(module).__name__, name, rank))
