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
"""
from __future__ import annotations

import torch

from ..distributed import Comm

__all__ = ["sum_over_sequence"]


class _SumOverSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss: torch.Tensor, comm: Comm):
        ctx.k = comm.topology.sp_size
        total = loss.detach().clone()
        comm.all_reduce(total, "forward", axis="sp", label="sequence-parallel loss")
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.k, None


def sum_over_sequence(loss: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[Note: sequence-parallel loss]."""
    return _SumOverSequence.apply(loss, comm)
