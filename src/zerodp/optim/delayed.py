"""ZeRO-Offload's delayed parameter update (DPU; Ren et al., arXiv 2101.06840, §4.2).

[Note: delayed parameter update]
With `Config.delayed_update_after = k`, every step from step k on runs the host
optimizer's update in a background thread and returns at once; the updated masters are
written to the parameters (and, at stages 1-2, all-gathered) at the start of the next
step, before its gradients are read. So the forward and backward of step t+1 overlap the
update of step t, and run on the parameters from before it: with m_t the master after t
updates and p_t the parameters step t computes with,

    p_t = m_t (t <= k),  p_t = m_(t-1) (t > k),  m_(t+1) = U(m_t, grad L_t(p_t)).

This changes the maths (each gradient is one update stale, which is why the paper warms
up with k synchronous steps); it is off by default. Anything that reads or replaces the
masters (a checkpoint, a state dict, the memory ledger, a load) first waits for the update
and publishes it (`ZeroOptimizer.settle`), so a checkpoint holds the updated state and a
run resumed from it continues exactly as the run that saved it.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

__all__ = ["DelayedUpdate"]


class DelayedUpdate:
    """The one update in flight, on a thread of its own; `pending` until it is published."""

    def __init__(self, after: int):
        self.after = after
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.pending = False  # launched, not yet published to the parameters

    def applies(self, step: int) -> bool:
        return step >= self.after

    def launch(self, update: Callable[[], None]) -> None:
        if self.pending:
            raise RuntimeError("a delayed update was launched while another is in flight")

        def run():
            try:
                with torch.no_grad():  # grad mode is per thread
                    update()
            except BaseException as e:  # noqa: BLE001 - returned by wait(), on the training thread
                self._error = e
        thread = threading.Thread(target=run, name="zerodp-delayed-update")
        thread.start()
        self._thread, self.pending = thread, True

    def wait(self) -> Optional[BaseException]:
        """Wait for the update in flight (no collective); the error it raised, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._error

    def published(self) -> None:
        self.pending, self._error = False, None
