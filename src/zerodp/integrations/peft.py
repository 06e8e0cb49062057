"""PEFT (LoRA) models trained with zerodp: the merged model, one unit gathered at a time.

`peft`'s `merge_and_unload()` rewrites the model's modules in place and reads every weight
whole; under stage 3 that would gather the whole base at once (trl #5766 met it as an OOM).
`merged_state_dict` instead gathers each stage-3 unit in turn (`iter_full_params`),
adds each LoRA layer's delta (peft's own `get_delta_weight`: B·A·scaling, fan_in_fan_out
respected) to its base weight, and keeps the result on the CPU under the base model's own
names, as `merge_and_unload().state_dict()` names them. The training model is not changed.
`save_merged` writes that with the base model's `save_pretrained`, loadable by
`from_pretrained` into the plain architecture.

Its in-place merges are refused: [Note: in-place merges refused] in zerodp/peft_guard.py.
"""
from __future__ import annotations

import os
from torch import nn

from ..checkpoint.format import PathLike, describe_error, plain_module, raise_if_failed
from ..checkpoint.streaming import iter_full_params

__all__ = ["merged_state_dict", "save_merged"]


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
