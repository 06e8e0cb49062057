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
up with k synchronous steps); it is off by default. `DelayedStepper` wraps the stepper:
everything that reads or replaces the masters and states (a checkpoint, a state dict, a
load, the next step) goes through it, and it first waits for the update and publishes it
(`settle`), so a checkpoint holds the updated state and a run resumed from it continues
exactly as the run that saved it.
"""
from __future__ import annotations

import threading
from typing import Callable, Mapping, Optional, Sequence

import torch

from ..distributed import Comm
from ..distributed.agreement import raise_if_any_failed
from .stepper import ShardStepper

__all__ = ["DelayedStepper", "DelayedUpdate"]


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


class DelayedStepper:
    """A `ShardStepper` whose updates from step `after` on run in the background: [Note:
    delayed parameter update]. Every other call lands the update in flight first."""

    def __init__(self, stepper: ShardStepper, after: int, comm: Comm):
        self.stepper, self.comm = stepper, comm
        self.update_in_flight = DelayedUpdate(after)

    @property
    def pending(self) -> bool:
        return self.update_in_flight.pending

    # What the ledger and the state dict code read: the stepper's own, as they are now.
    @property
    def inner(self) -> torch.optim.Optimizer:
        return self.stepper.inner

    @property
    def shards(self) -> list:
        return self.stepper.shards

    @property
    def placement(self):
        return self.stepper.placement

    @property
    def state_buffers(self):
        return self.stepper.state_buffers

    @property
    def on_cpu(self) -> bool:
        return self.stepper.on_cpu

    def all_shards(self) -> list:
        return self.stepper.all_shards()

    def masters(self) -> list[torch.Tensor]:
        return self.stepper.masters()

    def wait(self) -> None:
        """Wait for the update in flight without publishing it (local: no collective)."""
        self.update_in_flight.wait()

    def settle(self) -> None:
        """Wait for the update in flight and publish it; nothing to do without one."""
        if not self.update_in_flight.pending:
            return
        # Every rank joins its own thread, then all agree before publishing (a collective at
        # stages 1-2): an update that raised on one rank raises on every rank.
        raise_if_any_failed(self.comm, self.update_in_flight.wait(), "the delayed optimizer update", "step")
        self.update_in_flight.published()
        self.stepper.publish()
        self.stepper.release_step_grads()

    # -- one step ------------------------------------------------------------------------
    def attach_grads(self, inv_scale: float, streamed: Callable, has_grad: Callable) -> None:
        self.settle()  # the update in flight reaches the parameters before new gradients are read
        self.stepper.attach_grads(inv_scale, streamed, has_grad)

    def sync_hyperparameters(self, user_groups: Sequence[dict]) -> None:
        self.stepper.sync_hyperparameters(user_groups)

    def update(self, step: int) -> None:
        if self.update_in_flight.applies(step):
            self.update_in_flight.launch(self.stepper.run_inner)  # published when the next step begins
        else:
            self.stepper.update(step)

    def publish(self, phase: str = "step") -> None:
        if self.update_in_flight.pending:
            self.settle()  # publishes the update in flight
        else:
            self.stepper.publish(phase)

    def release_step_grads(self) -> None:
        if not self.update_in_flight.pending:  # its update still reads the masters' .grad
            self.stepper.release_step_grads()

    def zero_grad(self, set_to_none: bool) -> None:
        if self.update_in_flight.pending:  # its update reads the masters' .grad
            for shard in self.stepper.all_shards():
                shard.storage.zero_grad(set_to_none)
        else:
            self.stepper.zero_grad(set_to_none)

    # -- states --------------------------------------------------------------------------
    def materialize_state(self, user_groups: Sequence[dict]) -> None:
        self.settle()
        self.stepper.materialize_state(user_groups)

    def clear_state(self) -> None:
        self.settle()
        self.stepper.clear_state()

    def drop_states(self, masters: list) -> None:
        self.settle()
        self.stepper.drop_states(masters)

    def scalar_states(self) -> list[dict]:
        self.settle()
        return self.stepper.scalar_states()

    def load_scalar_states(self, scalars: list[dict]) -> None:
        self.settle()
        self.stepper.load_scalar_states(scalars)

    def owned_slices(self) -> list:
        self.settle()
        return self.stepper.owned_slices()

    def refresh_from_params(self, loaded: Optional[Mapping] = None) -> None:
        self.settle()
        self.stepper.refresh_from_params(loaded)
