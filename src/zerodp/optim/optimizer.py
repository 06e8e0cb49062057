"""The sharded optimizer's face: a torch.optim.Optimizer over the model's parameters whose
work is done by parts with one job each:

- the stepper (stepper.py) runs the user's optimizer over the owned pieces' fp32 masters,
  wherever their placement keeps them; the delayed update (delayed.py) wraps it;
- the step guard (step_guard.py): loss scaling, the non-finite policy, the ranks' agreement;
- the backward schedule (schedule/): when gradients are reduced, which have one;
- the state dict in torch's form (state_dict.py), the memory ledger (report.py).

A step is prepare (gradients into the masters) -> decide (the guard) -> update (the
stepper, which publishes the parameters) -> end (the window starts over), as torch's
ZeroRedundancyOptimizer steps locally, then synchronises the parameters.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import OrderedDict
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ..config import Config
from ..distributed import Comm
from ..distributed.sync_points import OPTIMIZER_LOAD_STATE_DICT, OPTIMIZER_STATE_DICT
from ..memory import hostmem
from ..memory.ledger import MemoryReport
from ..sharding.model_state import LoadedValues
from ..sharding.rows import RowSharding
from .clipping import check_replicated_grads, global_grad_norm, replicated_runs
from .delayed import DelayedStepper
from .inner import needs_whole_params
from .multi import member_of
from .master import ShardStorage
from .report import measure
from .state_dict import OwnedSlice, load_sharded_state_dict, sharded_state_dict
from .step_guard import StepGuard, StepOutcome
from .stepper import build_stepper
from .streaming import GradStreamer
from .torch_grads import ShardGradAccess

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardedModel:
    """What initialize built for the optimizer: the sharded storages and the schedule that
    fills their gradients."""

    storages: Sequence[Sequence[ShardStorage]]  # per param group: its flat group, or its parts of units
    trainable: list  # (name, parameter) of everything sharded, as at initialize
    group_indices: list  # per param group: its parameters' indices in `trainable`
    schedule: object  # the reducer (stages 0-2) or the stage-3 engine: micro_step, grads_ready
    stage3: object = None  # the stage-3 engine, for gathered_parameters and the ledger
    files: object = None  # the offload directory stage 3's shards opened (the optimizer's states join them)
    tensor_parallel: object = None  # zerodp.tensor_parallel.TensorParallelModel: split parameters, Pa's store
    expert_parallel: object = None  # zerodp.expert_parallel.ExpertParallelModel: the banks, their split and comm
    frozen: Callable[[], list] = list  # the frozen parameters' storage now, for the ledger


@dataclasses.dataclass
class _Window:
    """What the loop did since the last step; started over by each step (and zero_grad)."""

    prepared: bool = False  # the masters hold this step's unscaled gradients
    scaled_backwards: int = 0  # backward passes run through optimizer.backward
    norm: Optional[torch.Tensor] = None  # the global norm, when clip_grad_norm_ ran
    zeroed: bool = False  # optimizer.zero_grad ran


def _refuse_split_whole_params(inner: torch.optim.Optimizer, sharded: ShardedModel) -> None:
    """A tensor-parallel rank holds a slice of a split matrix: an optimizer that needs the
    whole matrix (Muon's orthogonalization of a slice is not a slice of the whole one's)
    would step the wrong thing, so it is refused by name ([Note: whole-parameter optimizers]
    in inner.py). Every rank holds the same plan, so every rank raises."""
    split = sharded.tensor_parallel.split_names if sharded.tensor_parallel is not None else frozenset()
    for gi, idx in enumerate(sharded.group_indices):
        member = member_of(inner, gi)[0]
        names = [sharded.trainable[i][0] for i in idx if sharded.trainable[i][0] in split]
        if names and needs_whole_params(member):
            raise ValueError(f"{type(member).__name__} needs whole parameters, but {names[:3]} are split by tensor "
                             f"parallelism (tensor_parallel_size > 1): give those to an elementwise optimizer "
                             f"(e.g. AdamW in an optimizer list), or train with tensor_parallel_size=1")


class ZeroOptimizer(torch.optim.Optimizer):
    """Public surface: backward, step, zero_grad, clip_grad_norm_, state_dict,
    load_state_dict, report, and param_groups over the model's parameters (so LR
    schedulers and torch's checkpointing see an optimizer of the model).

    [Note: two sets of param groups]
    `param_groups` are the user's: the model's trainable parameters and the hyperparameters
    an LR scheduler changes. The inner optimizer's groups hold the master tensors of this
    rank's shard instead; their hyperparameters are copied from the user's before every
    inner step (`ShardStepper.sync_hyperparameters`), so the user's groups are the only ones to edit."""

    def __init__(self, inner: torch.optim.Optimizer, sharded: ShardedModel, comm: Comm, config: Config):
        self.comm, self.config = comm, config
        self.tensor_parallel = sharded.tensor_parallel
        self.trainable = sharded.trainable
        self.param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                              "params": [sharded.trainable[i][1] for i in idx]}
                             for g, idx in zip(inner.param_groups, sharded.group_indices)]
        # How state dicts cut the sharded states into DTensors: [Note: row shards].
        self.rows = RowSharding(comm, sharded=config.stage >= 1,
                                splits=self.tensor_parallel.splits if self.tensor_parallel is not None else None)
        # Expert banks: cut by expert over ``ep``, then into rows over the ranks holding the same experts.
        self.expert_parallel = sharded.expert_parallel
        if self.expert_parallel is not None:
            self.rows.with_banks(RowSharding(comm, sharded=config.stage >= 1, splits=self.expert_parallel.splits,
                                             split_axis="ep", shard_comm=self.expert_parallel.expert_comm))
        self.grad_sync = sharded.schedule
        self.stage3 = sharded.stage3
        self.frozen_tensors = sharded.frozen
        _refuse_split_whole_params(inner, sharded)
        stepper = build_stepper(inner, sharded.storages, comm, config.offload, config.compute_dtype,
                                config.bucket_bytes, sharded.files)
        # [Note: delayed parameter update] in delayed.py (Config.delayed_update_after).
        after = config.delayed_update_after
        self.stepper = DelayedStepper(stepper, after, comm) if after is not None else stepper
        self.guard = StepGuard(comm, config.step_policy)
        # Optimizer's bookkeeping, shared with the inner optimizer rather than copied.
        self.defaults, self.state = inner.defaults, inner.state
        for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, attr, OrderedDict())
        self._window = _Window()
        self.step_count = 0
        self.last_grad_norm = None
        self._replicated = (replicated_runs(stepper.all_shards(), self.tensor_parallel.split_names)
                            if self.tensor_parallel is not None else None)
        self.streamer = GradStreamer(stepper.all_shards() if after is None else [])
        self.grad_sync.on_final_grads = self.streamer.on_final_grads  # [Note: gradient streaming]
        # [Note: torch's utilities on sharded gradients] in schedule/grad_handle.py
        self.grad_access = ShardGradAccess(self)
        if self.grad_sync.presence is not None:
            self.grad_sync.presence.access = self.grad_access
            # Where a rank's view of the flat gradient is not DDP's p.grad either: scaled by the
            # fp16 loss scale. (Under tensor parallelism at stage 0 the view is this rank's slice
            # of the reduced gradient, which loops read as such: it stays a view.)
            if config.uses_loss_scaling:
                self.grad_sync.presence.handles_when_final = True

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The user's optimizer, over this rank's master pieces."""
        return self.stepper.inner

    @property
    def scaler(self):
        return self.guard.scaler

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a nan/inf gradient (nonfinite_grads="skip")."""
        return self.guard.skipped_steps

    # -- training loop ------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *, scale_wrt_accumulation: bool = True, **kwargs) -> None:
        """loss.backward(), scaled by the fp16 loss scale and divided by the accumulation
        steps (not with scale_wrt_accumulation=False: a loss the caller already divided, as
        Hugging Face's Trainer does)."""
        scale = self.guard.scaler.scale / (self.accumulation_steps if scale_wrt_accumulation else 1)
        self._window.scaled_backwards += 1
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
        return self.guard.last_skipped

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

    def prepare_grads(self) -> None:
        """Give every master tensor its unscaled fp32 gradient, once per step (what the step
        and the clip read; torch's utilities on `p.grad` read it too)."""
        self._prepare_grads()

    def _prepare_grads(self) -> None:
        """Give every master tensor its unscaled fp32 gradient, once per step."""
        self.stepper.settle()  # the update in flight reaches the parameters before new gradients are read
        if self._window.prepared:
            return
        self._check_trainable_unchanged()
        self.guard.check_scaled(self.grad_sync.micro_step, self._window.scaled_backwards)
        self.grad_sync.observe_clearing()  # the loop may have cleared gradients since the backward
        if not self.grad_sync.grads_ready and not (self._window.zeroed and self.grad_sync.micro_step == 0):
            raise RuntimeError(
                "step() or clip_grad_norm_() was called before a backward at the accumulation boundary: "
                f"run optimizer.backward(loss) (accumulation_steps={self.accumulation_steps} "
                f"backward calls per step, {self.grad_sync.micro_step} so far) first")
        self.stepper.attach_grads(1.0 / self.guard.scaler.scale, self.streamer.take,
                                  self.grad_sync.presence.has_grad)
        if self.config.debug and self.tensor_parallel is not None:
            check_replicated_grads(self.stepper.all_shards(), self.tensor_parallel.split_names, self.comm)
        self._window.prepared = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm, as torch.nn.utils.clip_grad_norm_ on DDP would;
        each rank reduces the norm of its shard, so no gradient is gathered."""
        self._prepare_grads()
        masters = self.stepper.masters()
        grads = [m.grad if m.grad is not None else m.new_zeros(0) for m in masters]
        norm_type = float(norm_type)
        owns_all = self.config.stage == 0 or self.comm.shard_size == 1
        total = global_grad_norm(grads, norm_type, self.comm, owns_all, self._replicated)
        self.grad_access.invalidate()
        coef = float(max_norm) / (float(total) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        self.last_grad_norm = total
        # A p-norm carries a nan/inf through its sums; a max over pieces and ranks can drop a
        # nan, so the inf-norm is not reused for the non-finite check.
        self._window.norm = None if math.isinf(norm_type) else total
        return total

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure: run forward/backward before step()")
        self._run_step_hooks(post=False)
        self.guard.last_skipped = False
        if self._is_state_probe():
            self.materialize_state()
            for g in self.param_groups:
                for p in g["params"]:
                    p.grad = None
        elif not self._nothing_to_step():
            self._prepare_grads()
            grads = [m.grad for m in self.stepper.masters() if m.grad is not None]
            try:
                outcome = self.guard.decide(grads, self._window.norm, self.step_count)
            except FloatingPointError:
                self._window.prepared = False  # the loop may zero_grad and go on
                raise
            if outcome is StepOutcome.APPLY:
                self.stepper.sync_hyperparameters(self.param_groups)
                self.stepper.update(self.step_count)
            self.guard.record(outcome, self.step_count)
            self._end_step()
        self._run_step_hooks(post=True)
        return None

    def _end_step(self) -> None:
        self.step_count += 1
        self.grad_access.invalidate()
        self.stepper.release_step_grads()
        self._window = _Window()
        self.grad_sync.after_step()
        self.comm.ledger.end_step()
        # [Note: long-lived host buffers]. Stage 3 only: at stages 0-2 the next step allocates
        # the same activations into the same free pages; releasing them bought 2% of the peak
        # for 10% of the step (124M GPT-2, N=2, stage 2: benchmarks/bench_heap_release.py).
        if self.stepper.on_cpu and self.config.stage == 3:
            hostmem.release_free_heap(min_free=hostmem.STEP_RELEASE_MIN_FREE)

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

    def _nothing_to_step(self) -> bool:
        """A clearing then `step()` with no backward: torch's optimizers find every gradient
        None and change nothing; so does this one (no step is counted)."""
        if self.grad_sync.grads_ready or self.grad_sync.micro_step:
            return False
        self.grad_sync.observe_clearing()
        return not self.grad_sync.presence.any_grad()  # zero_grad(set_to_none=False): steps zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient and start the backward schedule over: after a backward that
        raised too ([Note: failed backward] in schedule/base.py)."""
        self.grad_sync.reset()
        self.grad_access.invalidate()
        self.streamer.clear()
        self._window = _Window(zeroed=True)
        self.stepper.zero_grad(set_to_none)
        self.grad_sync.clear_gradients(set_to_none)

    def state_dict(self) -> dict:
        """torch's optimizer state dict with every per-element state a DTensor of its
        parameter's shape (this rank's rows), which torch.distributed.checkpoint saves and
        reshards: optim/state_dict.py. Collective at stages 1-3 (every rank calls it; one
        that does not is named on every rank: [Note: sync points]); local at stage 0, as DDP's."""
        if self.rows.sharded or any(s.parts > 1 for s in self.rows.splits.values()):
            self.comm.sync_points.call(OPTIMIZER_STATE_DICT, f"at stage {self.config.stage} (it gathers each "
                                                             f"state's rows from the rank that owns them)")
        self.stepper.settle()
        return sharded_state_dict(self, self.rows)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a `state_dict()` (from any world size and stage) or its full form.
        Collective: every rank calls it ([Note: sync points])."""
        self.comm.sync_points.call(OPTIMIZER_LOAD_STATE_DICT, f"at stage {self.config.stage} (the ranks check the "
                                                              f"state dict together, and each keeps its rows)")
        self.stepper.settle()
        load_sharded_state_dict(self, state_dict, self.rows)

    # -- state by parameter name (checkpoints) ---------------------------------------------
    def owned_slices(self) -> list[OwnedSlice]:
        """Every run of parameter elements this rank owns, by parameter name; independent of
        the world size and stage, so a checkpoint written from it can be read by any other."""
        return self.stepper.owned_slices()

    def scalar_states(self) -> list[dict]:
        """Per param group, the optimizer's scalar states (e.g. Adam's step)."""
        return self.stepper.scalar_states()

    def materialize_state(self) -> None:
        """Create the optimizer's states (as its first step would) without changing any
        parameter: a step with zero gradients and learning rate 0, as torch DCP does."""
        self.stepper.materialize_state(self.param_groups)

    def clear_state(self) -> None:
        """Drop every optimizer state, as before the first step."""
        self.stepper.clear_state()

    def load_scalar_states(self, scalars: list[dict]) -> None:
        self.stepper.load_scalar_states(scalars)

    @torch.no_grad()
    def sync_params_from_master(self, phase: str = "step") -> None:
        """After the step or a load: write the masters to the compute parameters and publish."""
        self.stepper.publish(phase)

    @torch.no_grad()
    def refresh_master_from_params(self, loaded: Optional[Mapping[str, LoadedValues]] = None) -> None:
        """After the compute parameters were changed by hand (e.g. in gathered_parameters
        with modify=True) or by a load, start the fp32 master from them again; `loaded`:
        what a load gave each parameter ([Note: weight loading] in sharding/model_state.py)."""
        self.stepper.refresh_from_params(loaded)

    def settle(self) -> None:
        """A delayed update in flight reaches the parameters ([Note: delayed parameter
        update] in delayed.py); nothing to do without one."""
        self.stepper.settle()

    # -- reports ------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds, counted from its storages: [Note: measured ledger]. Local:
        a delayed update in flight is waited for (its states may be being created), not
        published."""
        self.stepper.wait()
        return measure(self)

    def report(self) -> dict:
        """This rank's memory ledger and the last step's communication, as plain data."""
        return {"memory": self.memory_report().as_dict(), "comm": self.comm.ledger.summary(),
                "loss_scale": self.guard.scaler.scale, "step": self.step_count}
