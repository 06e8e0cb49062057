"""Random numbers inside the tensor-parallel split region: each rank draws its own there, and
the same as its peers everywhere else (Megatron's model-parallel RNG, arXiv 1909.08053 §3).

[Note: tensor-parallel random streams]
Between a column-parallel layer's output and the row-parallel layer that closes the block
(the split region) each tensor-parallel rank holds other units (its attention heads, its
MLP hidden units). A dropout there must draw a mask of its own on each rank: drawing the same
numbers would drop the same positions of every rank's units, one mask repeated N_m times
where one process draws N_m independent ones. Everywhere else the activations are the same
on every tensor-parallel rank and dropout must draw the same mask there: that is the default
generator, which initialize makes equal over the group (tensor-parallel rank 0's state).

Megatron keeps a second generator state per rank and switches to it where the model's code
asks (`get_cuda_rng_tracker().fork()`). zerodp cannot ask a model's code, so the layers
switch the default generator of the model's device at the region's bounds:

- a column-parallel layer (not the LM head, whose output is gathered whole) opens the region:
  it takes one number from the replicated stream (the same on every tensor-parallel rank)
  and seeds the default generator from that number and its tensor-parallel rank;
- the row-parallel layer closes it: the replicated stream continues where it was, one number
  further (so the next region gets another seed, on every rank alike).

The split stream is a function of the replicated stream's state, which has three
consequences. It is reproducible from the seed (`torch.manual_seed` before building the
model, as without tensor parallelism). Activation checkpointing recomputes the same masks:
torch.utils.checkpoint restores the default generator at the start of a recomputation
(`preserve_rng_state`), with either `use_reentrant` mode and with the user's own calls to it,
so the region opened again inside draws the same numbers. And a checkpoint restores both
streams by restoring the default generator, which zerodp.save keeps for every rank
(checkpoint/rng.py): there is no second state to save.

Layers fed the same tensor (q, k and v; gate and up) open one region: the generator still
runs the split stream when the second of them is called, and it stays. A generator that no
longer runs it was reset under the region by a recomputation that stopped early (torch
restored the generator), and the region is dropped. A region left open otherwise (an
exception, a column-parallel layer no row-parallel one follows, a recomputation without
`preserve_rng_state`) is closed where the root module's forward ends or the next begins.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SplitRegionRNG"]

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads tensor-parallel ranks over the seeds' low bits
_SEED_BITS = (1 << 63) - 1


class SplitRegionRNG:
    """The split region's bounds for one model on one rank ([Note: tensor-parallel random
    streams]): `open` at a column-parallel layer, `close` at a row-parallel one."""

    def __init__(self, device: torch.device, tp_rank: int):
        self.device, self.tp_rank = device, tp_rank
        self._seed: Optional[int] = None  # the split stream's seed while a region is open
        self._replicated: Optional[torch.Tensor] = None  # the replicated stream's state to go back to

    def generator(self) -> torch.Generator:
        """The default generator of the model's device: the one dropout draws from."""
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return torch.cuda.default_generators[index]
        return torch.default_generator

    def is_open(self) -> bool:
        """Whether the default generator runs this rank's split stream now."""
        return self._seed is not None and self.generator().initial_seed() == self._seed

    def open(self) -> None:
        if self.is_open():  # another layer of the same region (k after q)
            return
        gen = self.generator()
        base = self._take_one(gen)
        self._replicated = gen.get_state()
        self._seed = ((base ^ ((self.tp_rank + 1) * _MIX)) & _SEED_BITS) | 1
        gen.manual_seed(self._seed)

    def close(self) -> None:
        if self.is_open():
            self.generator().set_state(self._replicated)
        self._seed, self._replicated = None, None

    @staticmethod
    def _take_one(gen: torch.Generator) -> int:
        """A number of the replicated stream, which moves on by it. On CUDA from the Philox
        counter itself: drawing on the device would make the host wait for it."""
        if gen.device.type == "cuda":
            offset = gen.get_offset()
            gen.set_offset(offset + 4)  # Philox advances in fours
            return hash((gen.initial_seed(), offset)) & _SEED_BITS
        return int(torch.randint(0, 1 << 62, (), generator=gen))
