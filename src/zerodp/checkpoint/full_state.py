"""The model whole: a full state dict (FSDP's full_state_dict=True) and Hugging Face's
`save_pretrained`, at every stage.

At stages 0-2 every rank already holds the parameters whole; at stage 3 each unit is
gathered once, through zerodp's comm, and copied out (to the CPU by default), one unit at
a time, so a rank holds the full model only in the dict it returns (none with
rank0_only on other ranks). Tied weights stay one tensor under each of their names, as
`save_pretrained` expects.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from ..sharding.model_state import full_unit_tensors
from .format import PathLike, describe_error, plain_module, raise_if_failed
from .tp_pieces import ranks_of, splits_of

__all__ = ["full_state_dict", "save_pretrained"]


@torch.no_grad()
def full_state_dict(model: nn.Module, optimizer, *, rank0_only: bool = False, cpu_offload: bool = True) -> dict:
    """The model's state dict with every tensor whole, under the model's own names and
    shapes, in the dtype the model computes in. Collective: every rank calls it; with
    `rank0_only` the other ranks get {} (and hold nothing after each unit's gather).

    Under tensor parallelism each split parameter is all-gathered over its tensor-parallel
    group and put back together in the original's shape ([Note: tensor-parallel split]), one
    parameter at a time; every tensor-parallel group does so, as its ranks must all take part."""
    model = plain_module(model)  # a torch.compile'd model saves and loads as the module it wraps
    optimizer.settle()  # a delayed update in flight reaches the parameters first
    ranks, splits = ranks_of(optimizer), splits_of(optimizer)
    keep = not rank0_only or ranks.rank == 0
    # A split parameter's slice is needed on every rank of its tensor-parallel group.
    split_ids = {id(p) for n, p in model.named_parameters() if n in splits}
    device = "cpu" if cpu_offload else None

    whole: dict[int, torch.Tensor] = {}  # id(parameter) -> a tensor of its own, not training memory
    for unit in (optimizer.stage3.units if optimizer.stage3 is not None else []):
        if unit.empty:
            continue
        for p, t in zip(unit.params, full_unit_tensors(unit)):  # fresh tensors: no copy needed
            if id(p) in split_ids:
                whole[id(p)] = t
            elif keep:
                whole[id(p)] = t.cpu() if cpu_offload else t
    for name, p in model.named_parameters():  # in the same order on every rank
        if name in splits:
            full = _gather_split(optimizer.comm, whole.get(id(p), p.detach()), splits[name])
            whole[id(p)] = full.to(device or full.device) if keep else None
    if not keep:
        return {}
    result = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in whole:
            whole[id(t)] = t.detach().to(device or t.device, copy=True)
        result[key] = whole[id(t)]
    return result


def _gather_split(comm, local: torch.Tensor, split) -> torch.Tensor:
    """The original parameter from every tensor-parallel rank's slice."""
    local = local.contiguous()
    gathered = torch.empty((split.size, local.numel()), dtype=local.dtype, device=local.device)
    comm.collectives("tp").all_gather(gathered.view(-1), local.view(-1), "checkpoint", label="full state dict")
    return split.join([g.view(local.shape) for g in gathered])


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
