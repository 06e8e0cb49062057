"""Stages 0-2: one optimizer param group's parameters as views of a flat buffer, and its
gradients ([Note: flat layout] in memory/layout.py). Where gradients live is described
in schedule/reducer.py."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..distributed import Comm
from ..memory import hostmem
from ..memory.layout import FlatLayout, Piece

__all__ = ["FlatParamGroup"]


class FlatParamGroup:
    """One param group's parameters as views of a flat compute-dtype buffer, and its gradients."""

    def __init__(self, params: list[nn.Parameter], names: list[str], comm: Comm, stage: int,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype, bucket_bytes: int):
        self.params, self.names, self.stage = params, names, stage
        self.indices = list(range(len(params)))  # every slot of the layout is this group's
        # Sharded over the mesh's shard axis ([Note: mesh axes] in distributed/topology.py).
        self.collectives = comm.collectives("shard")
        self.rank = comm.shard_rank
        device = params[0].device
        bucket_numel = max(1, bucket_bytes // torch.empty((), dtype=reduce_dtype).element_size())
        self.layout = FlatLayout([p.shape for p in params], comm.shard_size, bucket_numel)
        self.reduce_dtype = reduce_dtype
        fp32 = self.layout.flatten(params, torch.float32, device)
        self.flat = fp32 if compute_dtype == torch.float32 else hostmem.copy_of(fp32, compute_dtype)
        # The fp32 originals are kept only until the optimizer has built its master shard,
        # so the master starts from the exact initial values, not their bf16/fp16 rounding.
        self._initial_fp32: Optional[torch.Tensor] = None if self.flat is fp32 else fp32
        for p, view in zip(params, self.layout.views(self.flat)):
            p.data = view
        shard_numel = self.layout.shard_numel
        if stage < 2:
            self.grad_flat = hostmem.zeros(self.layout.padded_numel, compute_dtype, device)
            self.grad_views = self.layout.views(self.grad_flat)
            for p, g in zip(params, self.grad_views):
                p.grad = g
            self.grad_shard = None
        else:
            self.grad_flat, self.grad_views = None, None
            self.grad_shard = hostmem.zeros(shard_numel, reduce_dtype, device)

    # -- the owned part, as the optimizer sees it -------------------------------------
    def owned_pieces(self):
        """Pieces this rank updates: the whole buffer at stage 0, its chunks otherwise."""
        if self.stage == 0:  # every rank owns all of it, bucket by bucket
            return [Piece(s.start, s.start, s.numel) for s in self.layout.segments]
        return self.layout.shard_pieces(self.rank)

    def owned_params(self) -> list[torch.Tensor]:
        return [self.flat[p.flat_start: p.flat_start + p.numel] for p in self.owned_pieces()]

    def owned_fp32(self) -> list[torch.Tensor]:
        src = self._initial_fp32 if self._initial_fp32 is not None else self.flat
        return [src[p.flat_start: p.flat_start + p.numel].float().clone() for p in self.owned_pieces()]

    def drop_initial_fp32(self) -> None:
        self._initial_fp32 = None

    def owned_grads(self) -> list[torch.Tensor]:
        if self.grad_shard is not None:
            return [self.grad_shard[p.shard_start: p.shard_start + p.numel] for p in self.owned_pieces()]
        return [self.grad_flat[p.flat_start: p.flat_start + p.numel] for p in self.owned_pieces()]

    def publish(self, phase: str = "step") -> None:
        """After the step: every rank's updated chunks rebuild the full buffer (stages 1-2)."""
        if self.stage == 0:
            return
        for i, seg in enumerate(self.layout.segments):
            chunk = self.layout.chunk(i, self.rank)
            self.collectives.all_gather(self.flat[seg.start: seg.end],
                                        self.flat[chunk.flat_start: chunk.flat_start + chunk.numel], phase,
                                        label=f"bucket {i}")

    def zero_grad(self) -> None:
        if self.grad_flat is not None:
            self.grad_flat.zero_()
            for p, g in zip(self.params, self.grad_views):
                p.grad = g
        else:
            self.grad_shard.zero_()
            for p in self.params:
                p.grad = None

    offloaded = False  # the flat buffers live beside the computation ([Note: shard homes] is stage 3's)

    def offloaded_tensors(self) -> dict:
        return {}

    def held_tensors(self) -> dict:
        """What this group holds, by ledger category ([Note: measured ledger] in memory/ledger.py);
        autograd's own `.grad` of a parameter is an unsharded gradient held until its
        bucket is filled."""
        return {"params": [self.flat],
                "grads": [self.grad_flat, self.grad_shard, *(p.grad for p in self.params)]}
