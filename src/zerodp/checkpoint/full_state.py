"""The model whole: a full state dict (FSDP's full_state_dict=True) and Hugging Face's
`save_pretrained`, at every stage.

At stages 0-2 every rank already holds the parameters whole; at stage 3 each unit is
gathered once, through zerodp's comm, and copied out (to the CPU by default), one unit at
a time, so a rank holds the full model only in the dict it returns (none with
rank0_only on other ranks). Tied weights stay one tensor under each of their names, as
`save_pretrained` expects.
"""
from __future__ import annotations

import functools
import os

import torch
from torch import nn

from ..sharding.model_state import full_unit_tensors, serving_whole
from ..sharding.rows import gather_split
from ..sharding.units import embedding_modules
from .format import PathLike, describe_error, plain_module, raise_if_failed
from .tp_pieces import ExpertSplit, ranks_of, splits_of

__all__ = ["full_state_dict", "install_save_pretrained", "save_pretrained"]


@torch.no_grad()
def full_state_dict(model: nn.Module, optimizer, *, rank0_only: bool = False, cpu_offload: bool = True,
                    frozen_values: bool | str = True) -> dict:
    """The model's state dict with every tensor whole, under the model's own names and
    shapes, in the dtype the model computes in. Collective: every rank calls it; with
    `rank0_only` the other ranks get {} (and hold nothing after each unit's gather). With
    `frozen_values=False` frozen parameters come as meta tensors of their full shape and
    dtype, nothing gathered nor copied; with "embeddings", all but the input and output
    embeddings' (which a PEFT save may write): for a save of adapters only (a PEFT model's).

    Under tensor parallelism each split parameter is all-gathered over its tensor-parallel
    group and put back together in the original's shape ([Note: tensor-parallel split]), one
    parameter at a time; every tensor-parallel group does so, as its ranks must all take part."""
    return _full_state(model, optimizer, not rank0_only or ranks_of(optimizer).rank == 0, cpu_offload, frozen_values)


def _embedding_ids(model: nn.Module) -> set:
    """The parameters of the model's input and output embeddings, where it names them."""
    return {id(p) for module in embedding_modules(model) if module is not None for p in module.parameters()}


def _full_state(model: nn.Module, optimizer, keep: bool, cpu_offload: bool, frozen_values: bool | str) -> dict:
    model = plain_module(model)  # a torch.compile'd model saves and loads as the module it wraps
    wanted = _embedding_ids(model) if frozen_values == "embeddings" else None
    optimizer.settle()  # a delayed update in flight reaches the parameters first
    splits = splits_of(optimizer)
    # A split parameter's slice is needed on every rank of its tensor-parallel group.
    split_ids = {id(p) for n, p in model.named_parameters() if n in splits}
    device = "cpu" if cpu_offload else None
    units = optimizer.stage3.units if optimizer.stage3 is not None else []
    frozen_shapes = {id(p): slot.shape for u in units for part in u.frozen
                     for p, slot in zip(part.params, part.layout.slots)}
    frozen_shapes.update({id(p): p.shape for p in model.parameters() if not p.requires_grad and id(p) not in
                          frozen_shapes})
    frozen_shapes.update({id(p): torch.Size(splits[n].global_shape(frozen_shapes[id(p)]))  # the original's shape
                          for n, p in model.named_parameters() if n in splits and id(p) in frozen_shapes})
    whole: dict[int, torch.Tensor] = {}  # id(parameter) -> a tensor of its own, not training memory
    for unit in units:
        parts = unit.parts() if frozen_values is True else ([] if unit.empty else [unit]) + [
            part for part in unit.frozen if wanted and any(id(p) in wanted for p in part.params)]
        if not parts:
            continue
        params = [p for part in parts for p in part.params]
        for p, t in zip(params, full_unit_tensors(unit, parts=parts)):  # fresh tensors: no copy needed
            if id(p) in split_ids:
                whole[id(p)] = t
            elif keep:
                whole[id(p)] = t.cpu() if cpu_offload else t
    for name, p in model.named_parameters():  # in the same order on every rank
        if name in splits and (frozen_values is True or p.requires_grad or (wanted and id(p) in wanted)):
            axis = "ep" if isinstance(splits[name], ExpertSplit) else "tp"  # an expert bank's rows by expert
            full = gather_split(optimizer.comm, whole.get(id(p), p.detach()), splits[name], label="full state dict",
                                axis=axis)
            whole[id(p)] = full.to(device or full.device) if keep else None
    if not keep:
        return {}
    result = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in whole:
            whole[id(t)] = (torch.empty(frozen_shapes[id(t)], dtype=t.dtype, device="meta")
                            if frozen_values is not True and id(t) in frozen_shapes and not (wanted and id(t) in wanted)
                            else t.detach().to(device or t.device, copy=True))
        result[key] = whole[id(t)]
    return result


def install_save_pretrained(model: nn.Module, optimizer) -> None:
    """Stage 3: the model's own `save_pretrained` (Hugging Face's, or a PEFT model's) writes
    whole tensors. Called on every rank with `is_main_process` (as the Trainer and accelerate
    call it), it gathers one unit at a time into the main process's CPU memory, which alone
    writes; a failure there is raised on every rank. A PEFT model gathers its trainable
    parameters (the adapters it saves) and its embeddings (which it saves with
    `save_embedding_layers`), not the rest of its frozen base. A call that passes its own
    `state_dict` (zerodp.save_pretrained, the Trainer's) is the method as it was."""
    plain = plain_module(model)
    original = getattr(plain, "save_pretrained", None)
    if original is None:
        return
    adapters_only = hasattr(plain, "peft_config")

    def write(save_directory, args, state: dict, kwargs) -> None:
        # What it may still ask of a submodule's state_dict() (peft does, of a modules_to_save
        # copy), on this rank alone, comes from the whole values it was given.
        by_id = {id(t): state[k] for k, t in plain.state_dict(keep_vars=True).items() if k in state}
        with serving_whole(plain, by_id):
            original(save_directory, *args, is_main_process=True, state_dict=state, **kwargs)

    @functools.wraps(original)
    def save_pretrained(save_directory, *args, is_main_process: bool = True, state_dict=None, **kwargs):
        if state_dict is not None:
            if not is_main_process:
                return original(save_directory, *args, is_main_process=False, state_dict=state_dict, **kwargs)
            return write(save_directory, args, state_dict, kwargs)
        state = _full_state(plain, optimizer, bool(is_main_process), True,
                            frozen_values="embeddings" if adapters_only else True)
        status = {"ok": True}
        if is_main_process:
            try:
                write(save_directory, args, state, kwargs)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                status = {"ok": False, "error": describe_error(e)}
        raise_if_failed(ranks_of(optimizer).all_gather_object(status, "checkpoint"),
                        f"{type(plain).__name__}.save_pretrained to {save_directory}")

    plain.save_pretrained = save_pretrained


def save_pretrained(model: nn.Module, save_directory: PathLike, optimizer, **kwargs) -> None:
    """`model.save_pretrained(save_directory, **kwargs)` of a Hugging Face model trained
    with zerodp, at any stage: full weights (safetensors, tied weights once) that
    `from_pretrained` loads into a plain model. Every rank calls it; rank 0 writes; an
    error on rank 0 (a full disk) is raised on every rank."""
    model = plain_module(model)  # a torch.compile'd model saves and loads as the module it wraps
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"{type(model).__name__} has no save_pretrained (not a Hugging Face PreTrainedModel): "
                        f"save zerodp.full_state_dict(model, optimizer, rank0_only=True) with torch.save or "
                        f"safetensors instead")
    state = full_state_dict(model, optimizer, rank0_only=True)
    status = {"ok": True}
    ranks = ranks_of(optimizer)
    if ranks.rank == 0:
        try:
            model.save_pretrained(os.fspath(save_directory), state_dict=state, **kwargs)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            status = {"ok": False, "error": describe_error(e)}
    raise_if_failed(ranks.all_gather_object(status, "checkpoint"), f"save_pretrained to {save_directory}")
