"""The model's own state dict under expert parallelism.

Each rank holds its own experts of every bank ([Note: expert split] in plan.py), so what
torch's `model.state_dict()` would give is this rank's rows of the banks under the bank's
name, and `model.load_state_dict` would read a whole bank into them: neither is the model's
state. Both are refused on the model itself, naming the forms that hold the banks whole or
by their global coordinates: `zerodp.full_state_dict` / `zerodp.save_pretrained` (each
bank gathered over the ``ep`` axis), `zerodp.save` / `zerodp.load` / `zerodp.consolidate`
(pieces by global coordinates: [Note: tensor-parallel pieces] in checkpoint/tp_pieces.py)
and `zerodp.load_pretrained` (each rank reads its experts' rows of a whole state dict).
zerodp's own uses (`state_dict(keep_vars=True)`, which lists the tensors without reading
their values as the model's) pass.
"""
from __future__ import annotations

import torch.nn as nn

__all__ = ["refuse_module_state_dicts"]

_USE = ("zerodp.full_state_dict(model, optimizer) or zerodp.save_pretrained(model, path, optimizer) for the whole "
        "model, zerodp.save / zerodp.load for checkpoints")


def refuse_module_state_dicts(model: nn.Module, ep_size: int) -> None:
    def state_dict_pre_hook(module, prefix, keep_vars):
        if not keep_vars:
            raise RuntimeError(f"{type(model).__name__}.state_dict() under Config.expert_parallel_size={ep_size}: "
                               f"each rank holds 1/{ep_size} of every expert bank, so its values are not the "
                               f"model's; use {_USE}")

    def load_pre_hook(module, state_dict, prefix, *args):
        raise RuntimeError(f"{type(model).__name__}.load_state_dict() under Config.expert_parallel_size={ep_size}: "
                           f"each rank holds 1/{ep_size} of every expert bank; use zerodp.load_pretrained(model, "
                           f"state_dict, optimizer) for a whole state dict, zerodp.load for a zerodp checkpoint")

    model.register_state_dict_pre_hook(state_dict_pre_hook)
    model.register_load_state_dict_pre_hook(load_pre_hook)
