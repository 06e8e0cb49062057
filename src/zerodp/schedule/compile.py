"""Config.compile_units: torch.compile on the code between zerodp's hooks (docs/compile.md).

Every hook zerodp registers runs eagerly ([Note: hooks stay eager] in schedule/base.py),
so what is compiled is a module's own `forward`, never its `__call__`: the module's hooks
(stage 3's gather before it, its free after it, the gradient hooks it registers on the
outputs) run in `nn.Module._call_impl` around the compiled forward, as torchtitan compiles
each block under FSDP2 with the hooks outside.

- Stage 3: each unit's forward. A unit's forward runs only once its pre-hook gathered it,
  so the compiled code always sees gathered parameters, and the guards on their shapes hold
  every step. Units of one class share one code object and so one graph (a different
  instance is another input, not another graph). A unit that calls other units (the root)
  breaks its graph at each of their calls, whose hooks run eagerly; where those calls sit
  in a loop, dynamo runs that frame eagerly and compiles the inner units' forwards alone.
- Stages 0-2: the parameters are always whole and the hooks wrap only the model's call
  (the open-backward check, the outputs' gradient hook) and its parameters' gradients, so
  the model's forward is compiled whole.
"""
from __future__ import annotations

import logging
import types

import torch
import torch.nn as nn

__all__ = ["compile_forwards", "drop_training_cache"]

log = logging.getLogger(__name__)


def compile_forwards(modules: list[nn.Module]) -> None:
    """Replace each module's forward by its torch.compile'd version (an instance attribute,
    so `_call_impl` and its hooks stay eager around it); a module compiled already is left.
    A forward set on the instance (accelerate's hooks, a user's patch) is the one compiled:
    it is what the module runs eagerly."""
    for module in modules:
        if getattr(module.forward, "_torchdynamo_orig_callable", None) is not None:
            continue
        own = module.__dict__.get("forward")
        if own is not None:
            module.forward = torch.compile(own)
            continue
        # The class's forward compiled, bound to this module: a copy.deepcopy of the model
        # binds it to the copy (a compiled bound method would keep running the original).
        module.forward = types.MethodType(torch.compile(type(module).forward), module)


def drop_training_cache(model: nn.Module) -> None:
    """[Note: no KV cache in compiled units]
    A Hugging Face decoder builds a KV cache in every forward that does not pass `use_cache`
    (its config's `use_cache`, True by default), training included, and each layer writes its
    own slot. Compiled unit by unit, each layer's guard on its slot then fails for the next
    layer: one graph per layer, and past dynamo's recompile_limit (8) the later layers run
    eagerly, every step. Training needs no cache, so with `compile_units` at stage 3 the
    config's default is turned off (logged): `generate` passes its own `use_cache` and keeps
    its cache; a forward that asks for `use_cache=True` gets one, compiled per layer."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None) is True:
        config.use_cache = False
        log.warning("compile_units: %s.config.use_cache set to False: a training forward needs no KV cache, and "
                    "one makes a compiled graph per layer ([Note: no KV cache in compiled units] in "
                    "zerodp/schedule/compile.py); generate() still uses its own", type(model).__name__)
