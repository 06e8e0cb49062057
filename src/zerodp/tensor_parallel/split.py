"""How tensor parallelism cuts one parameter, and the map between a rank's slice and the
original parameter's coordinates.

[Note: tensor-parallel split]
A split parameter's dim `dim` packs `parts` equal projections (1; GPT-2's fused q, k, v: 3;
a fused gate/up: 2). Each projection is cut into `size` equal contiguous chunks along that
dim, and tensor-parallel rank r holds chunk r of every projection, concatenated in
projection order (so its q, k and v slices stay whole heads). Nothing is padded: the plan
refuses a dim that does not divide (plan._Splitter.plan), so the original parameter is its
logical, unpadded self and a vocabulary the model padded is the model's own shape.

Along the flattened slice, element blocks of `rows * inner` elements (rows = dim // (parts
* size), inner = the product of the dims after `dim`) are contiguous in the original
parameter too: `runs` maps a range of the flattened slice to at most (outer * parts + 1)
ranges of the flattened original. The checkpoint stores a split parameter's pieces by
their slice coordinates plus this description, the affine descriptor of DeepSpeed's
universal checkpoint, so any layout reads them by global coordinates
([Note: tensor-parallel pieces] in checkpoint/tp_pieces.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["TensorSplit"]


@dataclass(frozen=True)
class TensorSplit:
    """A parameter cut over `size` tensor-parallel ranks along `dim`, as `parts` packed
    projections each cut alike: [Note: tensor-parallel split]."""

    dim: int
    parts: int
    size: int

    def __post_init__(self) -> None:
        if self.dim < 0 or self.parts < 1 or self.size < 1:
            raise ValueError(f"TensorSplit(dim={self.dim}, parts={self.parts}, size={self.size}): dim must be >= 0 "
                             f"and parts, size >= 1")

    def local_shape(self, shape) -> list:
        out = list(shape)
        out[self.dim] //= self.size
        return out

    def global_shape(self, local_shape) -> list:
        out = list(local_shape)
        out[self.dim] *= self.size
        return out

    def divides(self, shape) -> bool:
        return self.dim < len(shape) and shape[self.dim] % (self.parts * self.size) == 0

    def cut(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s slice of the original tensor `full` (a view)."""
        packed = full.unflatten(self.dim, (self.parts, full.shape[self.dim] // self.parts))
        return packed.chunk(self.size, dim=self.dim + 1)[rank].flatten(self.dim, self.dim + 1)

    def join(self, slices: list) -> torch.Tensor:
        """The original tensor from every rank's slice, in rank order: `cut`'s inverse."""
        packed = [s.unflatten(self.dim, (self.parts, s.shape[self.dim] // self.parts)) for s in slices]
        return torch.cat(packed, dim=self.dim + 1).flatten(self.dim, self.dim + 1)

    def runs(self, shape, rank: int, start: int, numel: int) -> list:
        """Elements [start, start + numel) of rank `rank`'s flattened slice of a parameter of
        original shape `shape`, as (original flat start, offset in the range, length) runs
        in slice order, adjacent runs merged."""
        rows = shape[self.dim] // (self.parts * self.size)
        inner = math.prod(shape[self.dim + 1:])
        block = rows * inner  # one projection's chunk for one outer index
        if block == 0 or numel == 0:
            return []
        per_part = (shape[self.dim] // self.parts) * inner  # one projection for one outer index
        per_outer = shape[self.dim] * inner
        out: list = []
        end = start + numel
        for k in range(start // block, (end - 1) // block + 1):
            outer, part = divmod(k, self.parts)
            lo, hi = max(start, k * block), min(end, (k + 1) * block)
            g = outer * per_outer + part * per_part + rank * block + (lo - k * block)
            if out and out[-1][0] + out[-1][2] == g:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + hi - lo)
            else:
                out.append((g, lo - start, hi - lo))
        return out
