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

[Note: whole-parameter alignment]
An optimizer that needs whole parameters (Muon's Newton-Schulz on the full matrix,
Adafactor's factored second moment: `optim/inner.py: needs_whole_params`) cannot step 1-D
pieces cut by chunk boundaries. For its parameters (`whole`) the layout moves the parameters,
not the boundaries: each segment packs its whole parameters into its N chunks (greedy
largest-first into the chunk with the most room, Megatron's layer-wise distributed optimizer
does the same per bucket), after the segment's elementwise parameters, which lie first and
may still be cut; padding fills what is left of each chunk. Chunks stay equal-sized, so the
reduce-scatter and all-gather are unchanged and deliver every whole parameter to its one
owner: no extra collective, at the cost of padding (`alignment_padding`, which the ledgers'
padded Ψ includes) and of ranks owning unequal numbers of real elements (`owned_numel`). A
segment whose padding exceeds `MAX_ALIGNMENT_PADDING` of it takes in the following
parameters (up to `MAX_SEGMENT_GROWTH` buckets) before it is closed, since more parameters
pack tighter (GPT-2 124M's hidden matrices at N=2 or 4: no padding at all). A stage-3 unit is
one segment and cannot widen: its padding is what its own matrices leave (a GPT-2 block at
N=2: 16%, bytes the ledgers count). Chosen over DeepSpeed's all-reduce of straddling
matrices (extra traffic at stages 1-2) and over gather-to-owner (an extra collective per
step): see docs/optimizers.md. A layout without whole parameters is exactly the plain one.
"""
from __future__ import annotations

import itertools
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


# [Note: whole-parameter alignment]. Megatron accepts up to ~10% per bucket; widening a segment
# is free here (its collective just moves more at once), so zerodp asks for 1%.
MAX_ALIGNMENT_PADDING = 0.01
MAX_SEGMENT_GROWTH = 4


class FlatLayout:
    """Offsets of `shapes` laid end to end, padded and cut into sharded segments; the
    parameters flagged in `whole` each lie inside one rank's chunk ([Note: whole-parameter
    alignment])."""

    def __init__(self, shapes: Sequence[Sequence[int]], shard_size: int, bucket_numel: int,
                 whole: Sequence[bool] = ()):
        if shard_size < 1:
            raise ValueError(f"shard_size={shard_size} must be >= 1")
        if whole and len(whole) != len(shapes):
            raise ValueError(f"whole has {len(whole)} flags for {len(shapes)} parameters: give one per parameter")
        self.shard_size = n = shard_size
        numels = [math.prod(shape) for shape in shapes]
        self.whole = tuple(bool(w) and k > 0 for w, k in zip(whole, numels)) if whole else (False,) * len(shapes)
        self.numel = sum(numels)
        # What the plain layout pads to: alignment's own padding is what comes on top of it.
        self.unaligned_padded_numel = max(n, -(-self.numel // n) * n)
        if any(self.whole):
            offsets, self.segments = _aligned(numels, self.whole, n, max(n, bucket_numel))
            self.padded_numel = self.segments[-1].end
        else:
            offsets = list(itertools.accumulate([0] + numels[:-1])) if numels else []
            self.padded_numel = self.unaligned_padded_numel
            # A segment holds a whole number of chunks of N, so only the last one is padded.
            seg = max(n, bucket_numel // n * n)
            self.segments = [Segment(s, min(seg, self.padded_numel - s)) for s in range(0, self.padded_numel, seg)]
        self.slots: list[Slot] = [Slot(o, k, tuple(shape)) for o, k, shape in zip(offsets, numels, shapes)]
        self.shard_numel = self.padded_numel // n
        self._shard_offsets = []
        acc = 0
        for s in self.segments:
            self._shard_offsets.append(acc)
            acc += s.numel // n

    @property
    def alignment_padding(self) -> int:
        """Padding elements added to keep whole parameters inside one chunk (0 without any)."""
        return self.padded_numel - self.unaligned_padded_numel

    def owned_numel(self, rank: int) -> int:
        """Parameter elements (padding not counted) in the rank's chunks: unequal across ranks
        once whole parameters are packed ([Note: whole-parameter alignment])."""
        return sum(k for i in range(len(self.slots)) for _, _, k in self.slot_pieces(i, rank))

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
        if any(self.whole):  # padding lies between parameters, not only at the end
            flat.zero_()
        else:
            flat[self.numel:].zero_()
        for slot, t in zip(self.slots, tensors):
            flat[slot.offset: slot.offset + slot.numel].copy_(t.detach().reshape(-1))
        return flat

    def gather_shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """The rank's shard of a full buffer, as a new contiguous tensor."""
        return torch.cat([flat[p.flat_start: p.flat_start + p.numel] for p in self.shard_pieces(rank)])


def _aligned(numels: list[int], whole: tuple, n: int, target: int) -> tuple[list[int], list[Segment]]:
    """Offsets of every parameter and the segments of an aligned layout ([Note:
    whole-parameter alignment]): parameters taken in order until a segment holds `target`
    elements, each segment packed by `_pack`, widened while its padding is above the cap."""
    offsets, segments, pos, i = [0] * len(numels), [], 0, 0
    while i < len(numels):
        j, total = i, 0
        while j < len(numels) and (j == i or total < target):
            total, j = total + numels[j], j + 1
        size, local = _pack(numels, whole, range(i, j), n)
        while (size - total > MAX_ALIGNMENT_PADDING * size and j < len(numels)
               and total + numels[j] <= MAX_SEGMENT_GROWTH * target):
            total, j = total + numels[j], j + 1
            size, local = _pack(numels, whole, range(i, j), n)
        for k, off in local.items():
            offsets[k] = pos + off
        segments.append(Segment(pos, size))
        pos, i = pos + size, j
    if not segments:
        segments.append(Segment(0, n))
    return offsets, segments


def _pack(numels: list[int], whole: tuple, members: range, n: int) -> tuple[int, dict[int, int]]:
    """One segment of `members`: its size (N chunks of c elements) and each member's offset in
    it. Elementwise members first, end to end (cut by chunk boundaries as in the plain
    layout); then each whole member, largest first, into the chunk with the most room left,
    after what that chunk already holds. c starts at its lower bound (an even split, and the
    largest whole member) and grows by ~1.6% until every whole member fits, then bisects
    back to the smallest c found to fit."""
    flat = [k for k in members if not whole[k]]
    boxed = sorted((k for k in members if whole[k]), key=lambda k: (-numels[k], k))
    e = sum(numels[k] for k in flat)

    def place(c: int):
        used = [min(c, max(0, e - r * c)) for r in range(n)]  # what the elementwise run fills of each chunk
        placed: dict[int, int] = {}
        for k in boxed:
            r = min(range(n), key=lambda q: (used[q], q))  # the most room left; ties to the lower rank
            if used[r] + numels[k] > c:
                return None
            placed[k] = r * c + used[r]
            used[r] += numels[k]
        return placed

    lowest = max(1, -(-(e + sum(numels[k] for k in boxed)) // n), max((numels[k] for k in boxed), default=0))
    c, fits, short = lowest, place(lowest), lowest - 1
    while fits is None:
        short, c = c, c + max(1, c // 64)
        fits = place(c)
    while c - short > 1:
        mid = (short + c) // 2
        found = place(mid)
        if found is None:
            short = mid
        else:
            c, fits = mid, found
    offsets = dict(zip(flat, itertools.accumulate([0] + [numels[k] for k in flat[:-1]])))
    return n * c, {**offsets, **fits}
