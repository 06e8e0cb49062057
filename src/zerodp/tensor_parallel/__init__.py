"""Tensor parallelism beside ZeRO: Megatron's layers over the ``tp`` mesh axis, their own random
stream in the split region, a check that every tensor-parallel rank is fed the same input,
and ZeRO-R's partitioned activation checkpoints (Pa, Pa+cpu). docs/tensor_parallel.md."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.nn as nn

from ..policies import TensorParallelPolicy
from ..distributed import Comm
from .activations import CheckpointStore
from .inputs import InputFingerprint
from .layers import ColumnParallelLinear, RegionEntry, RowParallelLinear, VocabParallelEmbedding, gather_from_tp
from .loss import VocabParallelCausalLMLoss, keep_logits_split, vocab_parallel_cross_entropy
from .plan import apply_tensor_parallel, plan_of
from .split import TensorSplit

__all__ = ["CheckpointStore", "ColumnParallelLinear", "InputFingerprint", "RegionEntry", "RowParallelLinear",
           "TensorParallelModel", "TensorSplit", "VocabParallelCausalLMLoss", "VocabParallelEmbedding",
           "apply_tensor_parallel", "gather_from_tp", "keep_logits_split", "parallelize", "plan_of",
           "vocab_parallel_cross_entropy"]


@dataclass(frozen=True)
class TensorParallelModel:
    """What `parallelize` did to a model: how it split each parameter it split over the ``tp``
    axis (by name; the rest are replicated there: [Note: tensor-parallel split]), the
    checkpoint store, with Pa or Pa+cpu, and the input check ([Note: tensor-parallel input
    fingerprint]) under tensor parallelism."""

    splits: Mapping[str, TensorSplit]
    checkpoints: Optional[CheckpointStore]
    inputs: Optional[InputFingerprint] = None
    heads: tuple = ()  # the tensor-parallel LM heads (ColumnParallelLinear), for the ledger's logits_peak

    @property
    def logits_peak_nbytes(self) -> int:
        return max((h.logits_peak_nbytes for h in self.heads), default=0)

    @property
    def split_names(self) -> frozenset:
        return frozenset(self.splits)


def parallelize(model: nn.Module, comm: Comm, policy: TensorParallelPolicy) -> Optional[TensorParallelModel]:
    """Split `model` in place by its plan (tensor_parallel_size > 1) and install the checkpoint
    store (partition_activations / activations_on_host); None when neither is asked for."""
    split, inputs = {}, None
    if policy.size > 1:
        _same_on_every_tp_rank(model, comm)
        split = apply_tensor_parallel(model, comm)
        inputs = InputFingerprint(comm)
        inputs.install(model)
    store = None
    # Under tensor parallelism the store also keeps whole checkpoints (no Pa), so that the
    # ledger counts them either way.
    if policy.size > 1 or policy.partition_activations or policy.activations_on_host:
        store = CheckpointStore(comm, policy.partition_activations, policy.activations_on_host)
        store.install(model)
    if not split and store is None:
        return None
    heads = tuple(m for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.is_head)
    return TensorParallelModel(split, store, inputs, heads)


@torch.no_grad()
def _same_on_every_tp_rank(model: nn.Module, comm: Comm) -> None:
    """Tensor-parallel rank 0's weights, buffers and random state on every rank of its group,
    as DDP starts from rank 0's: each rank cuts its slice of the same weights, the replicated
    ones stay equal, and dropout outside the split region draws the same numbers (inside it,
    each rank's own: [Note: tensor-parallel random streams])."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.device == comm.device and t.is_contiguous():
            comm.broadcast(t.data, 0, "init", axis="tp", label="tensor-parallel start")
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(comm.device)] if comm.device.type == "cuda" else [])
    for i, state in enumerate(states):
        shared = state.to(comm.device)
        comm.broadcast(shared, 0, "init", axis="tp", label="tensor-parallel start")
        if i == 0:
            torch.set_rng_state(shared.cpu())
        else:
            torch.cuda.set_rng_state(shared.cpu(), comm.device)
