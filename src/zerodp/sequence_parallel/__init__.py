"""Sequence parallelism beside ZeRO (Ulysses, arXiv 2309.14509; ALST, arXiv 2506.13996): the
ranks of an ``sp`` group read one batch, each keeps its slice of the sequence, attention runs
on head shards of the whole sequence through two all-to-alls, and the loss returned is the
whole sequence's. docs/long_context.md."""
from __future__ import annotations

from .attention import heads_to_sequence, sequence_to_heads
from .inputs import SequenceParallelModel, apply_sequence_parallel, check_model
from .loss import sum_over_sequence
from .tiled_loss import apply_tiled_loss, tiled_cross_entropy

__all__ = ["SequenceParallelModel", "apply_sequence_parallel", "apply_tiled_loss", "check_model", "heads_to_sequence",
           "sequence_to_heads", "sum_over_sequence", "tiled_cross_entropy"]
