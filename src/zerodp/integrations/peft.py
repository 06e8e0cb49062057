"""PEFT (LoRA) models trained with zerodp: the merged model, one unit gathered at a time.

`peft`'s `merge_and_unload()` rewrites the model's modules in place and reads every weight
whole; under stage 3 that would gather the whole base at once (trl #5766 met it as an OOM).
`merged_state_dict` instead gathers each stage-3 unit in turn (`gathered_parameters`),
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
from typing import Optional

import torch
from torch import nn

from ..checkpoint.format import PathLike, describe_error, plain_module, raise_if_failed
from ..schedule.stage3 import gathered_parameters

__all__ = ["merged_state_dict", "refuse_in_place_merges", "save_merged"]


def _merged_name(key: str, adapter: str) -> Optional[str]:
    """A PEFT base model's state-dict key as merge_and_unload names it; None for what the
    merge drops (the adapters themselves, the original of a modules_to_save copy)."""
    parts = key.split(".")
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None
    out, i = [], 0
    while i < len(parts):
        if parts[i] == "base_layer":
            i += 1
        elif parts[i] == "modules_to_save" and i + 1 < len(parts) and parts[i + 1] == adapter:
            i += 2
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out)


def _refuse_unmergeable(peft_model: nn.Module, base: nn.Module, adapter: str, lora_layer: type) -> None:
    """What this merge does not compute (it adds B·A·scaling to a Linear's weight): refused
    by name rather than written wrong."""
    config = getattr(peft_model, "peft_config", {}).get(adapter)
    if config is None:
        raise ValueError(f"the model has no adapter {adapter!r} (it has {sorted(peft_model.peft_config)})")
    kind = str(getattr(config, "peft_type", "")).split(".")[-1]
    why = (f"its peft_type is {kind}, not LORA" if kind != "LORA"
           else "it uses DoRA (use_dora=True), whose merge rescales each weight" if getattr(config, "use_dora", False)
           else "it trains LoRA biases (lora_bias=True)" if getattr(config, "lora_bias", False)
           else None)
    embedded = [n for n, m in base.named_modules() if isinstance(m, lora_layer) and adapter in getattr(
        m, "lora_embedding_A", {})]
    if why is None and embedded:
        why = f"it puts LoRA on embeddings ({embedded[:3]})"
    if why is not None:
        raise ValueError(f"zerodp's unit-by-unit merge does not support adapter {adapter!r}: {why}. Save the "
                         f"adapters (model.save_pretrained) and merge them in one process with peft's "
                         f"merge_and_unload, or use plain LoRA on linear layers")


@torch.no_grad()
def merged_state_dict(model: nn.Module, optimizer, *, adapter: str = "default", rank0_only: bool = True) -> dict:
    """The base model's full state dict with LoRA adapter `adapter` merged in, gathering one
    stage-3 unit at a time (at stages 0-2 the parameters are whole already). Collective:
    every rank calls it; with `rank0_only` the other ranks get {}."""
    from peft.tuners.lora import LoraLayer

    peft_model = plain_module(model)
    if not hasattr(peft_model, "get_base_model"):
        raise TypeError(f"{type(peft_model).__name__} is not a PEFT model (no get_base_model): there is nothing to merge")
    base = peft_model.get_base_model()
    tp = optimizer.comm.topology.tp_size
    if tp > 1:  # its gathered units hold each rank's tensor-parallel slices, not the original weights
        raise NotImplementedError(f"merged_state_dict with Config.tensor_parallel_size={tp} is not built: merge "
                                  f"from the one-process state dict instead (zerodp.consolidate of a checkpoint, or "
                                  f"zerodp.full_state_dict, loaded into a plain PEFT model, then merge_and_unload)")
    _refuse_unmergeable(peft_model, base, adapter, LoraLayer)
    optimizer.settle()  # a delayed update reaches the parameters first
    keep = not rank0_only or optimizer.comm.rank == 0
    lora = {id(m.base_layer.weight): m for m in base.modules()
            if isinstance(m, LoraLayer) and adapter in m.lora_A and hasattr(m.base_layer, "weight")}
    entries = list(base.state_dict(keep_vars=True).items())
    units = ([u.all_params() for u in optimizer.stage3.units] if optimizer.stage3 is not None
             else [list(base.parameters())])
    out: dict = {}
    for params in units:
        ids = {id(p) for p in params}
        with gathered_parameters(params):
            if not keep:
                continue
            for key, t in entries:
                name = _merged_name(key, adapter)
                if id(t) not in ids or name is None:
                    continue
                value = t.detach()
                layer = lora.get(id(t))
                if layer is not None:
                    if any(id(p) not in ids for p in (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)):
                        raise ValueError(f"{key}: its LoRA adapters lie in another stage-3 unit; set "
                                         f"Config.unit_modules so that a LoRA layer and its base stay in one unit")
                    value = value + layer.get_delta_weight(adapter).to(value.dtype)
                out[name] = value.to("cpu", copy=True)
    if keep:
        params = {id(p) for p in base.parameters()}
        for key, t in entries:  # buffers, whole at every stage
            name = _merged_name(key, adapter)
            if id(t) not in params and name is not None:
                out[name] = t.detach().to("cpu", copy=True)
    return out


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
