"""The parts of the Config each component reads, as small frozen policies.

The user's Config stays one flat dataclass (a YAML file of fields keeps working); each
component takes only the policy it acts on (`Config.precision`, `Config.backward`, ...), as
FSDP2's `fully_shard` takes a `MixedPrecisionPolicy` and an `OffloadPolicy`, so that what a
component can depend on is visible in its signature.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

__all__ = ["BackwardPolicy", "OffloadPolicy", "PrecisionPolicy", "StepPolicy", "TensorParallelPolicy",
           "UnitPolicy", "ZeroPPPolicy"]


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of the model's tensors (Config.mixed_precision, reduce_dtype, cast_buffers)."""

    name: str  # Config.mixed_precision, for messages
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype  # gradients are reduced and their shard kept in it
    cast_buffers: bool


@dataclass(frozen=True)
class StepPolicy:
    """What a step does with the gradients' scale and with a nan/inf (the step guard)."""

    loss_scaling: Literal["none", "dynamic", "fixed"]
    loss_scale: float  # the fixed scale, or the dynamic one's first
    growth_interval: int
    nonfinite_grads: Literal["raise", "skip", "proceed"]


@dataclass(frozen=True)
class BackwardPolicy:
    """When and in what sizes gradients are reduced (the backward schedule)."""

    accumulation_steps: int
    reduce_each_micro_batch: bool
    overlap_comm: bool
    bucket_bytes: int


@dataclass(frozen=True)
class UnitPolicy:
    """Stage 3's units: which modules, and when they are gathered and freed."""

    unit_modules: tuple
    unit_min_params: int
    reshard_after_forward: bool
    prefetch_units: int
    check_same_unit: bool  # Config.debug: every gather compared across ranks


@dataclass(frozen=True)
class OffloadPolicy:
    """Where the optimizer's and stage 3's long-lived buffers live (ZeRO-Offload, -Infinity)."""

    optimizer: Literal["none", "host", "disk"]
    params: Literal["none", "host", "disk"]
    directory: Optional[str]
    delayed_update_after: Optional[int]


@dataclass(frozen=True)
class ZeroPPPolicy:
    """ZeRO++ at stage 3: hpZ's node copies, qwZ's and qgZ's quantized transfers."""

    hpz: bool
    weight_bits: Optional[int]  # qwZ: 8, or None
    grad_bits: Optional[int]  # qgZ: 8 or 4, or None
    block_size: int

    @property
    def quantized(self) -> bool:
        return self.weight_bits is not None or self.grad_bits is not None


@dataclass(frozen=True)
class TensorParallelPolicy:
    """Tensor parallelism inside each data-parallel rank, and ZeRO-R's Pa and Pa+cpu."""

    size: int
    partition_activations: bool
    activations_on_host: bool
