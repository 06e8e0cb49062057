"""The whole sequence's loss from each rank's shard of it.

[Note: sequence-parallel loss]
Each rank of an ``sp`` group computes the loss of its tokens, normalised by the token count
of the whole sequence (the input split passes it as `num_items_in_batch`), so the whole
sequence's loss is their sum: an all-reduce of one scalar over ``sp``, the same value on
every rank of the group. Every rank backpropagates that same loss, and the group's objective
is the sum of its k copies, in which this rank's shard loss appears k times: its gradient is
k times the incoming one. The reduction (an all-reduce over the data-parallel ranks, dividing
by all N = k x D of them) then sums the k ranks' gradients of a sequence and averages over
the D data-parallel groups: the gradient of the mean of the groups' losses, as one process
computes it on the data-parallel global batch. No collective runs in its backward.

Per-token values a trainer computes its loss from itself (TRL's fused LM head returns each
token's log-probability, [B, S/k] on this rank) are gathered whole instead, [B, S], the same
on every rank of the group: the loss the trainer computes from them is then the whole
sequence's on every rank, as above, and by the same argument this rank's backward takes k
times the incoming gradient of its own slice and nothing of the others' slices (which their
own ranks take). No collective runs in that backward either.
"""
from __future__ import annotations

import torch

from ..distributed import Comm

__all__ = ["gather_over_sequence", "sum_over_sequence"]

_LABEL = "sequence-parallel loss"


class _SumOverSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss: torch.Tensor, comm: Comm):
        ctx.k = comm.topology.sp_size
        total = loss.detach().clone()
        comm.all_reduce(total, "forward", axis="sp", label=_LABEL)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.k, None


def sum_over_sequence(loss: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[Note: sequence-parallel loss]."""
    return _SumOverSequence.apply(loss, comm)


def _gather(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[B, s] on each rank of ``sp`` -> [B, k s], the slices in rank (sequence) order."""
    k = comm.topology.sp_size
    wire = x.to(torch.uint8) if x.dtype == torch.bool else x  # sent as bytes
    out = torch.empty((k, *wire.shape), dtype=wire.dtype, device=wire.device)
    comm.collectives("sp").all_gather(out, wire.contiguous(), "forward", label=_LABEL)
    return out.transpose(0, 1).reshape(x.shape[0], k * x.shape[1]).to(x.dtype)


class _GatherOverSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm):
        ctx.k, ctx.rank, ctx.length = comm.topology.sp_size, comm.topology.sp_rank, x.shape[1]
        return _gather(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        s = ctx.length
        return grad[:, ctx.rank * s:(ctx.rank + 1) * s] * ctx.k, None


def gather_over_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's per-token values [B, S/k] -> the whole sequence's [B, S]: [Note:
    sequence-parallel loss]."""
    if x.requires_grad:
        return _GatherOverSequence.apply(x, comm)
    return _gather(x, comm)
