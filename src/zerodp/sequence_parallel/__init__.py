"""Sequence parallelism beside ZeRO (Ulysses, arXiv 2309.14509; ALST, arXiv 2506.13996): the
ranks of an ``sp`` group read one batch, each keeps its slice of the sequence, attention runs
on head shards of the whole sequence through two all-to-alls, and the loss returned is the
whole sequence's; the tiled loss and MLP keep a layer's largest activations to a tile at a time.
docs/long_context.md."""
from __future__ import annotations

from .attention import heads_to_sequence, sequence_to_heads, sequences_to_heads
from .inputs import SequenceParallelModel, apply_sequence_parallel, check_model
from .loss import sum_over_sequence
from .tiled_loss import apply_tiled_loss, tiled_cross_entropy
from .tiled_mlp import apply_tiled_mlp, mlp_tiles

__all__ = ["SequenceParallelModel", "apply_sequence_parallel", "apply_tiled_loss", "apply_tiled_mlp", "check_model",
           "heads_to_sequence", "mlp_tiles", "sequence_to_heads", "sequences_to_heads", "sum_over_sequence",
           "tiled_cross_entropy"]
