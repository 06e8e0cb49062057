"""The stepper: the user's optimizer run over this rank's owned pieces, wherever they live.

The user's optimizer is built on the model's own parameters (so its param groups and
hyperparameters are the user's), then each group's parameters are swapped for the fp32
master tensors of this rank's shard of that group. Its `step()` therefore only ever sees
the owned 1/N of every state (ZeRO, arXiv 1910.02054, §5.1). This works for any
optimizer whose update is elementwise, which `check_elementwise` (inner.py) tests at
initialize.

Master weights: with mixed_precision="fp32" on the device the owned chunks of the
parameters are their own master (views, no copy); otherwise each shard has one contiguous
fp32 master where its placement says ([Note: master placement] in master.py), and the
gradient is upcast into its `.grad` for the step only. Either way the optimizer sees one
tensor per owned piece of one parameter, never one shard-sized tensor; a piece without a
gradient ([Note: gradient clearing] in schedule/base.py) is left out.

Everything that reads or writes the masters and states goes through a stepper, so the
delayed update (delayed.py) wraps one and lands its update before any of it.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

import torch

from ..distributed import Comm
from ..distributed.agreement import raise_if_any_failed
from ..memory.ledger import is_elementwise_state, scalar_state
from ..sharding.model_state import LoadedValues
from ..memory.placement import Placement, open_placement
from ..policies import OffloadPolicy
from .master import MasterShard, ShardStorage, runs_of_bytes
from .state_buffers import StateBuffers
from .state_dict import OwnedSlice, owned_slices

__all__ = ["ShardStepper", "build_stepper"]


class ShardStepper:
    """The masters of every owned piece, their optimizer states, and the user's optimizer
    stepping them a bucket at a time."""

    pending = False  # no update in flight (see DelayedStepper)

    def __init__(self, inner: torch.optim.Optimizer, shards: list[list[MasterShard]], placement: Placement,
                 state_buffers: StateBuffers, bucket_bytes: int):
        self.inner, self.shards, self.placement = inner, shards, placement
        self.state_buffers = state_buffers
        self.bucket_bytes = bucket_bytes
        # The inner optimizer's step without torch's hook wrapper: the hooks (global ones
        # included) run once per step in ZeroOptimizer.step, not once per bucket.
        step = type(inner).step
        self._step_fn = step.__wrapped__ if getattr(step, "hooked", False) else step
        self.on_cpu = any(t.device.type == "cpu" for s in self.all_shards() for t in s.master_tensors)
        self.piece_params = [shard.storage.piece_params() for shard in self.all_shards()]

    def all_shards(self) -> list[MasterShard]:
        """Every group's master shards, in order."""
        return [s for group in self.shards for s in group]

    def masters(self) -> list[torch.Tensor]:
        return [m for s in self.all_shards() for m in s.master_tensors]

    def settle(self) -> None:
        """Nothing in flight: see DelayedStepper."""

    def wait(self) -> None:
        """Nothing in flight: see DelayedStepper."""

    # -- one step ------------------------------------------------------------------------
    def attach_grads(self, inv_scale: float, streamed: Callable, has_grad: Callable) -> None:
        """Every master's unscaled fp32 gradient; a piece whose parameter has none is not
        stepped, as torch skips a None gradient. `streamed(shard)`: pieces copied during
        backward ([Note: gradient streaming] in streaming.py)."""
        for shard, owners in zip(self.all_shards(), self.piece_params):
            shard.attach_grads(inv_scale, streamed(shard))
            for m, param in zip(shard.master_tensors, owners):
                m.grad = m.grad if param is None or has_grad(param) else None

    def sync_hyperparameters(self, user_groups: Sequence[dict]) -> None:
        """[Note: two sets of param groups] in optimizer.py"""
        for user, inner in zip(user_groups, self.inner.param_groups):
            for k, v in user.items():
                if k != "params":
                    inner[k] = v

    def update(self, step: int) -> None:
        """Step every owned piece and publish the parameters."""
        self.run_inner()
        self.publish()

    def run_inner(self) -> None:
        """The user's optimizer steps every owned piece once, a bucket's worth at a time.

        A foreach optimizer (torch's default) allocates its temporaries for every tensor
        of a call at once: AdamW over the whole shard holds about two shard-sized fp32
        temporaries (Ψ/N elements each). Stepping `bucket_bytes` of master at a time keeps
        them bucket-sized. Each piece is stepped exactly once per step and the update is
        elementwise, so the result is the same as one call."""
        groups, place, state = self.inner.param_groups, self.placement, self.inner.state
        everything = [g["params"] for g in groups]
        chunks = [(gi, chunk) for gi, params in enumerate(everything)
                  for chunk in runs_of_bytes(params, self.bucket_bytes)]
        try:
            for k, (gi, chunk) in enumerate(chunks):
                if place.streams and k + 1 < len(chunks):  # disk: read the next bucket while this one steps
                    place.prefetch(self.state_buffers.step_tensors(state, chunks[k + 1][1]))
                for gj, g in enumerate(groups):
                    g["params"] = chunk if gj == gi else []
                self._step_fn(self.inner)
                self.state_buffers.move_in(state, chunk, self.on_cpu)
                if place.streams and k > 0:  # disk: write back the bucket before, drop it from memory
                    place.release(self.state_buffers.step_tensors(state, chunks[k - 1][1]))
            if place.streams and chunks:
                place.release(self.state_buffers.step_tensors(state, chunks[-1][1]))
        finally:
            for g, params in zip(groups, everything):
                g["params"] = params

    def publish(self, phase: str = "step") -> None:
        """The masters into the compute parameters, and every rank's updated chunks to every rank."""
        for shard in self.all_shards():
            shard.write_back()
            shard.storage.publish(phase)

    def release_step_grads(self) -> None:
        """The step's fp32 copies of the gradient are freed when it ends: between steps the
        engine holds what DDP holds."""
        for shard in self.all_shards():
            shard.storage.release_step_grads()
            for m in shard.master_tensors:
                m.grad = None

    def zero_grad(self, set_to_none: bool) -> None:
        for shard in self.all_shards():
            shard.storage.zero_grad(set_to_none)
            for m in shard.master_tensors:
                m.grad = None

    # -- states --------------------------------------------------------------------------
    @torch.no_grad()
    def materialize_state(self, user_groups: Sequence[dict]) -> None:
        """Create the optimizer's states (as its first step would) without changing any
        parameter: a step with zero gradients and learning rate 0, as torch DCP does."""
        if all(len(self.inner.state.get(t, {})) for t in self.masters()):
            return
        self.sync_hyperparameters(user_groups)
        saved_lr = [g["lr"] for g in self.inner.param_groups]
        for t in self.masters():
            t.grad = torch.zeros_like(t)
        for g in self.inner.param_groups:
            g["lr"] = 0.0
        try:
            self.run_inner()
        finally:
            for g, lr in zip(self.inner.param_groups, saved_lr):
                g["lr"] = lr
            for t in self.masters():
                t.grad = None

    def clear_state(self) -> None:
        """Drop every optimizer state, as before the first step (the long-lived buffers
        stay, for the states of the next first step)."""
        self.inner.state.clear()
        self.state_buffers.forget()

    def drop_states(self, masters: list) -> None:
        """These master tensors have no states any more (as before their first step)."""
        if not masters:
            return
        if len(masters) == len(self.masters()):
            self.clear_state()
            return
        for t in masters:
            self.inner.state.pop(t, None)
        self.state_buffers.forget()  # the step that creates them again moves them into their buffers again

    def scalar_states(self) -> list[dict]:
        """Per param group, the optimizer's scalar states (e.g. Adam's step), which torch's
        optimizers keep equal across a group's parameters."""
        out = []
        for group in self.shards:
            found = {}
            for shard in group:
                for t in shard.master_tensors:
                    for k, v in self.inner.state.get(t, {}).items():
                        if not is_elementwise_state(v, t):
                            found.setdefault(k, scalar_state(k, v, t))
            out.append(found)
        return out

    @torch.no_grad()
    def load_scalar_states(self, scalars: list[dict]) -> None:
        for group, values in zip(self.shards, scalars):
            for shard in group:
                for t in shard.master_tensors:
                    state = self.inner.state[t]
                    for k, v in values.items():
                        if torch.is_tensor(state.get(k)):
                            state[k].fill_(v)
                        else:
                            state[k] = v

    def owned_slices(self) -> list[OwnedSlice]:
        return owned_slices(self.shards, self.inner.state)

    @torch.no_grad()
    def refresh_from_params(self, loaded: Optional[Mapping[str, LoadedValues]] = None) -> None:
        for shard in self.all_shards():
            shard.refresh_from_params(loaded)


def build_stepper(inner: torch.optim.Optimizer, storages: Sequence[Sequence[ShardStorage]], comm: Comm,
                  offload: OffloadPolicy, compute_dtype: torch.dtype, bucket_bytes: int,
                  files=None) -> ShardStepper:
    """Each group's master shards where `offload.optimizer` puts them, the
    inner optimizer's parameters swapped for them; on disk in `files` when the parameter
    shards opened the directory already. A directory or disk that cannot take the states
    fails on every rank before training starts."""
    what = f"placing the optimizer states (Config.offload_optimizer={offload.optimizer!r})"
    placement = open_placement(offload.optimizer, comm, offload.directory, files=files, what=what)
    full_precision = compute_dtype == torch.float32
    problem, stepper = None, None
    try:
        shards: list[list[MasterShard]] = []
        for group, group_storages in zip(inner.param_groups, storages):
            shards.append([MasterShard(s, full_precision, placement) for s in group_storages])
            group["params"] = [t for s in shards[-1] for t in s.master_tensors]
        state_buffers = StateBuffers([s for group in shards for s in group], placement)
        if placement.streams:  # the states' files now, so that a full disk is found before the first step
            state_buffers.allocate_ahead(inner, shards)
        stepper = ShardStepper(inner, shards, placement, state_buffers, bucket_bytes)
    except Exception as e:  # noqa: BLE001 - raised on this rank by the agreement below
        if not placement.offloaded:
            raise
        problem = e
    if placement.offloaded:
        try:
            raise_if_any_failed(comm, problem, what, "init")
        except Exception:
            placement.close()
            raise
    for group_storages in storages:  # only after every group's master is built: units span groups
        for s in group_storages:
            s.drop_initial_fp32()
    inner.state.clear()
    return stepper
