"""Sequence parallelism for zerodp's bundled GPT (zerodp.demo.models.GPT), whose attention does
not go through transformers' registry.

[Note: sequence-parallel GPT]
The GPT is called as model(idx, targets) with targets already shifted by the caller (targets[t]
is the token after idx[t]), so both are cut as they are ([Note: sequence-parallel inputs] in
inputs.py): rank r keeps tokens [r S/k, (r+1) S/k). Its position embedding is looked up at
this rank's slice of the whole sequence's positions (a pre-hook on `transformer.wpe` adds
r S/k to the 0..S/k-1 the forward asks for). Each attention module's `attend(q, k, v)` is set
on the instance to the Ulysses exchange around the same causal sdpa ([Note: Ulysses
all-to-all] in attention.py). The model's `loss_function` is set on the instance to the summed
cross-entropy of this rank's tokens over the whole sequence's count of targets (-100 ignored),
and the forward's (logits, loss) gets the whole sequence's loss: [Note: sequence-parallel loss].
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed import Comm
from .attention import heads_to_sequence, sequences_to_heads
from .loss import sum_over_sequence

__all__ = ["GPTSequenceInputs", "is_bundled_gpt"]

_IGNORE = -100


def is_bundled_gpt(model: nn.Module) -> bool:
    """A model of the bundled GPT's shape: attention modules with `attend`, a position
    embedding at `transformer.wpe`, forward(idx, targets)."""
    params = inspect.signature(model.forward).parameters
    wpe = getattr(getattr(model, "transformer", None), "wpe", None)
    return ("idx" in params and "targets" in params and isinstance(wpe, nn.Embedding)
            and any(callable(getattr(m, "attend", None)) for m in model.modules()))


class _UlyssesCausal:
    def __init__(self, comm: Comm):
        self.comm = comm

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = sequences_to_heads(self.comm, q, k, v)
        return heads_to_sequence(F.scaled_dot_product_attention(q, k, v, is_causal=True), self.comm)


class GPTSequenceInputs:
    """[Note: sequence-parallel GPT]."""

    def __init__(self, model: nn.Module, comm: Comm):
        self.comm = comm
        self.k, self.rank = comm.topology.sp_size, comm.topology.sp_rank
        self.signature = inspect.signature(model.forward)
        self.offset = 0
        self.num_items = None
        self.splits = 0
        for m in model.modules():
            if callable(getattr(m, "attend", None)):
                m.attend = _UlyssesCausal(comm)
        model.transformer.wpe.register_forward_pre_hook(self.position_hook)
        model.loss_function = self.loss
        model.register_forward_pre_hook(self.pre_hook, with_kwargs=True)
        model.register_forward_hook(self.hook)

    def position_hook(self, module: nn.Module, args: tuple):
        return (args[0] + self.offset,)

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        named = dict(self.signature.bind_partial(*args, **kwargs).arguments)
        idx, targets = named["idx"], named.get("targets")
        length = idx.shape[1]
        if length % self.k:
            raise ValueError(f"a sequence of {length} tokens does not split over sequence_parallel_size={self.k} "
                             f"ranks: pad the batch to a multiple of {self.k} tokens (targets -100 on the padding)")
        s = length // self.k
        self.offset = self.rank * s
        named["idx"] = idx[:, self.offset: self.offset + s].contiguous()
        if targets is not None:
            self.num_items = (targets != _IGNORE).sum()
            named["targets"] = targets[:, self.offset: self.offset + s].contiguous()
        self.splits += 1
        return (), named

    def loss(self, logits, labels, vocab_size=None, shift_labels=None, **kwargs):
        target = labels if shift_labels is None else shift_labels
        total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                                ignore_index=_IGNORE, reduction="sum")
        return total / self.num_items.to(total.device)

    def hook(self, module: nn.Module, args: tuple, output):
        logits, loss = output
        return (logits, None) if loss is None else (logits, sum_over_sequence(loss, self.comm))
