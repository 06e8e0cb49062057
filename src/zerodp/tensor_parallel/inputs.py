"""Every tensor-parallel rank must feed the model the same input: a check at every forward.

[Note: tensor-parallel input fingerprint]
The ranks of a tensor-parallel group compute one model on one batch together: each holds a
slice of every split layer, and the all-reduces add their partial results. A rank fed
another batch than its partners (data sampled by the global rank instead of the
data-parallel one) makes every all-reduce add pieces of two different computations: the
collectives still match, nothing fails, and the model trains on a mixture. So before each
forward of the root module each rank reduces its input to one 64-bit fingerprint and the
group compares them:

- the fingerprint: every tensor of the forward's arguments (nested in tuples, lists and
  dicts), its bits read as integers, summed with weights that depend on the position
  (another batch, another order of its rows or a shift along the sequence all change it),
  computed on the device; integer sums wrap the same way in any order, so equal inputs give
  equal fingerprints whatever the kernels;
- an all-gather of the fingerprints over the ``tp`` axis (8 bytes from each rank), and the
  verdict (8 bytes) all-reduced over the ``data`` axis, so that every rank of the world
  raises, naming the groups at fault, and none is left waiting in a collective;
- one host synchronisation to read the verdict.

Both collectives go through `zerodp.comm` and the ledger counts them (label "input
fingerprint"). The cost is per forward of the root module, training or not; a forward that
calls the model's submodules directly is not checked.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import Comm

__all__ = ["InputFingerprint", "fingerprint"]

_LABEL = "input fingerprint"
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROW_WEIGHT, _COL_WEIGHT = 1_000_003, 65_537  # odd multipliers of a row's and a column's index


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if torch.is_tensor(obj):
        yield obj
    elif depth < 4 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key], depth + 1)


def _as_integers(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as int64, bit for bit for floating point (so -0.0 and 0.0, or two
    nans, count as different, as the layers would see them), 2-D: rows by the first dim."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    t = t.contiguous()
    if t.is_floating_point():
        t = t.view(_INT_OF_WIDTH[t.element_size()])
    rows = t.shape[0] if t.dim() > 0 else 1
    return t.reshape(rows, -1).to(torch.int64)


def fingerprint(inputs: Any, device: torch.device) -> torch.Tensor:
    """One int64 on `device` summing up every tensor in `inputs` ([Note: tensor-parallel
    input fingerprint]); computed there, without waiting for it."""
    total = torch.zeros((), dtype=torch.int64, device=device)
    for i, t in enumerate(_tensors(inputs)):
        if t.numel() == 0 or t.device.type == "meta":
            continue
        x = _as_integers(t).to(device)
        rows = torch.arange(1, x.shape[0] + 1, device=device, dtype=torch.int64) * _ROW_WEIGHT
        cols = torch.arange(1, x.shape[1] + 1, device=device, dtype=torch.int64) * _COL_WEIGHT
        part = (x.sum(dim=1) * rows).sum() + (x.sum(dim=0) * cols).sum() + t.numel()
        total = total * 31 + part + i
    return total.reshape(1)


class InputFingerprint:
    """A forward pre-hook on the root module: raises on every rank when the ranks of a
    tensor-parallel group (`axis` "tp"), or of a sequence-parallel group ("sp", whose ranks
    are given one batch alike: [Note: sequence-parallel inputs]), were given different inputs."""

    def __init__(self, comm: Comm, axis: str = "tp"):
        self.comm, self.axis = comm, axis
        self.what = {"tp": "tensor-parallel", "sp": "sequence-parallel"}[axis]
        self.checked = 0  # forwards checked

    def install(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        comm, topo = self.comm, self.comm.topology
        mine = fingerprint((args, kwargs), comm.device)
        everyone = torch.empty(topo.size(self.axis), dtype=torch.int64, device=comm.device)
        comm.collectives(self.axis).all_gather(everyone, mine, "forward", label=_LABEL)
        differs = (everyone != everyone[0]).any().to(torch.int64).reshape(1)
        comm.all_reduce(differs, "forward", op=dist.ReduceOp.MAX, label=_LABEL)
        self.checked += 1
        if differs.item():
            self._raise(everyone)

    def _raise(self, everyone: torch.Tensor) -> None:
        comm, topo = self.comm, self.comm.topology
        here = bool((everyone != everyone[0]).any())
        at_fault = [r for r, bad in enumerate(comm.all_gather_object(here, label=_LABEL)) if bad]
        group = self.what
        if here:
            what = (f"its {group} group's ranks were fed different inputs (fingerprints by {group} "
                    f"rank: {everyone.tolist()})")
        else:
            what = f"the {group} group(s) of data-parallel rank(s) {at_fault} were fed different inputs"
        if self.axis == "tp":
            sample = ("sample the data by the data-parallel rank and size (opt.comm.rank, opt.comm.world_size), not "
                      "by the global rank")
        else:
            k = topo.sp_size
            sample = (f"sample the data by the group (opt.comm.rank // {k}) over the {topo.world_size // k} groups, "
                      f"not by the rank")
        raise ValueError(
            f"rank {comm.rank} of the data-parallel ranks, {group} rank {topo.rank_on(self.axis)}: {what}. Every "
            f"rank of a {group} group must give the model the same batch: {sample}; nothing was computed with it")
