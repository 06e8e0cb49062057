"""The input split: every rank of an ``sp`` group is given the whole batch, and keeps its slice.

[Note: sequence-parallel inputs]
The ranks of a group are fed the same full-length `input_ids` (or `inputs_embeds`), `labels`,
`attention_mask` and `position_ids`, as tensor-parallel ranks are. A forward pre-hook on the
root model cuts them before the model sees them: rank r keeps tokens [r S/k, (r+1) S/k).

- labels: a causal LM predicts token t+1 at position t, so the labels are shifted on the
  whole sequence first (`shift_labels`: labels[:, 1:] and an ignored last position) and then
  cut; the last token of a slice thus predicts the first token of the next slice, as without
  the split. The model's loss gets `shift_labels` (transformers' causal-LM loss uses them
  as they are) and `num_items_in_batch`, the whole sequence's count of labelled tokens
  (the caller's own, when it gives one): [Note: sequence-parallel loss] in loss.py.
- position_ids: the caller's, cut (each sample's own positions); else positions 0..S-1 of
  the whole sequence, cut.
- packed samples (padding-free batches: TRL's, transformers' DataCollatorWithFlattening): a
  sample starts wherever the whole row's position_ids do not count up by one (transformers'
  own rule, masking_utils.find_packed_sequence_indices). Attention stays inside a sample: the
  whole sequence's mask is causal and block-diagonal by sample. No label crosses a sample:
  the shifted label of a sample's last token is ignored (the collators already give -100 at
  each sample's first token, so for them this changes nothing).
- attention_mask: a 2-D padding mask is kept whole; the model gets none, and the mask function
  registered for it returns the whole sequence's (causal, by sample, and padding) instead of
  its slice's, which the model hands every layer's attention (attention.py); 4-D masks are
  refused. Padded or packed, the mask is one boolean [B, 1, S, S] per forward (an additive one
  for eager): S^2 per row, as the model's own mask for eager and sdpa's math kernel.
- a length not divisible by k is refused (pad the batch to a multiple of k).
- use_cache is turned off: a cache would hold this rank's slice's keys only.

Before the split, the ranks of the group compare a fingerprint of what they were given
([Note: tensor-parallel input fingerprint] in tensor_parallel/inputs.py, over ``sp``): a
rank fed another batch raises on every rank instead of training on a mixture.

A forward hook then replaces the output's loss by the whole sequence's. The output's logits
are this rank's slice of the sequence; its per-token values ([B, S/k] tensors: the log-probs,
entropies and label mask of TRL's fused LM head, from which TRL's trainers compute their loss
and metrics) are gathered whole, [B, S] ([Note: sequence-parallel loss]).
"""
from __future__ import annotations

import inspect
import itertools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ..config import ConfigError
from ..distributed import Comm
from ..tensor_parallel.inputs import InputFingerprint
from .attention import UlyssesAttention
from .gpt import GPTSequenceInputs, is_bundled_gpt
from .loss import gather_over_sequence, sum_over_sequence

__all__ = ["SequenceInputs", "SequenceParallelModel", "apply_sequence_parallel", "check_model"]

_IGNORE = -100  # transformers' ignore_index
_BASES = ("sdpa", "eager")
_NAMES = itertools.count()
_SPLIT: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class SequenceInputs:
    """The root model's forward pre-hook and hook: [Note: sequence-parallel inputs]."""

    def __init__(self, comm: Comm, forward):
        self.comm = comm
        self.k, self.rank = comm.topology.sp_size, comm.topology.sp_rank
        self.signature = inspect.signature(forward)
        self.padding: Optional[torch.Tensor] = None  # [B, S] of the current forward
        self.samples: Optional[torch.Tensor] = None  # [B, S] sample index of each token, when packed
        self.batch, self.length = 0, 0
        self._masks: dict = {}
        self.model_builds_mask = False  # the model asked for its mask through the registry
        self.splits = 0  # forwards split

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        s = t.shape[1] // self.k
        return t[:, self.rank * s: (self.rank + 1) * s].contiguous()

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        bound = self.signature.bind_partial(*args, **kwargs)
        named = dict(bound.arguments)
        named.update(named.pop("kwargs", None) or {})
        tokens = named.get("input_ids")
        tokens = tokens if tokens is not None else named.get("inputs_embeds")
        if tokens is None:
            raise ValueError("sequence parallelism splits input_ids or inputs_embeds along the sequence: pass one")
        batch, length = tokens.shape[0], tokens.shape[1]
        if length % self.k:
            raise ValueError(f"a sequence of {length} tokens does not split over sequence_parallel_size={self.k} "
                             f"ranks: pad the batch to a multiple of {self.k} tokens (labels -100 and "
                             f"attention_mask 0 on the padding)")
        mask = named.pop("attention_mask", None)
        if mask is not None and mask.dim() != 2:
            raise ValueError(f"sequence parallelism takes a 2-D attention_mask [batch, tokens]; got {mask.dim()}-D: "
                             f"pass the padding mask, or position_ids for packed sequences")
        self.padding = None if mask is None or bool(mask.all()) else mask.to(torch.bool)
        self.batch, self.length, self._masks = batch, length, {}
        for name in ("input_ids", "inputs_embeds"):
            if named.get(name) is not None:
                named[name] = self._slice(named[name])
        positions = named.get("position_ids")
        self.samples, starts = None, None
        if positions is None:
            positions = torch.arange(length, device=tokens.device).unsqueeze(0).expand(batch, length)
        else:
            positions = positions.reshape(-1, length).expand(batch, length)
            self.samples, starts = _samples(positions)
        named["position_ids"] = self._slice(positions)
        labels = named.get("labels")
        shift = named.pop("shift_labels", None)
        if labels is not None or shift is not None:
            if shift is None:
                shift = torch.cat([labels[:, 1:], labels.new_full((batch, 1), _IGNORE)], dim=1)
                if starts is not None:  # a sample's last token does not predict the next sample's first
                    shift[:, :-1] = shift[:, :-1].masked_fill(starts, _IGNORE)
            if named.get("num_items_in_batch") is None:
                named["num_items_in_batch"] = (shift != _IGNORE).sum()
            named["shift_labels"] = self._slice(shift)
            named["labels"] = self._slice(labels if labels is not None else shift)
        if "use_cache" in self.signature.parameters:  # a cache would hold this rank's slice's keys only
            named["use_cache"] = False
        self.splits += 1
        return (), named

    def hook(self, module: nn.Module, args: tuple, kwargs: dict, output):
        if not isinstance(output, dict):
            return output
        if output.get("loss") is not None:
            output["loss"] = sum_over_sequence(output["loss"], self.comm)
        sliced = (self.batch, self.length // self.k)
        for name, value in output.items():  # per-token values: the whole sequence's
            if name != "loss" and isinstance(value, torch.Tensor) and tuple(value.shape) == sliced:
                output[name] = gather_over_sequence(value, self.comm)
        return output

    def model_mask(self, base: str, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """Stands as the model's mask function (transformers' AttentionMaskInterface): the whole
        sequence's mask, which the model passes to every layer as its attention_mask, so that a
        checkpointed layer recomputed in backward gets its own forward's mask back."""
        self.model_builds_mask = True
        return self.mask(base, dtype, device)

    def mask(self, base: str, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """The whole sequence's attention mask for `base`: None for sdpa without padding or
        packing (its causal kernel), a boolean [B, 1, S, S] (True: attend) for sdpa with either,
        an additive one in `dtype` for eager; built once per forward."""
        key = (base, dtype, device)
        if key not in self._masks:
            if base == "sdpa" and self.padding is None and self.samples is None:
                self._masks[key] = None
            else:
                n = self.length
                allowed = torch.ones(n, n, dtype=torch.bool, device=device).tril()[None, None]
                if self.samples is not None:  # block-diagonal: a token attends within its own sample
                    samples = self.samples.to(device)
                    allowed = allowed & (samples[:, None, :, None] == samples[:, None, None, :])
                if self.padding is not None:
                    allowed = allowed & self.padding.to(device)[:, None, None, :]
                if base == "eager":
                    low = torch.finfo(dtype).min
                    allowed = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, low)
                self._masks[key] = allowed
        return self._masks[key]


def _samples(positions: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Packed samples in rows of `positions` [B, S]: a sample starts where the positions do not
    count up by one. Returns (the sample index of each token [B, S], whether token t+1 starts a
    sample [B, S-1]), or (None, None) when every row is one sample."""
    starts = positions.diff(dim=-1) != 1
    if not bool(starts.any()):
        return None, None
    index = torch.cat([torch.zeros_like(positions[:, :1]), starts.to(positions.dtype).cumsum(-1)], dim=-1)
    return index, starts


@dataclass(frozen=True)
class SequenceParallelModel:
    """What `apply_sequence_parallel` did: the input split and the attention function it
    registered (its name in transformers' registry; "" for the bundled GPT)."""

    inputs: object  # SequenceInputs, or GPTSequenceInputs
    attention: str
    fingerprint: InputFingerprint


def _check_heads(config, k: int) -> None:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        raise ConfigError(f"Config.sequence_parallel_size={k}: the model's config names no num_attention_heads to "
                          f"split over the ranks")
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if n % k:
            raise ConfigError(f"Config.sequence_parallel_size={k}: the model's {n} {what} do not split over {k} "
                              f"ranks (each rank attends with whole heads): use a sequence_parallel_size that divides "
                              f"{n}")


def check_model(model: nn.Module, k: int) -> None:
    """Raises ConfigError naming the fix when `model` cannot be split over k ranks: it must
    be the bundled GPT or a Hugging Face model whose attention goes through transformers'
    registry (attn_implementation "sdpa" or "eager"), with heads and key/value heads
    divisible by k."""
    config = getattr(model, "config", None)
    base = getattr(config, "_attn_implementation", None)
    if is_bundled_gpt(model):  # [Note: sequence-parallel GPT]
        heads = config.n_head
        if heads % k:
            raise ConfigError(f"Config.sequence_parallel_size={k}: the model's {heads} attention heads do not split "
                              f"over {k} ranks (each rank attends with whole heads): use a sequence_parallel_size "
                              f"that divides {heads}")
        return
    if model in _SPLIT:
        raise ConfigError(f"{type(model).__name__} is already split for sequence parallelism")
    if base not in _BASES:
        raise ConfigError(f"Config.sequence_parallel_size={k}: {type(model).__name__} is neither zerodp's bundled "
                          f"GPT nor a Hugging Face model whose attention goes through transformers' attention "
                          f"registry with attn_implementation in {_BASES} (it has {base!r}): load it with "
                          f"attn_implementation='sdpa' or 'eager'")
    _check_heads(config, k)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        raise ConfigError(f"Config.sequence_parallel_size={k}: {type(model).__name__} attends within a sliding "
                          f"window of {window} tokens, and the whole sequence's mask built here is causal only: "
                          f"use sequence_parallel_size=1 for it")


def apply_sequence_parallel(model: nn.Module, comm: Comm) -> SequenceParallelModel:
    """Install the input split and the Ulysses attention (`check_model` first)."""
    k = comm.topology.sp_size
    check_model(model, k)
    fingerprint = InputFingerprint(comm, "sp")  # before the split: the group's whole inputs
    fingerprint.install(model)
    if is_bundled_gpt(model):
        return SequenceParallelModel(GPTSequenceInputs(model, comm), "", fingerprint)
    config, base = model.config, model.config._attn_implementation
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    inputs = SequenceInputs(comm, model.forward)
    name = f"zerodp_ulysses_{base}_{next(_NAMES)}"
    AttentionInterface.register(name, UlyssesAttention(base, comm, inputs))
    AttentionMaskInterface.register(name, lambda *args, dtype=torch.float32, device=None, **kwargs:
                                    inputs.model_mask(base, dtype, device))
    config._attn_implementation = name
    model.register_forward_pre_hook(inputs.pre_hook, with_kwargs=True)
    model.register_forward_hook(inputs.hook, with_kwargs=True)
    _SPLIT.add(model)
    return SequenceParallelModel(inputs, name, fingerprint)
