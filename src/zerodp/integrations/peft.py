"""PEFT (LoRA) models trained with zerodp: the merged model, one unit gathered at a time.

`peft`'s `merge_and_unload()` rewrites the model's modules in place and reads every weight
whole; under stage 3 that would gather the whole base at once (trl #5766 met it as an OOM).
`merged_state_dict` instead gathers each stage-3 unit in turn (`iter_full_params`),
adds each LoRA layer's delta (peft's own `get_delta_weight`: B·A·scaling, fan_in_fan_out
respected) to its base weight, and keeps the result on the CPU under the base model's own
names, as `merge_and_unload().state_dict()` names them. The training model is not changed.
`save_merged` writes that with the base model's `save_pretrained`, loadable by
`from_pretrained` into the plain architecture.

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

import os
import sys
from torch import nn

from ..checkpoint.format import PathLike, describe_error, plain_module, raise_if_failed
from ..checkpoint.streaming import iter_full_params

__all__ = ["merged_state_dict", "refuse_in_place_merges", "save_merged"]


def merged_state_dict(model: nn.Module, optimizer, *, adapter: str = "default", rank0_only: bool = True) -> dict:
    """The base model's full state dict with LoRA adapter `adapter` merged in, gathering one
    stage-3 unit at a time (at stages 0-2 the parameters are whole already), on the CPU:
    `zerodp.iter_full_params` of the PEFT model, buffers included, kept ([Note: weight
    stream] in checkpoint/streaming.py). Collective: every rank calls it; with `rank0_only`
    the other ranks get {}."""
    if not hasattr(plain_module(model), "get_base_model"):
        raise TypeError(f"{type(plain_module(model)).__name__} is not a PEFT model (no get_base_model): there is "
                        f"nothing to merge")
    stream = iter_full_params(model, optimizer, rank=0 if rank0_only else None, device="cpu", buffers=True,
                              adapter=adapter)
    # Kept, so each a tensor of its own: a view of its unit's buffer would keep the whole
    # buffer, and tensors sharing storage are taken for tied weights by save_pretrained.
    return {name: t.clone() if t._base is not None else t for name, t in stream}


def save_merged(model: nn.Module, save_directory: PathLike, optimizer, *, adapter: str = "default",
                **kwargs) -> None:
    """Write the merged model (`merged_state_dict`) with the base model's `save_pretrained`
    (rank 0 writes; every rank calls it; a failure is raised on every rank)."""
    state = merged_state_dict(model, optimizer, adapter=adapter, rank0_only=True)
    status = {"ok": True}
    if optimizer.comm.rank == 0:
        try:
            base = plain_module(model).get_base_model()
            type(base).save_pretrained(base, os.fspath(save_directory), state_dict=state, **kwargs)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            status = {"ok": False, "error": describe_error(e)}
    raise_if_failed(optimizer.comm.all_gather_object(status, "checkpoint"), f"save_merged to {save_directory}")


# The methods of a PEFT model that rewrite its base weights or its modules in place, on the
# tuner (peft's BaseTuner, which PeftModel forwards them to) and on each adapter layer.
_TUNER_METHODS = ("merge_and_unload", "unload", "merge_adapter", "unmerge_adapter")
_LAYER_METHODS = ("merge", "unmerge")


class _Refused:
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
                setattr(module, name, _Refused(type(module).__name__, name, rank))
