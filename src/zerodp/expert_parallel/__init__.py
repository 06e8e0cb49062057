"""Expert parallelism beside ZeRO: each expert bank split by expert over ``ep``, consecutive
data-parallel ranks, tokens sent to their experts' ranks and back with all-to-all through the
comm; ZeRO shards the banks over the expert-data-parallel ranks and everything else over
all of them. docs/moe.md."""
from __future__ import annotations

from .dispatch import ExpertDispatch
from .plan import ExpertParallelModel, apply_expert_parallel, ep_plan_of

__all__ = ["ExpertDispatch", "ExpertParallelModel", "apply_expert_parallel", "ep_plan_of"]
