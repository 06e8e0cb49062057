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

__all__ = ["DelayedUpdate"]


class DelayedUpdate:
    """The one update in flight, on a thread of its own."""

    def __init__(self, after: int):
        self.after = after
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def applies(self, step: int) -> bool:
        return step >= self.after

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def launch(self, update: Callable[[], None]) -> None:
        if self._thread is not None:
            raise RuntimeError("a delayed update was launched while another is in flight")

        def run():
            try:
                update()
            except BaseException as e:  # noqa: BLE001 - re-raised by wait(), on the training thread
                self._error = e
        self._thread = threading.Thread(target=run, name="zerodp-delayed-update")
        self._thread.start()

    def wait(self) -> bool:
        """Wait for the update in flight; whether there was one. Its error, if it raised."""
        if self._thread is None:
            return False
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the delayed optimizer update failed: {error}") from error
        return True
