"""Loss scaling for fp16 training.

fp16 has 5 exponent bits, so small gradients underflow; the loss is multiplied by a scale
before backward and the gradients divided by it before the step (Micikevicius et al.,
"Mixed Precision Training", arXiv 1710.03740, §3.2). The dynamic scaler halves the scale
and skips the step when any rank sees an inf/nan, and doubles it after
`growth_interval` clean steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..policies import StepPolicy
from .clipping import local_nonfinite


@dataclass
class LossScaler:
    scale: float = 1.0
    dynamic: bool = False
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    clean_steps: int = 0
    skipped_steps: int = 0

    @classmethod
    def from_policy(cls, policy: StepPolicy) -> "LossScaler":
        return cls(scale=policy.loss_scale, dynamic=policy.loss_scaling == "dynamic",
                   growth_interval=policy.growth_interval)

    def update(self, found_inf: bool) -> None:
        """Record one step's outcome: back off on inf/nan, grow after a clean interval."""
        if found_inf:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def check_scaled(self, rank: int, backwards: int, scaled_backwards: int) -> None:
        """Every backward since the last step went through `optimizer.backward`, which scales
        the loss (the step divides by the scale)."""
        plain = backwards - scaled_backwards
        if self.scale != 1.0 and plain > 0:
            raise RuntimeError(
                f"rank {rank}: {plain} of the {backwards} backward passes since the last step ran as "
                f"loss.backward(); under fp16 the step divides gradients by the loss scale ({self.scale:g}), so "
                f"they would be {self.scale:g}x too small: use optimizer.backward(loss), which multiplies the "
                f"loss by the scale")

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def nonfinite_flag(policy: StepPolicy, norm: Optional[float], grads: list[torch.Tensor],
                   device: torch.device) -> Optional[torch.Tensor]:
    """This rank's 0/1 verdict on a nan/inf gradient for the step agreement, when anything
    acts on it (the fp16 loss scaler, or Config.nonfinite_grads other than "proceed"): from
    the global norm when clip_grad_norm_ already reduced one, else from the local pieces."""
    if policy.loss_scaling == "none" and policy.nonfinite_grads == "proceed":
        return None
    if norm is not None:
        return torch.tensor(0.0 if math.isfinite(float(norm)) else 1.0)
    return local_nonfinite(grads, device)


def nonfinite_error(rank: int, step: int) -> FloatingPointError:
    return FloatingPointError(
        f"rank {rank}: step {step}: the gradient holds nan/inf on at least one rank (a diverged loss?); the "
        f"master weights were not updated. Call optimizer.zero_grad() to go on, or set "
        f"Config.nonfinite_grads='skip' to skip such steps on every rank")
