"""Loss scaling for fp16 training.

fp16 has 5 exponent bits, so small gradients underflow; the loss is multiplied by a scale
before backward and the gradients divided by it before the step (Micikevicius et al.,
"Mixed Precision Training", arXiv 1710.03740, §3.2). The dynamic scaler halves the scale
and skips the step when any rank sees an inf/nan, and doubles it after
`growth_interval` clean steps.
"""
from __future__ import annotations

from dataclasses import dataclass


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
    def from_config(cls, config) -> "LossScaler":
        if not config.uses_loss_scaling:
            return cls(scale=1.0, dynamic=False)
        if config.loss_scale == "dynamic":
            return cls(scale=float(config.initial_loss_scale), dynamic=True,
                       growth_interval=config.loss_scale_growth_interval)
        return cls(scale=float(config.loss_scale), dynamic=False)

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

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
