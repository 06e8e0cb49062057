"""Flat, contiguous, sharded layout of a group of parameters.

[Note: flat layout]
Parameters are laid end to end in one buffer (the paper's memory defragmentation, MD,
arXiv 1910.02054 §6.3). The buffer is padded to a multiple of N, the ranks along the
mesh's shard axis ([Note: mesh axes] in distributed/topology.py), and cut into
*segments* of at most `bucket_numel` elements (the constant-size buffer, CB, §6.2);
each segment length is a multiple of N, so padding is only ever added at the very end
(fewer than N elements per buffer). Every segment is sharded on its own: rank r owns the
r-th 1/N chunk of every segment. One reduce-scatter of a segment therefore lands exactly
in its owners' chunks, and one all-gather of the chunks rebuilds the segment in place,
with equal-sized collectives (what NCCL requires) and no staging copies. A rank's *shard*
is the concatenation of its chunks, in segment order: one contiguous tensor of
`shard_numel` elements for master weights, optimizer states, gradients (stage 2) and
parameters (stage 3). A parameter that crosses a segment boundary simply has pieces in
two segments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from . import hostmem

__all__ = ["Slot", "Segment", "Piece", "FlatLayout"]


@dataclass(frozen=True)
class Slot:
    """Where one parameter lies in the flat buffer."""

    offset: int
    numel: int
    shape: tuple


@dataclass(frozen=True)
class Segment:
    """A range of the flat buffer reduced or gathered as one collective."""

    start: int
    numel: int  # a multiple of the shard size

    @property
    def end(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Piece:
    """A run of elements that lies at `flat_start` in the full buffer and at
    `shard_start` in a rank's shard."""

    flat_start: int
    shard_start: int
    numel: int


class FlatLayout:
    """Offsets of `shapes` laid end to end, padded and cut into sharded segments."""

    def __init__(self, shapes: Sequence[Sequence[int]], shard_size: int, bucket_numel: int):
        if shard_size < 1:
            raise ValueError(f"shard_size={shard_size} must be >= 1")
        self.shard_size = n = shard_size
        self.slots: list[Slot] = []
        offset = 0
        for shape in shapes:
            numel = math.prod(shape)
            self.slots.append(Slot(offset, numel, tuple(shape)))
            offset += numel
        self.numel = offset
        self.padded_numel = max(n, -(-offset // n) * n)
        # A segment holds a whole number of chunks of N, so only the last one is padded.
        seg = max(n, bucket_numel // n * n)
        self.segments: list[Segment] = [
            Segment(s, min(seg, self.padded_numel - s)) for s in range(0, self.padded_numel, seg)
        ]
        self.shard_numel = self.padded_numel // n
        self._shard_offsets = []
        acc = 0
        for s in self.segments:
            self._shard_offsets.append(acc)
            acc += s.numel // n

    # -- ownership ------------------------------------------------------------------
    def chunk(self, seg_index: int, rank: int) -> Piece:
        """Rank's chunk of one segment."""
        seg = self.segments[seg_index]
        size = seg.numel // self.shard_size
        return Piece(seg.start + rank * size, self._shard_offsets[seg_index], size)

    def shard_pieces(self, rank: int) -> list[Piece]:
        """Every chunk the rank owns, in shard order."""
        return [self.chunk(i, rank) for i in range(len(self.segments))]

    def segments_of(self, slot_index: int) -> list[int]:
        """Indices of the segments a parameter overlaps."""
        slot = self.slots[slot_index]
        if slot.numel == 0:
            return []
        return [i for i, s in enumerate(self.segments) if s.start < slot.offset + slot.numel and slot.offset < s.end]

    def slot_pieces(self, slot_index: int, rank: int) -> list[tuple[int, int, int]]:
        """(start in the flattened parameter, start in the rank's shard, numel) of each part
        of one parameter that the rank owns."""
        slot = self.slots[slot_index]
        out = []
        for piece in self.shard_pieces(rank):
            lo = max(slot.offset, piece.flat_start)
            hi = min(slot.offset + slot.numel, piece.flat_start + piece.numel)
            if lo < hi:
                out.append((lo - slot.offset, piece.shard_start + lo - piece.flat_start, hi - lo))
        return out

    # -- tensors --------------------------------------------------------------------
    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter as a view of the full flat buffer."""
        return [flat[s.offset: s.offset + s.numel].view(s.shape) for s in self.slots]

    def flatten(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
        """A new padded flat buffer holding `tensors` (padding zero)."""
        flat = hostmem.empty(self.padded_numel, dtype, device)
        for slot, t in zip(self.slots, tensors):
            flat[slot.offset: slot.offset + slot.numel].copy_(t.detach().reshape(-1))
        flat[self.numel:].zero_()
        return flat

    def gather_shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """The rank's shard of a full buffer, as a new contiguous tensor."""
        return torch.cat([flat[p.flat_start: p.flat_start + p.numel] for p in self.shard_pieces(rank)])
