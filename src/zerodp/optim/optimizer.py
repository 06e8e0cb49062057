"""The sharded optimizer for every stage: master shard, the user's optimizer over it,
loss scaling, clipping, accumulation, and publishing the updated parameters.

The user's optimizer is built on the model's own parameters (so its param groups and
hyperparameters are the user's), then each group's parameters are swapped for the fp32
master tensors of this rank's shard of that group. Its `step()` therefore only ever sees
the owned 1/N of every state (ZeRO, arXiv 1910.02054, §5.1). This works for any
optimizer whose update is elementwise, which `check_elementwise` (inner.py) tests at
initialize (LBFGS, Adafactor and Muon are refused).

Master weights: with mixed_precision="fp32" the owned chunks of the parameters are their
own master (views, no copy); with bf16/fp16 each shard has one contiguous fp32 master,
and the gradient is upcast into its `.grad` for the step only. Either way the optimizer
sees one tensor per owned piece of one parameter, never one shard-sized tensor; one
without a gradient ([Note: gradient clearing] in schedule/base.py) is left out.
"""
from __future__ import annotations

import logging
import math
from collections import OrderedDict
from typing import Mapping, Optional, Sequence

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ..config import Config
from ..distributed import Comm
from ..memory import hostmem
from ..memory.ledger import MemoryReport, is_elementwise_state
from .clipping import check_replicated_grads, global_grad_norm, replicated_runs
from .master import MasterShard, ShardStorage, runs_of_bytes
from .delayed import DelayedUpdate
from .homes import StateHomes
from .report import measure
from .streaming import GradStreamer
from .offload import placement_for, raise_offload_failures
from ..distributed.agreement import raise_if_any_failed
from ..sharding.model_state import LoadedValues
from ..sharding.rows import RowSharding
from .precision import LossScaler, nonfinite_error, nonfinite_flag
from .state_dict import OwnedSlice, load_sharded_state_dict, owned_slices, sharded_state_dict

log = logging.getLogger(__name__)


class ZeroOptimizer(torch.optim.Optimizer):
    """Public surface: backward, step, zero_grad, clip_grad_norm_, state_dict,
    load_state_dict, report, and param_groups over the model's parameters (so LR
    schedulers and torch's checkpointing see an optimizer of the model).

    [Note: two sets of param groups]
    `param_groups` are the user's: the model's trainable parameters and the hyperparameters
    an LR scheduler changes. The inner optimizer's groups hold the master tensors of this
    rank's shard instead; their hyperparameters are copied from the user's before every
    inner step (`_sync_hyperparameters`), so the user's groups are the only ones to edit."""

    def __init__(self, inner: torch.optim.Optimizer, storages: Sequence[Sequence[ShardStorage]],
                 comm: Comm, config: Config, grad_sync, trainable: list, group_indices: list, stage3=None,
                 files=None, tensor_parallel=None):
        self.inner, self.comm, self.config = inner, comm, config
        # zerodp.tensor_parallel.TensorParallelModel: the split parameters, Pa's checkpoint store.
        self.tensor_parallel = tensor_parallel
        self.trainable = trainable  # (name, parameter) of everything sharded, as at initialize
        self.param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [trainable[i][1] for i in idx]}
                             for g, idx in zip(inner.param_groups, group_indices)]
        # How state dicts cut the sharded states into DTensors: [Note: row shards].
        self.rows = RowSharding(comm, sharded=config.stage >= 1)
        self.grad_sync = grad_sync  # reducer (stages 0-2) or stage-3 engine: micro_step, grads_ready
        self.stage3 = stage3
        self.scaler = LossScaler.from_config(config)
        full_precision = config.compute_dtype == torch.float32
        # [Note: master placement] in master.py; offloaded: [Note: host placement] and
        # [Note: disk placement] in offload.py. A directory or disk that cannot take the
        # states fails on every rank before training starts.
        disk, offloaded = config.offload_optimizer == "disk", config.offload_optimizer != "none"
        problem = None
        try:
            self.placement = placement_for(config.offload_optimizer, comm.device, config.offload_dir, comm.rank,
                                           files)
            self.shards: list[list[MasterShard]] = []
            for group, group_storages in zip(inner.param_groups, storages):
                shards = [MasterShard(s, full_precision, self.placement) for s in group_storages]
                self.shards.append(shards)
                group["params"] = [t for s in shards for t in s.master_tensors]
            self.homes = StateHomes(self.all_shards(), self.placement)  # the states' long-lived buffers
            if disk:  # the states' files now, so that a full disk is found before the first step
                self.homes.allocate_ahead(inner, self.shards)
        except Exception as e:  # noqa: BLE001 - raised on this rank by the agreement below
            if not offloaded:
                raise
            problem = e
        if offloaded:
            raise_offload_failures(self.comm, problem, f"placing the optimizer states ({config.offload_optimizer})",
                                   getattr(self, "placement", None))
        for group_storages in storages:  # only after every group's master is built: units span groups
            for s in group_storages:
                s.drop_initial_fp32()
        inner.state.clear()
        # Optimizer's bookkeeping, shared with the inner optimizer rather than copied.
        self.defaults, self.state = inner.defaults, inner.state
        for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, attr, OrderedDict())
        self._grads_prepared = False
        self._found_inf = False
        self._last_skipped = False
        self._on_cpu = any(t.device.type == "cpu" for s in self.all_shards() for t in s.master_tensors)
        self._scaled_backwards = 0  # backward passes run through self.backward since the last step
        self._norm_this_step = None  # the global norm, when clip_grad_norm_ ran in this step
        self._zeroed = False  # zero_grad since the last step
        self.skipped_steps = 0  # steps skipped for a nan/inf gradient (nonfinite_grads="skip")
        self.step_count = 0
        self.last_grad_norm = None
        # [Note: delayed parameter update] in delayed.py (Config.delayed_update_after).
        after = config.delayed_update_after
        self.delayed = DelayedUpdate(after) if after is not None else None
        # The inner optimizer's step without torch's hook wrapper: the hooks (global ones
        # included) run once per step in `step`, not once per bucket.
        step = type(inner).step
        self._inner_step_fn = step.__wrapped__ if getattr(step, "hooked", False) else step
        self._replicated = (replicated_runs(self.all_shards(), tensor_parallel.split_names)
                            if tensor_parallel is not None else None)
        self.streamer = GradStreamer(self.all_shards() if self.delayed is None else [], self.placement)
        grad_sync.on_final_grads = self.streamer.on_final_grads  # [Note: gradient streaming]
        self._piece_params = [shard.storage.piece_params() for shard in self.all_shards()]

    def all_shards(self) -> list[MasterShard]:
        """Every group's master shards, in order."""
        return [s for group in self.shards for s in group]

    # -- training loop ------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, scale_wrt_accumulation: bool = True, **kwargs) -> None:
        """loss.backward(), scaled by the fp16 loss scale and divided by the accumulation
        steps (not with scale_wrt_accumulation=False: a loss the caller already divided, as
        Hugging Face's Trainer does)."""
        scale = self.scaler.scale / (self.accumulation_steps if scale_wrt_accumulation else 1)
        self._scaled_backwards += 1
        (loss * scale if scale != 1.0 else loss).backward(**kwargs)

    @property
    def accumulation_steps(self) -> int:
        """Backward passes from one step to the next (Config.grad_accumulation_steps, unless set)."""
        return self.grad_sync.accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, steps: int) -> None:
        """For a window of another length, e.g. the shorter last one of an epoch; only
        between steps, since the boundary backward reduces differently."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"accumulation_steps={steps!r}: use a whole number of backward passes >= 1")
        if self.grad_sync.micro_step:
            raise RuntimeError(f"accumulation_steps set after {self.grad_sync.micro_step} backward passes of the "
                               f"window: set it before its first backward (right after step or zero_grad)")
        self.grad_sync.accumulation_steps = steps

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step() left the weights unchanged (an fp16 overflow, or a nan/inf
        gradient under Config.nonfinite_grads='skip'): an LR scheduler should not advance."""
        return self._last_skipped

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("add_param_group after zerodp.initialize is not supported: the new parameters would "
                           "not be in any shard. Give every param group to the optimizer before initialize "
                           "(zerodp.initialize(model, Opt, cfg, params=[{...}, {...}]))")

    def _check_trainable_unchanged(self) -> None:
        frozen = [n for n, p in self.trainable if not p.requires_grad]
        if frozen:
            raise RuntimeError(
                f"rank {self.comm.rank}: parameters {frozen[:3]}{' ...' if len(frozen) > 3 else ''} were frozen "
                f"(requires_grad=False) after zerodp.initialize; their shards would still be updated (weight "
                f"decay, momentum). Freeze parameters before zerodp.initialize, which leaves them out of the "
                f"shards, or re-run initialize after freezing")

    def _prepare_grads(self) -> None:
        """Give every master tensor its unscaled fp32 gradient, once per step, and agree
        across ranks whether any gradient is inf/nan."""
        self.settle()  # the update in flight reaches the parameters before new gradients are read
        if self._grads_prepared:
            return
        self._check_trainable_unchanged()
        self.scaler.check_scaled(self.comm.rank, self.grad_sync.micro_step, self._scaled_backwards)
        self.grad_sync.observe_clearing()  # the loop may have cleared gradients since the backward
        if not self.grad_sync.grads_ready and not (self._zeroed and self.grad_sync.micro_step == 0):
            raise RuntimeError(
                "step() or clip_grad_norm_() was called before a backward at the accumulation boundary: "
                f"run optimizer.backward(loss) (accumulation_steps={self.accumulation_steps} "
                f"backward calls per step, {self.grad_sync.micro_step} so far) first")
        inv_scale = 1.0 / self.scaler.scale
        for shard, owners in zip(self.all_shards(), self._piece_params):
            shard.attach_grads(inv_scale, self.streamer.take(shard))
            for m, param in zip(shard.master_tensors, owners):  # no gradient: not stepped, as in torch
                m.grad = m.grad if param is None or self.grad_sync.presence.has_grad(param) else None
        if self.config.debug and self.tensor_parallel is not None:
            check_replicated_grads(self.all_shards(), self.tensor_parallel.split_names, self.comm)
        self._grads_prepared = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm, as torch.nn.utils.clip_grad_norm_ on DDP would;
        each rank reduces the norm of its shard, so no gradient is gathered."""
        self._prepare_grads()
        masters = [m for s in self.all_shards() for m in s.master_tensors]
        grads = [m.grad if m.grad is not None else m.new_zeros(0) for m in masters]
        norm_type = float(norm_type)
        total = global_grad_norm(grads, norm_type, self.comm, self._owns_all(), self._replicated)
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        self.last_grad_norm = total
        # A p-norm carries a nan/inf through its sums; a max over pieces and ranks can drop a
        # nan, so the inf-norm is not reused for the non-finite check.
        self._norm_this_step = None if math.isinf(norm_type) else total
        return total

    def _owns_all(self) -> bool:
        return self.config.stage == 0 or self.comm.shard_size == 1

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure: run forward/backward before step()")
        self._run_step_hooks(post=False)
        self._last_skipped = False
        if self._is_state_probe():
            self.materialize_state()
            for g in self.param_groups:
                for p in g["params"]:
                    p.grad = None
            self._run_step_hooks(post=True)
            return None
        if self._nothing_to_step():
            self._run_step_hooks(post=True)
            return None
        self._prepare_grads()
        nonfinite = self._agree_on_step()
        self._last_skipped = self._found_inf or nonfinite
        if self._found_inf:
            log.warning("rank %d: inf/nan gradient, skipping step %d (loss scale %g -> %g)", self.comm.rank,
                        self.step_count, self.scaler.scale, self.scaler.scale * self.scaler.backoff_factor)
            self.scaler.update(found_inf=True)
        elif nonfinite:
            log.warning("rank %d: inf/nan gradient, skipping step %d (Config.nonfinite_grads='skip')",
                        self.comm.rank, self.step_count)
            self.skipped_steps += 1
        else:
            self._sync_hyperparameters()
            if self.delayed is not None and self.delayed.applies(self.step_count):
                self.delayed.launch(self._inner_step)  # published when the next step begins
            else:
                self._inner_step()
                self.sync_params_from_master()
            self.scaler.update(found_inf=False)
        self.step_count += 1
        self._release_step_grads()
        self._grads_prepared = False
        self._found_inf = False
        self._norm_this_step = None
        self._zeroed = False
        self._scaled_backwards = 0
        self.grad_sync.after_step()
        self.comm.ledger.end_step()
        if self._on_cpu:  # see [Note: long-lived host buffers]
            hostmem.release_free_heap()
        self._run_step_hooks(post=True)
        return None

    def _run_step_hooks(self, post: bool) -> None:
        """torch.optim's step hooks (global ones and this optimizer's), in torch's order,
        once per step as on any torch optimizer."""
        hooks = ([*self._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()] if post
                 else [*_global_optimizer_pre_hooks.values(), *self._optimizer_step_pre_hooks.values()])
        for hook in hooks:
            hook(self, (), {})

    def _is_state_probe(self) -> bool:
        """torch.distributed.checkpoint.state_dict creates a fresh optimizer's states by
        setting every parameter's .grad to zeros and stepping at learning rate 0. With no
        backward run that step has no reduced gradient to use; it creates the states instead
        (`materialize_state`), which is what that step does on any torch optimizer."""
        if self.grad_sync.grads_ready or self.grad_sync.micro_step:
            return False
        params = [p for g in self.param_groups for p in g["params"]]
        return (all(float(g["lr"]) == 0.0 for g in self.param_groups)
                and all(p.grad is not None and p.grad.shape == p.shape and not p.grad.any() for p in params))

    def _sync_hyperparameters(self) -> None:
        """[Note: two sets of param groups]"""
        for user, inner in zip(self.param_groups, self.inner.param_groups):
            for k, v in user.items():
                if k != "params":
                    inner[k] = v

    def _nothing_to_step(self) -> bool:
        """A clearing then `step()` with no backward: torch's optimizers find every gradient
        None and change nothing; so does this one (no step is counted)."""
        if self.grad_sync.grads_ready or self.grad_sync.micro_step:
            return False
        self.grad_sync.observe_clearing()
        return not self.grad_sync.presence.any_grad()  # zero_grad(set_to_none=False): steps zeros

    def _release_step_grads(self) -> None:
        """The step's fp32 copies of the gradient are freed when it ends (a delayed update's
        when it is published): between steps the engine holds what DDP holds."""
        if self.delayed is not None and self.delayed.pending:
            return
        for shard in self.all_shards():
            shard.storage.release_step_grads()
            for m in shard.master_tensors:
                m.grad = None

    def _agree_on_step(self) -> bool:
        """One tiny collective before the master weights change: the ranks agree that they ran
        the same collectives ([Note: step fingerprint] in distributed/comm.py) and whether any
        gradient holds a nan/inf: fp16's `_found_inf`, or Config.nonfinite_grads (whether to skip)."""
        grads = [m.grad for s in self.all_shards() for m in s.master_tensors if m.grad is not None]
        nonfinite = self.comm.agree_on_step(nonfinite_flag(self.config, self._norm_this_step, grads, self.comm.device))
        if self.config.uses_loss_scaling:
            self._found_inf = nonfinite
            return False
        if nonfinite and self.config.nonfinite_grads == "raise":
            self._grads_prepared = False
            raise nonfinite_error(self.comm.rank, self.step_count)
        return nonfinite

    def _inner_step(self) -> None:
        """The user's optimizer steps every owned piece once, a bucket's worth at a time.

        A foreach optimizer (torch's default) allocates its temporaries for every tensor
        of a call at once: AdamW over the whole shard holds about two shard-sized fp32
        temporaries (Ψ/N elements each). Stepping `bucket_bytes` of master at a time keeps
        them bucket-sized. Each piece is stepped exactly once per step and the update is
        elementwise, so the result is the same as one call."""
        groups, place, state = self.inner.param_groups, self.placement, self.inner.state
        everything = [g["params"] for g in groups]
        chunks = [(gi, chunk) for gi, params in enumerate(everything)
                  for chunk in runs_of_bytes(params, self.config.bucket_bytes)]
        try:
            for k, (gi, chunk) in enumerate(chunks):
                if place.streams and k + 1 < len(chunks):  # disk: read the next bucket while this one steps
                    place.prefetch(self.homes.step_tensors(state, chunks[k + 1][1]))
                for gj, g in enumerate(groups):
                    g["params"] = chunk if gj == gi else []
                self._inner_step_fn(self.inner)
                self.homes.move_in(state, chunk, self._on_cpu)
                if place.streams and k > 0:  # disk: write back the bucket before, drop it from memory
                    place.release(self.homes.step_tensors(state, chunks[k - 1][1]))
            if place.streams and chunks:
                place.release(self.homes.step_tensors(state, chunks[-1][1]))
        finally:
            for g, params in zip(groups, everything):
                g["params"] = params

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient and start the backward schedule over: after a backward that
        raised too ([Note: failed backward] in schedule/base.py)."""
        self.grad_sync.reset()
        self.streamer.clear()
        self._grads_prepared = False
        self._norm_this_step = None
        self._zeroed = True
        self._scaled_backwards = 0
        in_flight = self.delayed is not None and self.delayed.pending  # its update reads the masters' .grad
        for shard in self.all_shards():
            shard.storage.zero_grad(set_to_none)
            for m in shard.master_tensors:
                if not in_flight:
                    m.grad = None
        self.grad_sync.clear_gradients(set_to_none)

    def state_dict(self) -> dict:
        """torch's optimizer state dict with every per-element state a DTensor of its
        parameter's shape (this rank's rows), which torch.distributed.checkpoint saves and
        reshards: optim/state_dict.py. Collective: every rank calls it."""
        self.settle()
        return sharded_state_dict(self, self.rows)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a `state_dict()` (from any world size and stage) or its full form."""
        self.settle()
        load_sharded_state_dict(self, state_dict, self.rows)

    # -- state by parameter name (checkpoints) ---------------------------------------------
    def owned_slices(self) -> list[OwnedSlice]:
        """Every run of parameter elements this rank owns, by parameter name; independent of
        the world size and stage, so a checkpoint written from it can be read by any other."""
        self.settle()
        return owned_slices(self)

    def scalar_states(self) -> list[dict]:
        """Per param group, the optimizer's scalar states (e.g. Adam's step), which torch's
        optimizers keep equal across a group's parameters."""
        self.settle()
        out = []
        for gi, group in enumerate(self.shards):
            found = {}
            for shard in group:
                for t in shard.master_tensors:
                    for k, v in self.inner.state.get(t, {}).items():
                        if not is_elementwise_state(v, t):
                            found.setdefault(k, float(v) if torch.is_tensor(v) else v)
            out.append(found)
        return out

    @torch.no_grad()
    def materialize_state(self) -> None:
        """Create the optimizer's states (as its first step would) without changing any
        parameter: a step with zero gradients and learning rate 0, as torch DCP does."""
        self.settle()
        if all(len(self.inner.state.get(t, {})) for s in self.all_shards() for t in s.master_tensors):
            return
        self._sync_hyperparameters()
        saved_lr = [g["lr"] for g in self.inner.param_groups]
        for s in self.all_shards():
            for t in s.master_tensors:
                t.grad = torch.zeros_like(t)
        for g in self.inner.param_groups:
            g["lr"] = 0.0
        try:
            self._inner_step()
        finally:
            for g, lr in zip(self.inner.param_groups, saved_lr):
                g["lr"] = lr
            for s in self.all_shards():
                for t in s.master_tensors:
                    t.grad = None

    def clear_state(self) -> None:
        """Drop every optimizer state, as before the first step (the long-lived buffers
        stay, for the states of the next first step)."""
        self.settle()
        self.inner.state.clear()
        self.homes.forget()

    @torch.no_grad()
    def load_scalar_states(self, scalars: list[dict]) -> None:
        self.settle()
        for group, values in zip(self.shards, scalars):
            for shard in group:
                for t in shard.master_tensors:
                    state = self.inner.state[t]
                    for k, v in values.items():
                        if torch.is_tensor(state.get(k)):
                            state[k].fill_(v)
                        else:
                            state[k] = v

    @torch.no_grad()
    def sync_params_from_master(self, phase: str = "step") -> None:
        """After the step or a load: write the masters to the compute parameters and publish."""
        if self.delayed is not None and self.delayed.pending:
            self.settle()  # publishes the update in flight
        else:
            self._publish(phase)

    def _publish(self, phase: str = "step") -> None:
        for shard in self.all_shards():
            shard.write_back()
            shard.storage.publish(phase)

    @torch.no_grad()
    def refresh_master_from_params(self, loaded: Optional[Mapping[str, LoadedValues]] = None) -> None:
        """After the compute parameters were changed by hand (e.g. in gathered_parameters
        with modify=True) or by a load, start the fp32 master from them again; `loaded`:
        what a load gave each parameter ([Note: weight loading] in sharding/model_state.py)."""
        self.settle()
        for shard in self.all_shards():
            shard.refresh_from_params(loaded)

    def settle(self) -> None:
        """Wait for a delayed update in flight and publish it ([Note: delayed parameter
        update] in delayed.py); nothing to do without one."""
        if self.delayed is None or not self.delayed.pending:
            return
        # Every rank joins its own thread, then all agree before publishing (a collective at
        # stages 1-2): an update that raised on one rank raises on every rank.
        raise_if_any_failed(self.comm, self.delayed.wait(), "the delayed optimizer update", "step")
        self.delayed.published()
        self._publish()
        self._release_step_grads()

    # -- reports ------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, counted from its storages: [Note: measured ledger]. Local:
        a delayed update in flight is waited for (its states may be being created), not
        published."""
        if self.delayed is not None:
            self.delayed.wait()
        return measure(self)

    def report(self) -> dict:
        """This rank's memory ledger and the last step's communication, as plain data."""
        return {"memory": self.memory_report().as_dict(), "comm": self.comm.ledger.summary(),
                "loss_scale": self.scaler.scale, "step": self.step_count}
