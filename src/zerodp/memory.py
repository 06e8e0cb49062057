"""The ledger of bytes each rank holds, by category, and the paper's formula for it.

Categories follow the paper's model states (arXiv 1910.02054, §3.1): compute-dtype
parameters, gradients, fp32 master weights and the optimizer's per-element states
(Adam's exp_avg and exp_avg_sq). Bytes are read off the live tensors, not computed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds for model state, by category."""

    params: int
    grads: int
    master: int
    optimizer_states: int
    comm_buffers: int
    numel: int  # Ψ: trainable elements, unpadded
    padded_numel: int  # Ψ with the flat buffers' padding
    world_size: int
    stage: int
    gathered_params_peak: int = 0  # stage 3: largest bytes of full unit parameters held at once

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states

    def as_dict(self) -> dict:
        return {**asdict(self), "model_state": self.model_state}


def tensors_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        seen[(st.data_ptr(), t.device)] = st.nbytes()
    return sum(seen.values())


def is_elementwise_state(value, param: torch.Tensor) -> bool:
    """A per-element optimizer state (shaped like its parameter, e.g. Adam's exp_avg), as
    opposed to a 0-dim scalar such as Adam's step counter."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape


def optimizer_state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-element optimizer states; scalar states such as Adam's step counter are
    not model state in the paper's sense."""
    return sum(v.numel() * v.element_size() for p, state in optimizer.state.items()
               for v in state.values() if is_elementwise_state(v, p))


def formula_bytes(stage: int, numel: int, world_size: int, param_bytes: int, grad_bytes: int,
                  master_bytes: int, state_bytes: int) -> dict:
    """What each category should hold for Ψ=`numel` (already padded) at `stage` on N ranks:
    the paper's Table 1 row split by category (DESIGN.md's stage table). `master_bytes` is 0
    when the fp32 parameters are their own master copy."""
    n = world_size
    shard = numel // n
    return {
        "params": numel * param_bytes if stage < 3 else shard * param_bytes,
        "grads": numel * grad_bytes if stage < 2 else shard * grad_bytes,
        "master": (numel if stage == 0 else shard) * master_bytes,
        "optimizer_states": (numel if stage == 0 else shard) * state_bytes,
    }
