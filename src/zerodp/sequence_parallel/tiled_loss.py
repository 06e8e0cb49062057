"""Sequence-tiled logits and loss (ALST, arXiv 2506.13996): a causal LM's head and
cross-entropy computed a tile of tokens at a time, so that no [tokens, vocab] tensor of a
rank's sequence exists at once.

[Note: tiled logits and loss]
At long sequences the logits are the largest activation of a causal LM: [T, V] in fp32 for
the loss (V = 128k for Llama 3: 512 KiB a token, 4 GiB at 8k tokens), while the hidden
states are [T, H] (H = 4k). With `Config.tiled_loss`, the model's output embedding (its LM
head, an nn.Linear) computes the loss itself when labels were given: tiles of
ceil(T / ceil(V / H)) tokens (so that a tile's logits are about the size of the hidden
states), each tile's logits, upcast to fp32, and summed cross-entropy computed in an autograd
Function that keeps only the hidden states, weight and labels: a tile's logits are freed once
its loss is summed, and backward recomputes them one tile at a time, turns them into the
gradient of the logits (softmax minus the label's one-hot) and adds that tile's weight
gradient into one buffer, so that the head's gradient exists once, as untiled, rather than
once more per tile beside the sum. The sum is divided by the labelled token count
(the whole sequence's under sequence parallelism: [Note: sequence-parallel loss]), as
transformers' causal-LM loss divides. The weight is used inside the head's own call, so
stage 3 gathers it there and again for backward, as it does for the untiled head.

The head returns the loss, which the model's `loss_function` (replaced) hands back as its
loss; the output's `logits` are None on such forwards. A forward without labels runs the
head unchanged. Models that transform the logits between head and loss (a final soft-cap)
are refused.
"""
from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError

__all__ = ["TiledLoss", "apply_tiled_loss", "tiled_cross_entropy"]

_IGNORE = -100


class _TiledLinearCrossEntropy(torch.autograd.Function):
    """sum of cross_entropy(hidden @ weight.T + bias, labels) over tiles of rows: the forward
    keeps no logits; the backward recomputes each tile's and adds its weight gradient into one
    buffer ([Note: tiled logits and loss])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, tile_tokens: int):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], tile_tokens):
            logits = F.linear(hidden[start: start + tile_tokens], weight, bias).float()
            total += F.cross_entropy(logits, labels[start: start + tile_tokens], ignore_index=_IGNORE, reduction="sum")
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.tile_tokens = tile_tokens
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros_like(bias) if want_b else None
        for start in range(0, hidden.shape[0], ctx.tile_tokens):
            h, y = hidden[start: start + ctx.tile_tokens], labels[start: start + ctx.tile_tokens]
            # d(sum of cross-entropy)/d logits = softmax - one_hot(label), zero on ignored rows
            d = F.linear(h, weight, bias).float().softmax(dim=-1)
            kept = y != _IGNORE
            rows = torch.arange(len(y), device=y.device)
            d[rows[kept], y[kept]] -= 1.0
            d[~kept] = 0.0
            d = (d * grad).to(weight.dtype)
            if want_h:
                torch.mm(d, weight, out=grad_h[start: start + ctx.tile_tokens])
            if want_w:
                grad_w.addmm_(d.t(), h)
            if want_b:
                grad_b += d.sum(dim=0)
        return grad_h, grad_w, grad_b, None, None


def tiled_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        labels: torch.Tensor, num_items, tile_tokens: Optional[int] = None) -> torch.Tensor:
    """sum of cross_entropy(hidden @ weight.T + bias, labels) / num_items, computed in tiles
    of `tile_tokens` tokens (default: [Note: tiled logits and loss]), each recomputed in
    backward. hidden [..., H], labels [...] (-100 ignored)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    tokens = h.shape[0]
    if tile_tokens is None:
        tile_tokens = math.ceil(tokens / math.ceil(weight.shape[0] / h.shape[1]))
    if tokens == 0:
        total = h.sum() * 0.0
    else:
        total = _TiledLinearCrossEntropy.apply(h, weight, bias, y, max(1, tile_tokens))
    if torch.is_tensor(num_items):
        num_items = num_items.to(total.device)
    return total / num_items


class TiledLoss:
    """The root's pre-hook (it reads the labels the model is given, after the sequence split's
    pre-hook), the head's forward and the model's loss function: [Note: tiled logits and loss]."""

    def __init__(self, model: nn.Module, head: nn.Linear):
        self.head, self.head_forward = head, head.forward
        self.loss_function = model.loss_function
        self.signature = inspect.signature(model.forward)
        self.labels: Optional[torch.Tensor] = None
        self.num_items = None
        self.computed = False  # the head computed this forward's loss
        self.tiles_run = 0

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        bound = self.signature.bind_partial(*args, **kwargs)
        named = dict(bound.arguments)
        named.update(named.pop("kwargs", None) or {})
        labels, shift = named.get("labels"), named.get("shift_labels")
        self.computed = False
        if labels is None and shift is None:
            self.labels = None
            return None
        if shift is None:
            shift = F.pad(labels, (0, 1), value=_IGNORE)[..., 1:]
        self.labels = shift
        self.num_items = named.get("num_items_in_batch")
        if self.num_items is None:
            self.num_items = (shift != _IGNORE).sum()
        return None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.labels is None:
            return self.head_forward(hidden)
        labels, self.labels = self.labels, None
        self.computed = True
        return tiled_cross_entropy(hidden, self.head.weight, self.head.bias, labels, self.num_items)

    def loss(self, logits, labels=None, vocab_size=None, **kwargs):
        if self.computed:
            return logits  # the head's output is already the loss
        return self.loss_function(logits=logits, labels=labels, vocab_size=vocab_size, **kwargs)

    def hook(self, module: nn.Module, args: tuple, kwargs: dict, output):
        if self.computed and isinstance(output, dict) and "logits" in output:
            output["logits"] = None
        self.computed = False
        return output


def apply_tiled_loss(model: nn.Module) -> TiledLoss:
    """Install [Note: tiled logits and loss] on a Hugging Face causal LM; raises ConfigError
    naming the fix when the model's head or loss is not one it can tile."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if not isinstance(head, nn.Linear) or not hasattr(model, "loss_function"):
        raise ConfigError(f"Config.tiled_loss: {type(model).__name__} is not a Hugging Face causal LM whose "
                          f"output embedding is an nn.Linear and whose loss is its loss_function: use "
                          f"tiled_loss=False")
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if cap:
        raise ConfigError(f"Config.tiled_loss: {type(model).__name__} soft-caps its logits "
                          f"(final_logit_softcapping={cap}) between head and loss, which the tiles do not: use "
                          f"tiled_loss=False")
    tiled = TiledLoss(model, head)
    model.register_forward_pre_hook(tiled.pre_hook, with_kwargs=True)
    model.register_forward_hook(tiled.hook, with_kwargs=True)
    head.forward = tiled.forward
    model.loss_function = tiled.loss
    return tiled
