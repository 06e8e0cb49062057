"""Megatron's tensor-parallel layers (Shoeybi et al., arXiv 1909.08053 §3), over zerodp's comm.

[Note: tensor-parallel layers]
A block's first projections are column-parallel (each tensor-parallel rank holds a slice of
the output features: of the attention heads, of the MLP's hidden units) and its output
projections row-parallel (a slice of the input features), so the block's interior needs no
communication. Two conjugate operators bracket it (Megatron's f and g):

- `copy_to_tp` at each column-parallel layer's input: identity forward, all-reduce of the
  input's gradient backward (each rank's slice contributes a part of it). Layers fed the very
  same tensor (q, k and v; gate and up) share one copy (`RegionEntry`), so their summed input
  gradient is all-reduced once;
- `reduce_from_tp` at the row-parallel output: all-reduce forward (each rank holds a partial
  sum), identity backward.

So each attention or MLP sub-block costs one all-reduce forward and one backward. The
vocabulary-parallel embedding looks up the ids of its slice of the vocabulary (zeros
elsewhere) and all-reduces; the column-parallel LM head all-gathers the logits, so any loss
works on them. Every activation outside a block's interior is the same on every
tensor-parallel rank: parameters that see only those (norms, the row-parallel bias, position
embeddings) are replicated and get the same gradient on every rank, which data parallelism
then averages as usual.

The layers own plain tensors, the rank's slice, not DTensors: zerodp flattens parameters into
its own buffers ([Note: flat layout] in memory/layout.py), which needs plain storage, and
every collective goes through `zerodp.comm` so the ledger counts it on the ``tp`` axis.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed import Comm
from .rng import SplitRegionRNG

__all__ = ["ColumnParallelLinear", "RegionEntry", "RowParallelLinear", "VocabParallelEmbedding", "copy_to_tp",
           "reduce_from_tp", "gather_from_tp"]


def _all_reduce(x: torch.Tensor, comm: Comm, phase: str) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, phase, axis="tp", label="tensor parallel")
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm, "backward"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x, comm, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate every rank's slice along the last dim; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        n = comm.topology.tp_size
        x = x.contiguous()
        full = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
        comm.collectives("tp").all_gather(full.view(-1), x.view(-1), "forward", label="tensor parallel logits")
        return full.movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        n, r = ctx.comm.topology.tp_size, ctx.comm.topology.tp_rank
        return grad.chunk(n, dim=-1)[r].contiguous(), None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _ReduceFromTP.apply(x, comm)


def gather_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _GatherFromTP.apply(x, comm)


class RegionEntry:
    """Megatron's f (`copy_to_tp`), once per input tensor: the column-parallel layers of one
    model share this, so those fed the very same tensor object in one pass share one copy and
    one all-reduce of their summed input gradient. Held weakly: an entry lives while both
    the input and its copy do (the copy, while autograd keeps it for the layers' backward)."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self._copies: dict[int, tuple] = {}  # id(input) -> (weakref input, weakref copy, grad mode)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        seen = self._copies.get(id(x))
        if seen is not None and seen[0]() is x and seen[2] == grad:
            copy = seen[1]()
            if copy is not None:
                return copy
        copy = copy_to_tp(x, self.comm)
        if len(self._copies) > 64:  # dead entries of earlier passes
            self._copies = {k: v for k, v in self._copies.items() if v[0]() is not None and v[1]() is not None}
        self._copies[id(x)] = (weakref.ref(x), weakref.ref(copy), grad)
        return copy


class ColumnParallelLinear(nn.Module):
    """A Linear holding this rank's slice of the output features; its input enters the
    tensor-parallel region through `region` (Megatron's f); `gather_output` all-gathers the
    output slices (the LM head). Without it the output is split, and so are the random
    numbers drawn after it (`rng`: [Note: tensor-parallel random streams])."""

    def __init__(self, weight: nn.Parameter, bias, region: RegionEntry, gather_output: bool = False,
                 rng: Optional[SplitRegionRNG] = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.comm, self.region, self.gather_output = region.comm, region, gather_output
        self.rng = None if gather_output else rng
        # The LM head (built gathering; `keep_logits_split` may stop the gather): the bytes of
        # the largest logits it produced with gradients enabled, for the ledger's `logits_peak`.
        self.is_head = gather_output
        self.logits_peak_nbytes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.region(x)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tp(y, self.comm)
        elif self.rng is not None:
            self.rng.open()
        if self.is_head and torch.is_grad_enabled():  # training's logits, which autograd keeps; not evaluation's
            self.logits_peak_nbytes = max(self.logits_peak_nbytes, y.numel() * y.element_size())
        return y

    def extra_repr(self) -> str:
        return f"local_out={self.weight.shape[0]}, in={self.weight.shape[1]}, tp={self.comm.topology.tp_size}"


class RowParallelLinear(nn.Module):
    """A Linear holding this rank's slice of the input features; the partial outputs are
    summed over the tensor-parallel ranks, then the (replicated) bias is added once. Its input
    closes the split region of `rng`."""

    def __init__(self, weight: nn.Parameter, bias, comm: Comm, rng: Optional[SplitRegionRNG] = None):
        super().__init__()
        self.weight, self.bias, self.comm, self.rng = weight, bias, comm, rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rng is not None:
            self.rng.close()
        y = reduce_from_tp(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"out={self.weight.shape[0]}, local_in={self.weight.shape[1]}, tp={self.comm.topology.tp_size}"


class VocabParallelEmbedding(nn.Module):
    """An embedding holding this rank's contiguous slice of the vocabulary's rows: ids outside
    it look up zeros, and the sum over the tensor-parallel ranks is the full lookup."""

    def __init__(self, weight: nn.Parameter, comm: Comm, padding_idx=None):
        super().__init__()
        self.weight, self.comm = weight, comm
        rows = weight.shape[0]
        self.vocab_start = comm.topology.tp_rank * rows
        self.vocab_end = self.vocab_start + rows
        self.padding_idx = padding_idx
        # nn.Embedding's padding row gets no gradient; so does its slice's, where it holds it.
        inside = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self._local_padding_idx = padding_idx - self.vocab_start if inside else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # nn.Embedding raises on an id out of range; masked as "another rank's", it would look up zeros.
        vocab = self.weight.shape[0] * self.comm.topology.tp_size
        torch._assert_async(((ids >= 0) & (ids < vocab)).all(), "token id out of range of the embedding")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight, self._local_padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(y, self.comm)

    def extra_repr(self) -> str:
        return f"vocab=[{self.vocab_start}, {self.vocab_end}), dim={self.weight.shape[1]}"
