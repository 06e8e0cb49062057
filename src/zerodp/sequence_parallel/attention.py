"""Ulysses attention: sequence shards to head shards before attention, and back after it.

[Note: Ulysses all-to-all]
Rank r of an ``sp`` group of k holds tokens [r s, (r+1) s) of a sequence of S = k s tokens,
for every head: q, k, v of shape [B, H, s, D]. One all-to-all over ``sp`` sends head group j
(heads [j H/k, (j+1) H/k)) of its tokens to rank j, which then holds every token of its H/k
heads, [B, H/k, S, D], in sequence order (the pieces arrive by sender, and sender i holds
the i-th slice of the sequence). Attention over the whole sequence runs there unchanged, per
head; a second all-to-all, the first's reverse, brings each rank its own tokens of every
head's output. The backward of each exchange is the other one. Per layer a rank keeps 1/k
of its q, k, v and output and sends the rest: (k-1)/k of 4 B (S/k) H D elements with as many
kv as query heads (arXiv 2309.14509): the volume per link stays constant when the sequence
and k grow together.

Grouped-query attention: with Hkv key/value heads and Hkv divisible by k, rank j receives
kv heads [j Hkv/k, (j+1) Hkv/k), exactly those its query heads [j H/k, (j+1) H/k) read
(query head h reads kv head h // (H / Hkv)), so the module's num_key_value_groups holds.

q, k and v travel in one exchange (`sequences_to_heads`): rank j's head groups of the three
are put side by side in one message (flattened: their head counts and sizes may differ), so
a layer runs two all-to-alls forward and two in backward instead of four and four, the same
bytes. Each exchange waits on every rank of the group; with more ranks than cores (4 ranks
on 2 cores) those waits, not the bytes, are the cost of Ulysses.
"""
from __future__ import annotations

import sys

import torch

from ..distributed import Comm

__all__ = ["UlyssesAttention", "heads_to_sequence", "sequence_to_heads", "sequences_to_heads"]

_LABEL = "ulysses attention"


def _exchange(x: torch.Tensor, comm: Comm, phase: str) -> torch.Tensor:
    """All-to-all over ``sp`` of x [k, ...]: row j to rank j, row i of the result from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    k = x.shape[0]
    comm.all_to_all(out, x, [1] * k, [1] * k, phase, axis="sp", label=_LABEL, uneven=False)
    return out


def _exchange_blocks(blocks: list, comm: Comm, phase: str) -> list:
    """Each of `blocks` ([k, ...] each) exchanged as `_exchange` does, in one all-to-all: row j
    of every block goes to rank j in one message, the blocks' rows side by side, flattened
    (their head counts and head sizes may differ: GQA's kv heads, DeepSeek's 192-wide q and k
    beside a 128-wide v). Blocks of different dtypes go in exchanges of their own."""
    if len(blocks) == 1 or len({b.dtype for b in blocks}) > 1:
        return [_exchange(b, comm, phase) for b in blocks]
    k, sizes = blocks[0].shape[0], [b[0].numel() for b in blocks]
    flat = torch.empty((k, sum(sizes)), dtype=blocks[0].dtype, device=blocks[0].device)
    for b, part in zip(blocks, flat.split(sizes, dim=1)):
        part.unflatten(1, b.shape[1:]).copy_(b)  # one copy, from the block's strided view
    got = _exchange(flat, comm, phase)
    return [part.unflatten(1, b.shape[1:]) for b, part in zip(blocks, got.split(sizes, dim=1))]


def _to_heads(xs: tuple, comm: Comm, phase: str) -> tuple:
    """[B, H_i, s, D_i] each (this rank's tokens, every head) -> [B, H_i/k, S, D_i] each, in one exchange."""
    k = comm.topology.sp_size
    # [k, B, H_i/k, s, D_i]: head group j of each tensor for rank j.
    blocks = [x.reshape(x.shape[0], k, x.shape[1] // k, *x.shape[2:]).transpose(0, 1) for x in xs]
    got = _exchange_blocks(blocks, comm, phase)  # sequence slice i from rank i
    return tuple(g.permute(1, 2, 0, 3, 4).reshape(g.shape[1], g.shape[2], -1, g.shape[-1]) for g in got)


def _to_sequence(xs: tuple, comm: Comm, phase: str) -> tuple:
    """[B, H_i/k, S, D_i] each (every token, this rank's heads) -> [B, H_i, s, D_i] each, in one exchange."""
    k = comm.topology.sp_size
    # [k, B, H_i/k, s, D_i]: sequence slice j of each tensor for rank j.
    blocks = [x.reshape(x.shape[0], x.shape[1], k, x.shape[2] // k, x.shape[3]).permute(2, 0, 1, 3, 4) for x in xs]
    got = _exchange_blocks(blocks, comm, phase)  # head group i from rank i
    return tuple(g.transpose(0, 1).reshape(g.shape[1], k * g.shape[2], *g.shape[3:]) for g in got)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: Comm, *xs: torch.Tensor):
        ctx.comm = comm
        return _to_heads(xs, comm, "forward")

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *_to_sequence(grads, ctx.comm, "backward"))


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm: Comm, *xs: torch.Tensor):
        ctx.comm = comm
        return _to_sequence(xs, comm, "forward")

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *_to_heads(grads, ctx.comm, "backward"))


def sequences_to_heads(comm: Comm, *xs: torch.Tensor) -> tuple:
    """`sequence_to_heads` of several tensors (q, k, v) in one exchange: [Note: Ulysses all-to-all]."""
    return _SequenceToHeads.apply(comm, *xs)


def sequence_to_heads(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[B, H, s, D] (this rank's tokens, every head) -> [B, H/k, S, D] (every token, this
    rank's heads): [Note: Ulysses all-to-all]."""
    return _SequenceToHeads.apply(comm, x)[0]


def heads_to_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The reverse of `sequence_to_heads`: [B, H/k, S, D] -> [B, H, s, D]."""
    return _HeadsToSequence.apply(comm, x)[0]


class UlyssesAttention:
    """A Hugging Face attention function (transformers' AttentionInterface signature) that
    runs `base` ("sdpa" or "eager") on head shards of the whole sequence, with the mask of the
    whole sequence (causal, and the batch's padding from its full `attention_mask`), built once
    per forward from what the input split kept (`SequenceInputs`): the model passes it in as
    attention_mask when it asks the registry for its mask, as transformers' models do."""

    def __init__(self, base: str, comm: Comm, inputs):
        self.base, self.comm, self.inputs = base, comm, inputs

    def _function(self, module):
        if self.base == "eager":  # each model family has its own, beside its attention module
            found = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if found is None:
                raise TypeError(f"{type(module).__name__}: its module defines no eager_attention_forward for "
                                f"sequence parallelism to call; use attn_implementation='sdpa'")
            return found
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        comm = self.comm
        q, k, v = sequences_to_heads(comm, query, key, value)
        if self.inputs.model_builds_mask:  # the whole sequence's, from the model: its own forward's
            mask = attention_mask
        else:  # a model that builds no mask: this forward's, from the split
            mask = self.inputs.mask(self.base, q.dtype, q.device)
        out, weights = self._function(module)(module, q, k, v, mask, **kwargs)  # [B, S, H/k, D]
        out = heads_to_sequence(out.transpose(1, 2), comm).transpose(1, 2)  # [B, s, H, D]
        return out, weights
