"""The step guard: whether a step's update is applied, decided on every rank alike.

Before the master weights change, the ranks agree, in one tiny collective, that they ran
the same collectives ([Note: step fingerprint] in distributed/comm.py) and whether any
gradient holds a nan/inf. What follows is the guard's policy: fp16's loss scaler skips
the step and backs off its scale; otherwise Config.nonfinite_grads raises on every rank,
skips the step, or proceeds.
"""
from __future__ import annotations

import enum
import logging
from typing import Optional

import torch

from ..distributed import Comm
from ..policies import StepPolicy
from .precision import LossScaler, nonfinite_error, nonfinite_flag

log = logging.getLogger(__name__)

__all__ = ["StepGuard", "StepOutcome"]


class StepOutcome(enum.Enum):
    APPLY = "apply"
    OVERFLOW = "overflow"  # fp16: an inf/nan gradient; skipped, the loss scale backs off
    SKIP = "skip"  # an inf/nan gradient under Config.nonfinite_grads="skip"


class StepGuard:
    """Loss scaling, the non-finite policy and the ranks' agreement on each step."""

    def __init__(self, comm: Comm, policy: StepPolicy):
        self.comm, self.policy = comm, policy
        self.scaler = LossScaler.from_policy(policy)
        self.skipped_steps = 0  # steps skipped for a nan/inf gradient (nonfinite_grads="skip")
        self.last_skipped = False  # the last step left the weights unchanged

    def check_scaled(self, backwards: int, scaled_backwards: int) -> None:
        self.scaler.check_scaled(self.comm.rank, backwards, scaled_backwards)

    def decide(self, grads: list[torch.Tensor], norm: Optional[torch.Tensor], step: int) -> StepOutcome:
        """Collective: the ranks' verdict on this step's gradients (`norm`: the global norm,
        when clip_grad_norm_ already reduced one). Raises on every rank under
        nonfinite_grads="raise" before anything changes."""
        nonfinite = self.comm.agree_on_step(nonfinite_flag(self.policy, norm, grads, self.comm.device))
        if self.policy.loss_scaling != "none":
            return StepOutcome.OVERFLOW if nonfinite else StepOutcome.APPLY
        if nonfinite and self.policy.nonfinite_grads == "raise":
            raise nonfinite_error(self.comm.rank, step)
        return StepOutcome.SKIP if nonfinite else StepOutcome.APPLY

    def record(self, outcome: StepOutcome, step: int) -> None:
        """After the update (or its skip): the loss scale follows, the skip is counted and logged."""
        self.last_skipped = outcome is not StepOutcome.APPLY
        if outcome is StepOutcome.OVERFLOW:
            log.warning("rank %d: inf/nan gradient, skipping step %d (loss scale %g -> %g)", self.comm.rank,
                        step, self.scaler.scale, self.scaler.scale * self.scaler.backoff_factor)
            self.scaler.update(found_inf=True)
        elif outcome is StepOutcome.SKIP:
            log.warning("rank %d: inf/nan gradient, skipping step %d (Config.nonfinite_grads='skip')",
                        self.comm.rank, step)
            self.skipped_steps += 1
        else:
            self.scaler.update(found_inf=False)
