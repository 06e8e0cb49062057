"""Cross-entropy on logits split over the vocabulary (Megatron's vocab-parallel cross-entropy,
arXiv 1909.08053 §3, written anew), and the seam that puts it into a model's own loss path.

[Note: vocabulary-parallel cross-entropy]
The column-parallel LM head leaves each tensor-parallel rank the logits of its contiguous
slice of the vocabulary, [tokens, V / N_m]. Gathering them costs every rank the whole
[tokens, V] (196 MiB for 2 sequences of 512 at GPT-2's 50,304 in fp32) plus the softmax
cross-entropy keeps for backward. The loss needs only three numbers per token from all
ranks, each an all-reduce over the ``tp`` axis of [tokens] elements:

    m   = max_v z_v                          (MAX; subtracted for a stable exp)
    s   = sum_v exp(z_v - m)                 (SUM)
    z_t = the target's logit                 (SUM; zero on the ranks whose slice lacks it)
    loss = log s - (z_t - m)

and its gradient is local: softmax - one_hot(target), each rank on its slice, from the
exp it already holds (kept as the softmax, in place: one [tokens, V / N_m] fp32 buffer).
An ignored target (ignore_index) contributes neither loss nor gradient and is not counted
by the mean, as in torch's cross_entropy. The three all-reduces and their bytes are in the
ledger, label "vocab-parallel loss".

`keep_logits_split(model)` turns a tensor-parallel model's LM head to leave its logits split
and installs `VocabParallelCausalLMLoss` as the model's `loss_function`: Hugging Face
causal LMs call `self.loss_function(logits=..., labels=..., vocab_size=...)` (the labels
shifted there, `num_items_in_batch` honoured as transformers does), and so does zerodp's
bundled GPT. The model's `logits` output is then this rank's slice.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..distributed import Comm
from .layers import ColumnParallelLinear

__all__ = ["VocabParallelCausalLMLoss", "keep_logits_split", "vocab_parallel_cross_entropy"]

LABEL = "vocab-parallel loss"


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, comm: Comm, ignore_index: int):
        rows = logits.shape[-1]
        start = comm.topology.tp_rank * rows
        z = logits.float()
        m = z.max(dim=-1).values
        comm.all_reduce(m, "forward", op=dist.ReduceOp.MAX, axis="tp", label=LABEL)
        e = (z - m.unsqueeze(-1)).exp_()  # a new buffer: becomes the softmax kept for backward
        s = e.sum(dim=-1)
        comm.all_reduce(s, "forward", axis="tp", label=LABEL)
        ignored = target == ignore_index
        mine = (target >= start) & (target < start + rows) & ~ignored
        local = (target - start).masked_fill(~mine, 0)
        z_t = torch.gather(z, -1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        comm.all_reduce(z_t, "forward", axis="tp", label=LABEL)
        loss = (s.log() - (z_t - m)).masked_fill(ignored, 0.0)
        e.div_(s.unsqueeze(-1))
        ctx.save_for_backward(e, local, mine, ignored)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, mine, ignored = ctx.saved_tensors
        g = softmax  # used once: the kept buffer becomes the gradient
        g.scatter_add_(-1, local.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g.mul_(grad.masked_fill(ignored, 0.0).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, comm: Comm, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """torch's `cross_entropy(full_logits, target, ignore_index=..., reduction=...)` from this
    rank's vocabulary slice of the logits ([..., V / N_m], rank r holding ids [r V / N_m,
    (r + 1) V / N_m)) and the full targets ([...], the same on every tensor-parallel rank):
    [Note: vocabulary-parallel cross-entropy]. Computed in fp32."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: use 'mean', 'sum' or 'none'")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)}: the target must have the "
                         f"logits' shape without the vocabulary dim")
    loss = _VocabParallelCE.apply(logits, target, comm, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    # torch's mean over the targets not ignored (nan when there are none, as torch gives).
    return loss.sum() / (target != ignore_index).sum()


class VocabParallelCausalLMLoss:
    """transformers' `ForCausalLMLoss` (shift, fp32, mean or sum over `num_items_in_batch`) on
    split logits: a model's `loss_function` under `keep_logits_split`."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: Optional[int] = None,
                 num_items_in_batch=None, ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None,
                 **kwargs) -> torch.Tensor:
        tp = self.comm.topology.tp_size
        if vocab_size is not None and logits.shape[-1] * tp != vocab_size:
            raise ValueError(f"logits of {logits.shape[-1]} vocabulary entries on each of {tp} tensor-parallel "
                             f"ranks, but the vocabulary has {vocab_size}: the LM head must be the "
                             f"column-parallel one keep_logits_split left split")
        if shift_labels is None:  # tokens < n predict n, as transformers shifts
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.reshape(-1).to(logits.device)
        flat = logits.reshape(-1, logits.shape[-1])
        if num_items_in_batch is None:
            return vocab_parallel_cross_entropy(flat, target, self.comm, ignore_index, "mean")
        total = vocab_parallel_cross_entropy(flat, target, self.comm, ignore_index, "sum")
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch


def keep_logits_split(model: nn.Module) -> VocabParallelCausalLMLoss:
    """Leave the tensor-parallel LM head's logits split over the vocabulary and compute the
    model's loss on the pieces ([Note: vocabulary-parallel cross-entropy]). Call it after
    `zerodp.initialize`, on every rank. The model's logits output becomes each rank's slice
    (gather them with `gather_from_tp` to sample). Raises ValueError, naming the fix, for a
    model without a gathering LM head or without a `loss_function` to replace."""
    heads = [m for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.gather_output]
    if len(heads) != 1:
        raise ValueError(f"keep_logits_split: {type(model).__name__} has {len(heads)} tensor-parallel LM heads "
                         f"gathering their logits, not one: initialize it with Config.tensor_parallel_size > 1 and "
                         f"a plan whose LM head is 'lm_head' (colwise_gather_output)")
    if not hasattr(model, "loss_function"):
        raise ValueError(f"keep_logits_split: {type(model).__name__} has no `loss_function` (transformers' causal "
                         f"LMs and zerodp's GPT have one): compute the loss yourself with "
                         f"zerodp.tensor_parallel.vocab_parallel_cross_entropy(logits, targets, opt.comm)")
    head = heads[0]
    head.gather_output = False
    loss = VocabParallelCausalLMLoss(head.comm)
    model.loss_function = loss
    return loss
