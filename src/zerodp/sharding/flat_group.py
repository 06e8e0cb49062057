"""Stages 0-2: one optimizer param group's parameters as views of a flat buffer, and its
gradients ([Note: flat layout] in memory/layout.py). Each segment of the buffer is a bucket
whose gradients are reduced together (sharding/bucket.py, which also says where gradients
live); the group's all-gather is `publish`."""
from __future__ import annotations

import bisect
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..distributed import Comm
from ..memory import hostmem
from ..memory.layout import FlatLayout, Piece

__all__ = ["FlatParamGroup"]


class FlatParamGroup:
    """One param group's parameters as views of a flat compute-dtype buffer, and its gradients."""

    def __init__(self, params: list[nn.Parameter], names: list[str], comm: Comm, stage: int,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype, bucket_bytes: int,
                 whole: Sequence[bool] = ()):
        self.params, self.names, self.stage = params, names, stage
        self.indices = list(range(len(params)))  # every slot of the layout is this group's
        # Sharded over the mesh's shard axis ([Note: mesh axes] in distributed/topology.py).
        self.collectives = comm.collectives("shard")
        self.rank = comm.shard_rank
        device = params[0].device
        bucket_numel = max(1, bucket_bytes // torch.empty((), dtype=reduce_dtype).element_size())
        # `whole`: the parameters the group's optimizer steps whole ([Note: whole-parameter
        # alignment] in memory/layout.py), each packed into one rank's chunk.
        self.layout = FlatLayout([p.shape for p in params], comm.shard_size, bucket_numel, whole)
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
            # .grad stays None until the first backward, as on DDP (torch DCP's state probe
            # relies on it); the reducer folds autograd's fresh .grad into the flat buffer.
            self.grad_shard = None
        else:
            self.grad_flat, self.grad_views = None, None
            self.grad_shard = hostmem.zeros(shard_numel, reduce_dtype, device)
        # Stage 2: whether a segment's chunk of `grad_shard` holds nothing to keep, so that its
        # next reduction may overwrite it instead of adding ([Note: gradient clearing] in
        # schedule/base.py).
        self.fresh = [True] * len(self.layout.segments)
        # Stages 0-1 reducing in a wider dtype than the gradients: the owned reduced gradient
        # in that dtype, from the reduction to the end of the step (`owned_grads`), and the
        # version of `grad_flat` it was taken at (a change after it means the loop edited
        # the gradient, e.g. zero_grad(set_to_none=False)).
        self.grad_owned: Optional[torch.Tensor] = None
        self._owned_version = -1
        # Stage 1, not cleared between steps: the owned reduced gradient of the last step,
        # while this window's is accumulated and reduced; added back once it is.
        self.carried: Optional[torch.Tensor] = None
        self.reduced = False  # stages 0-1: a reduced gradient is in `grad_flat` (since the last zeroing)
        self._pieces, self._piece_params = self._split_pieces()

    # -- the owned part, as the optimizer sees it -------------------------------------
    def _split_pieces(self) -> tuple[list[Piece], list[Optional[nn.Parameter]]]:
        """Pieces this rank updates (the whole buffer at stage 0, its chunks otherwise), cut
        where a parameter begins, so that each piece belongs to one parameter (the padding
        goes with the last): the optimizer can leave out a parameter that has no gradient,
        as torch's does, and keeps a step count per parameter, as on DDP. A parameter stepped
        whole is also cut where it ends, and the padding after it, which no optimizer may
        see (Muon refuses a 1-D tensor), is left out ([Note: whole-parameter alignment])."""
        layout = self.layout
        if self.stage == 0:  # every rank owns all of it, bucket by bucket
            chunks = [Piece(s.start, s.start, s.numel) for s in layout.segments]
        else:
            chunks = layout.shard_pieces(self.rank)
        # Slots by offset: an aligned layout does not keep the parameters' order.
        owners_of = sorted((i for i, slot in enumerate(layout.slots) if slot.numel), key=lambda i: layout.slots[i].offset)
        starts = [layout.slots[i].offset for i in owners_of]
        ends = sorted(layout.slots[i].offset + layout.slots[i].numel for i in owners_of if layout.whole[i])
        aligned = any(layout.whole)
        pieces, owners = [], []
        for c in chunks:
            end = c.flat_start + c.numel
            inside = starts[bisect.bisect_right(starts, c.flat_start): bisect.bisect_left(starts, end)]
            inside += ends[bisect.bisect_right(ends, c.flat_start): bisect.bisect_left(ends, end)]
            cuts = [c.flat_start] + sorted(set(inside) - {c.flat_start})
            for lo, hi in zip(cuts, cuts[1:] + [end]):
                at = bisect.bisect_right(starts, lo) - 1
                slot = layout.slots[owners_of[at]] if at >= 0 else None
                if aligned:
                    owner = self.params[owners_of[at]] if slot is not None and lo < slot.offset + slot.numel else None
                    if owner is None:
                        continue
                else:
                    owner = self.params[owners_of[at]] if at >= 0 and lo < layout.numel else None
                pieces.append(Piece(lo, c.shard_start + lo - c.flat_start, hi - lo))
                owners.append(owner)
        return pieces, owners

    def owned_pieces(self) -> list[Piece]:
        return self._pieces

    def piece_params(self) -> list[Optional[nn.Parameter]]:
        """The parameter each owned piece belongs to (None: padding only)."""
        return self._piece_params

    def owned_params(self) -> list[torch.Tensor]:
        return [self.flat[p.flat_start: p.flat_start + p.numel] for p in self.owned_pieces()]

    def owned_fp32(self) -> list[torch.Tensor]:
        src = self._initial_fp32 if self._initial_fp32 is not None else self.flat
        return [src[p.flat_start: p.flat_start + p.numel].float().clone() for p in self.owned_pieces()]

    def drop_initial_fp32(self) -> None:
        self._initial_fp32 = None

    def owned_grads(self) -> list[torch.Tensor]:
        if self.grad_shard is not None:
            return [self.grad_shard[p.shard_start: p.shard_start + p.numel] for p in self._pieces]
        if self.grad_owned is not None and self.grad_flat._version == self._owned_version:
            return [self.grad_owned[p.shard_start: p.shard_start + p.numel] for p in self._pieces]
        return [self.grad_flat[p.flat_start: p.flat_start + p.numel] for p in self._pieces]

    # -- gradients between steps ([Note: gradient clearing] in schedule/base.py) ----------
    def owned_grad_buffer(self) -> torch.Tensor:
        """Stages 0-1, reducing in a wider dtype: where the owned reduced gradient is kept in
        it until the step (pieces at `shard_start`; at stage 0 that is the flat offset)."""
        if self.grad_owned is None:
            numel = self.layout.padded_numel if self.stage == 0 else self.layout.shard_numel
            self.grad_owned = hostmem.empty(numel, self.reduce_dtype, self.flat.device)
        return self.grad_owned

    def owned_grads_final(self) -> None:
        """The boundary's reductions have all landed: `grad_owned` matches `grad_flat` now."""
        self.reduced = True
        self._owned_version = self.grad_flat._version if self.grad_flat is not None else -1

    def release_step_grads(self) -> None:
        """After the step: the wider-dtype copy of the owned gradient is not kept (the
        gradient itself stays in `grad_flat`, as DDP keeps .grad)."""
        self.grad_owned = None

    def carry_over(self) -> None:
        """Stage 1, at the start of a window whose gradients were not cleared: the owned
        chunks hold the last step's reduced gradient, the rest stale local sums. The owned
        part is kept aside and everything zeroed, so that this window reduces only its own
        gradients; `add_carried` adds the kept part to each chunk once it is reduced."""
        if self.stage != 1 or not self.reduced:
            return
        self.carried = torch.cat([self.grad_flat[c.flat_start: c.flat_start + c.numel]
                                  for c in self.layout.shard_pieces(self.rank)])
        self.grad_flat.zero_()

    def add_carried(self, seg_index: int, reduced: torch.Tensor) -> None:
        """Add the kept gradient's chunk of segment `seg_index` to its reduced chunk."""
        if self.carried is not None:
            c = self.layout.chunk(seg_index, self.rank)
            reduced.add_(self.carried[c.shard_start: c.shard_start + c.numel])

    def drop_carried(self) -> None:
        self.carried = None

    def clear_grads(self, indices: list[int]) -> None:
        """Zero what this group holds of these parameters' gradients (they were cleared)."""
        if len(indices) == len(self.params):
            self.zero_grad(reattach=False)
            return
        for i in indices:
            if self.grad_views is not None:
                self.grad_views[i].zero_()
            slot = self.layout.slots[i]
            if self.stage == 0 and self.grad_owned is not None:
                self.grad_owned[slot.offset: slot.offset + slot.numel].zero_()
            for _, start, n in self.layout.slot_pieces(i, self.rank) if self.stage > 0 else ():
                for kept in (self.grad_shard, self.grad_owned, self.carried):
                    if kept is not None:
                        kept[start: start + n].zero_()
        if self.grad_owned is not None:  # still in step with grad_flat: only this zeroing changed it
            self._owned_version = self.grad_flat._version

    def publish(self, phase: str = "step") -> None:
        """After the step: every rank's updated chunks rebuild the full buffer (stages 1-2)."""
        if self.stage == 0:
            return
        for i, seg in enumerate(self.layout.segments):
            chunk = self.layout.chunk(i, self.rank)
            self.collectives.all_gather(self.flat[seg.start: seg.end],
                                        self.flat[chunk.flat_start: chunk.flat_start + chunk.numel], phase,
                                        label=f"bucket {i}")

    def zero_grad(self, set_to_none: bool = True, reattach: bool = True) -> None:
        """Zero every gradient this group holds; with `reattach`, each parameter's `.grad`
        is its view of the flat gradient again (stages 0-1) or None (stage 2). The buffers are
        in memory: `set_to_none` changes nothing here."""
        self.grad_owned, self.carried, self.reduced = None, None, False
        if self.grad_flat is not None:
            self.grad_flat.zero_()
        else:
            self.grad_shard.zero_()
            self.fresh = [True] * len(self.fresh)
        if reattach:
            for p, g in zip(self.params, self.grad_views or [None] * len(self.params)):
                p.grad = g

    offloaded = False  # the flat buffers live beside the computation ([Note: placement] is for stage 3)

    def offloaded_tensors(self) -> dict:
        return {}

    def held_tensors(self) -> dict:
        """What this group holds, by ledger category ([Note: measured ledger] in memory/ledger.py);
        autograd's own `.grad` of a parameter is an unsharded gradient held until its
        bucket is filled."""
        return {"params": [self.flat],
                "grads": [self.grad_flat, self.grad_shard, self.grad_owned, self.carried,
                          *(p.grad for p in self.params)]}
