"""What tensor-parallel tests share: a reference parameter's slice on a tensor-parallel rank,
the worst difference to it, and an error's message. Kept apart from tp_cases.py, whose
transformers import costs seconds a world that does not use it would pay."""
from __future__ import annotations

import torch


def expected_slice(name: str, full: torch.Tensor, local: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The reference parameter's part that tensor-parallel rank `tp_rank` holds: whole where
    the shapes agree (replicated), else its slice of the dim that was split (GPT's fused
    q, k, v split each of the three)."""
    if full.shape == local.shape:
        return full
    dim = next(d for d in range(full.dim()) if full.shape[d] != local.shape[d])
    parts = 3 if "c_attn" in name else 1
    packed = full.unflatten(dim, (parts, full.shape[dim] // parts))
    return packed.chunk(tp, dim=dim + 1)[tp_rank].flatten(dim, dim + 1)


def max_diff_to_reference(result: dict, ref: dict, tp_rank: int, tp: int) -> float:
    """Worst elementwise |local - reference slice| / (1 + |reference|) over the parameters."""
    worst = 0.0
    for name, local in result["params"].items():
        want = expected_slice(name, ref["params"][name], local, tp_rank, tp)
        worst = max(worst, float(((local - want).abs() / (1 + want.abs())).max()))
    return worst


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "no error"
