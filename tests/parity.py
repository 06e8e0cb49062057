"""Per-step parity: every parameter, every exposed gradient and the loss, at every step.

A run records a `StepTrace` as it trains (the training loops in core_cases take one); two
traces of the same schedule compare step by step, so a divergence is reported at the step
where it starts, not only as a difference of the final weights, which later steps can
hide (AdamW normalises a wrong gradient scale away) or amplify.

Gradients are compared where the run exposes them in full: DDP's `.grad` and zerodp's at
stage 0 (a view of the all-reduced flat buffer). At stage 1 only the owned part of the flat
buffer is reduced (the rest keeps the rank's local sum), and at stages 2-3 `.grad` is a
zero-cost handle (docs/contract.md), not a value, so there the gradient shows through the
parameters instead: under the grids' plain SGD each step's update is lr times the reduced
gradient, so a wrong gradient on any element is a wrong parameter one step later.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a-b| / (1 + |b|), in fp32: relative above 1, absolute below (a purely
    relative error means nothing for elements near 0, e.g. zero-initialised biases)."""
    a, b = a.detach().float(), b.detach().float()
    return float(((a - b).abs() / (1 + b.abs())).max()) if a.numel() else 0.0


def max_rel_diff_of(a: dict, b: dict) -> float:
    """`rel_diff` over the tensors two name -> tensor maps share; both must hold the same names."""
    if set(a) != set(b):
        raise AssertionError(f"the runs hold other tensors: {sorted(set(a) ^ set(b))}")
    return max((rel_diff(a[n], b[n]) for n in a), default=0.0)


@dataclass
class StepTrace:
    """What one run looked like after each optimizer step."""

    losses: list = field(default_factory=list)
    params: list = field(default_factory=list)  # per step: name -> fp32 copy
    grads: list = field(default_factory=list)  # per step: name -> fp32 copy, or None where not exposed

    def record_grads(self, model: nn.Module, exposed: bool = True) -> None:
        """Before the step: the gradients the step will apply (None when not exposed)."""
        if not exposed:
            self.grads.append(None)
            return
        self.grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()
                           if p.grad is not None})

    def record_step(self, model: nn.Module, loss: float) -> None:
        """After the step: the loss it was computed from and every parameter and floating
        buffer, whole. Stages 0-2 shard nothing the state dict returns; at stage 3 the
        state dict gathers each unit through zerodp's collectives (phase "checkpoint"), so a
        test that reads the comm ledger leaves that phase out (or snapshots with
        zerodp.full_state_dict, one gather per unit: hybrid_cases.UnitTrace)."""
        self.losses.append(float(loss))
        whole = {}
        for name, value in model.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if value.is_floating_point():
                whole[name] = value.detach().float().clone()
        self.params.append(whole)

    def compare(self, other: "StepTrace") -> dict:
        """Per step: the largest parameter and gradient difference and the loss gap."""
        if len(self.params) != len(other.params):
            raise AssertionError(f"the runs took {len(self.params)} and {len(other.params)} steps")
        grads = [max_rel_diff_of(a, b) if a is not None and b is not None else None
                 for a, b in zip(self.grads, other.grads)]
        return {"params": [max_rel_diff_of(a, b) for a, b in zip(self.params, other.params)],
                "grads": grads,
                "losses": [abs(a - b) for a, b in zip(self.losses, other.losses)]}


def worst(per_step: dict) -> dict:
    """The largest difference over the steps, by kind (gradients: over the exposed steps)."""
    grads = [g for g in per_step["grads"] if g is not None]
    return {"params": max(per_step["params"]), "losses": max(per_step["losses"]),
            "grads": max(grads) if grads else None}
