"""Global gradient norm and the local non-finite flag, computed from each rank's gradient shard.

Each rank reduces a scalar of its own shard over the mesh's shard axis (ranks along the
replicate axis hold the same shard, [Note: mesh axes]), so no gradient is ever gathered.
"""
from __future__ import annotations

import math

import torch

from ..distributed import Comm

__all__ = ["global_grad_norm", "local_nonfinite"]


def global_grad_norm(grads: list[torch.Tensor], norm_type: float, comm: Comm, owns_all: bool) -> torch.Tensor:
    """The norm of every rank's gradient pieces together, as torch.nn.utils.clip_grad_norm_
    computes it over the full gradient (fp32). `owns_all`: this rank holds the whole
    gradient (stage 0, or one rank), so nothing is reduced."""
    local = [g.float() for g in grads if g.numel()]
    if math.isinf(norm_type):
        # torch.amax keeps a nan (Python's max and gloo's MAX may drop it): a nan anywhere
        # makes the norm nan, as torch.nn.utils.clip_grad_norm_ reports it.
        local_max = float(torch.stack([g.abs().amax() for g in local]).amax()) if local else 0.0
        if owns_all:
            total = torch.tensor(local_max, device=comm.device)
        else:
            nan_seen = comm.sum_scalar(torch.tensor(local_max * 0.0), axis="shard")  # nan if any rank's is
            total = torch.tensor(comm.max_scalar(local_max, axis="shard") + float(nan_seen), device=comm.device)
    else:
        local_sum = sum((g.pow(norm_type).sum() for g in local),
                        torch.zeros((), dtype=torch.float64, device=comm.device))
        if not owns_all:
            local_sum = comm.sum_scalar(local_sum, axis="shard")
        total = local_sum.to(torch.float64) ** (1.0 / norm_type)
    return total.to(torch.float32)


def local_nonfinite(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 if this rank's gradient pieces hold a nan/inf, else 0.0, as a tensor on `device`
    (no host sync; the ranks combine the flags in the step's agreement). A sum keeps nan
    and inf: 14 ms for the 124M GPT's 62M-element fp32 shard on one CPU core, 0.3% of its
    step (a float64 sum took 0.34 s, isfinite().all() 0.17 s)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if g.numel():
            total += g.sum()
    return (~torch.isfinite(total)).to(torch.float64)
