"""Stage 3 units: which modules are gathered at once, and which parameters each gathers.

A unit is a module whose forward runs every use of its parameters; its storage is
flat_unit.py ([Note: unit storage]).
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

__all__ = ["assign_params", "embedding_modules", "encloses", "root_module", "runs", "select_units"]


def runs(module: nn.Module) -> bool:
    """Whether the module has a forward of its own. Containers (ModuleList, ModuleDict,
    ParameterList) are never called, so their forward hooks never fire: they cannot be
    units, whose parameters are gathered by those hooks."""
    return type(module).forward is not nn.Module.forward


def select_units(model: nn.Module, unit_modules: tuple, min_params: int,
                 embedding_unit: bool = True) -> list[tuple[str, nn.Module]]:
    """(name, module) of every unit, the root last. With `unit_modules`, each instance of
    those classes (or class names) is a unit; else a Hugging Face model's
    `_no_split_modules` (its block classes) are; otherwise, bottom-up, each submodule that
    runs (see `runs`) and whose parameters not yet claimed by a unit below it reach
    `min_params`; a container's parameters fall to the module that calls its children.
    `embedding_unit`: with the hint, an untied input embedding is a unit too (`_with_input_embedding`)."""
    named = list(model.named_modules())
    from_hint = False
    if not unit_modules:
        # Hugging Face models name their blocks (the classes never split across devices),
        # which is what FSDP's and DeepSpeed's HF integrations wrap by default.
        hinted = tuple(getattr(model, "_no_split_modules", None) or ())
        if any(type(m).__name__ in hinted for _, m in named if m is not model):
            unit_modules, from_hint = hinted, True
    if unit_modules:
        wanted = {u for u in unit_modules if isinstance(u, type)}
        wanted_names = {u for u in unit_modules if isinstance(u, str)}
        units = [(n, m) for n, m in named if m is not model and m is not root_module(model) and (
            type(m) in wanted or type(m).__name__ in wanted_names or type(m).__qualname__ in wanted_names)]
        if not units:
            raise ValueError(f"Config.unit_modules={unit_modules!r} matches no submodule of "
                             f"{type(model).__name__}: name a class that the model contains")
        idle = [f"{n} ({type(m).__name__})" for n, m in units if not runs(m)]
        if idle:
            raise ValueError(f"Config.unit_modules={unit_modules!r} names containers that are never called, "
                             f"{idle[:3]}: a unit must be a module whose forward runs; name the block class "
                             f"inside the container instead")
        if from_hint and embedding_unit:
            units = _with_input_embedding(model, named, units)
    else:
        claimed: set = set()
        units = []
        for n, m in reversed(named):  # children before parents
            if m is model or m is root_module(model) or not runs(m):
                continue
            own = [p for p in m.parameters() if id(p) not in claimed]
            if sum(p.numel() for p in own) >= min_params:
                units.append((n, m))
                claimed.update(id(p) for p in own)
        units.reverse()
    return units + [("", root_module(model))]


def embedding_modules(model: nn.Module) -> tuple[Optional[nn.Module], Optional[nn.Module]]:
    """(input embedding, output layer) where the model names them (Hugging Face's
    `get_input_embeddings` / `get_output_embeddings`), else None for either."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            module = None
        found.append(module if isinstance(module, nn.Module) else None)
    return found[0], found[1]


def _with_input_embedding(model: nn.Module, named: list[tuple[str, nn.Module]],
                          blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The blocks and, when untied from the output layer, the input embedding as a unit of
    its own (in model order), as the size rule would make it. Held by the root, it stays
    gathered from the first token to the end of backward; alone, it is freed after its
    forward, and a frozen one (fed token ids) is never gathered in backward. The output
    layer stays with the root: trainers read its weight outside its forward (TRL's chunked
    log-probabilities multiply by `lm_head.weight`), which only the root's forward encloses.
    Tied, the shared weight belongs to the root (`assign_params`) and so does the embedding.
    A model that reads the embedding's weight outside its forward (a few do, e.g. to project
    back onto the vocabulary) needs `Config.unit_modules` set to its block classes, which
    leaves the embedding to the root."""
    embedding, head = embedding_modules(model)
    if embedding is None or embedding is root_module(model) or not runs(embedding):
        return blocks
    if head is not None and any(p is q for p in embedding.parameters() for q in head.parameters()):
        return blocks
    if any(m is embedding for _, b in blocks for m in b.modules()):
        return blocks
    chosen = {id(embedding)} | {id(m) for _, m in blocks}
    return [(n, m) for n, m in named if id(m) in chosen and m is not model]


def root_module(model: nn.Module) -> nn.Module:
    """The module whose forward begins and ends every pass: the model, or for a PEFT model
    the model it wraps, whose forward `generate()` (and so any eval or online trainer) runs
    without running the wrapper's; not for prompt learning, whose wrapper embeds the tokens
    itself."""
    config = getattr(model, "active_peft_config", None)
    inner = (model.get_base_model() if config is not None and not getattr(config, "is_prompt_learning", False)
             and hasattr(model, "get_base_model") else None)
    return inner if isinstance(inner, nn.Module) and inner is not model else model


def encloses(unit_name: str, module_name: str) -> bool:
    return unit_name == "" or module_name == unit_name or module_name.startswith(unit_name + ".")


def assign_params(model: nn.Module, units: list[tuple[str, nn.Module]],
                  trainable: list[tuple[str, nn.Parameter]]) -> list[list[int]]:
    """For each unit, indices into `trainable` of the parameters it gathers: those of the
    modules under it and not under a nested unit. A parameter registered in modules of
    several units (tied weights) goes to the innermost unit that encloses them all, whose
    forward encloses every use."""
    index = {id(p): i for i, (_, p) in enumerate(trainable)}
    root = len(units) - 1
    unit_of_module = {id(m): ui for ui, (_, m) in enumerate(units[:-1])}
    # Which units each unit's forward encloses, by module object: a module instance shared
    # by two blocks lies under both, whatever name named_modules() gives it first.
    subtree = [{id(m) for m in module.modules()} for _, module in units]
    inside = [{v for v in range(len(units)) if id(units[v][1]) in subtree[u]} for u in range(len(units))]

    def innermost(path: str) -> int:
        best, module = root, model
        for part in path.split(".") if path else []:
            module = getattr(module, part)
            best = unit_of_module.get(id(module), best)
        return best

    homes: dict[int, set] = {}
    for mname, m in model.named_modules(remove_duplicate=False):  # every path to a shared module
        for p in m.parameters(recurse=False):
            if id(p) in index:
                homes.setdefault(id(p), set()).add(innermost(mname))
    result: list[list[int]] = [[] for _ in units]
    for pid, uis in homes.items():
        enclosing = [u for u in range(len(units)) if uis <= inside[u]]
        best = min(enclosing, key=lambda u: len(subtree[u]))  # the innermost one
        result[best].append(index[pid])
    for r in result:
        r.sort()
    return result
