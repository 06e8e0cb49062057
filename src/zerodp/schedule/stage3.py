"""Stage 3 (Pos+g+p, ZeRO arXiv 1910.02054 §5.3): parameters gathered per unit on demand.

Hooks call methods of a unit (sharding/flat_unit.py); the unit calls its collective
strategy (distributed/collectives.py).

Forward: a unit's pre-hook gathers its parameters (and prefetches the next
`prefetch_units` units of the order recorded on the first step); its post-hook frees
them (`reshard_after_forward`) and registers a hook on its outputs' gradients.
Backward: that gradient hook fires before any of the unit's backward ops run, and
gathers the unit again (prefetching the next units of the recorded backward order).
When the unit's backward is over ([Note: unit done]), the gradients move into a flat
buffer, the parameters are freed, and the buffer is reduce-scattered into the unit's
gradient shard (every micro-batch, or only at the accumulation boundary with
reduce_each_micro_batch=False).
A unit's place in the step is its `TrainingState` (IDLE, FORWARD, PRE_BACKWARD,
POST_BACKWARD), moved by these hooks. Reduce-scatters go through the schedule's
`ReduceQueue` (schedule/base.py), launched strictly in one order so that every rank issues
the same collectives even when autograd finishes units in another order: on the first
backward the reverse of the first forward's order, then the order units were done in it
(rank 0's). Units that were not used (or only partly) are flushed by the end-of-backward
callback ([Note: end of backward] in schedule/base.py), with zero gradients for what was not
used. A unit's reduction overwrites its gradient shard only when that holds nothing to keep
(`FlatUnit.grad_fresh`): otherwise it adds, within a window and across steps whose
gradients the loop did not clear ([Note: gradient clearing] in schedule/base.py).

[Note: unit done]
Every rank must issue the same collectives in the same order whatever parameters its data
reached (DDP's find_unused_parameters rule: a parameter no op of this rank's backward
reached contributes zero here). So a unit's backward is over at an event every rank sees
at the same place of its backward, not when each of its parameters got a gradient: a
branch taken on one rank only (an expert no token reached) would leave the unit waiting
there for a gradient that never comes, while the other ranks reduce it and go on. The
event is the gradient of the unit's inputs: every input of a call passes through
`_BackwardDone`, whose backward runs once every op of the call that reads them has run its
own. autograd runs the ready node created last first (a node's sequence number), and every
node of the call was created after `_BackwardDone`'s, so by then each of them has run, and
with them each parameter's gradient accumulation (those run first of all): a parameter
that has none by then was not reached on this rank, and its gradient is zero. A parameter
the pass will still reach (`_will_engine_execute_node`: a double backward through a
gradient penalty uses the weights again) is waited for. A unit called with inputs that need
no gradient (token ids; the root) has no such event and is done when the backward ends, as
is every unit in a pass that reaches no parameter (torch.autograd.grad with respect to the
inputs).

[Note: units run on some ranks] is in unit_usage.py.
"""
from __future__ import annotations

import logging
import sys
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from ..policies import BackwardPolicy, UnitPolicy
from ..distributed import Comm
from ..distributed.sync_points import EVAL_FORWARD
from ..memory import hostmem
from ..memory.pool import BufferPool
from ..sharding.flat_unit import FlatUnit, TrainingState, UnitState
from .base import BackwardSchedule, ReduceQueue, eager_hook, inside_backward, output_tensors
from .gathered import register_engine
from .presence import clear_by_owner
from .unit_checks import UnitChecks
from .unit_usage import UnitUsage

log = logging.getLogger(__name__)



class _WatchedCall:
    """One call of a unit whose inputs pass through `_BackwardDone`: `settled` once the
    current backward reached its inputs (or its graph was freed)."""

    __slots__ = ("unit", "settled")

    def __init__(self, unit: int):
        self.unit, self.settled = unit, False


class _BackwardDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once their gradients are complete,
    i.e. once every op of the unit that reads them, and so every use of its weights, has run
    its backward ([Note: unit done]; [Note: frozen parameters] in sharding/frozen.py)."""

    @staticmethod
    def forward(ctx, done, *tensors):
        ctx.done = done
        # Copies, not views: a block may update its input in place (`x += h`), which autograd
        # forbids on a view a custom Function returned. One copy of the block's input per call.
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, *grads)


class Stage3Engine(UnitUsage, UnitChecks, BackwardSchedule):
    """The schedule: when each unit is gathered, freed and reduced."""

    # After a forward without gradients, whether a unit stays gathered ([Note: kept for generation]).
    keeper: Optional[Callable[[int], bool]] = None

    def __init__(self, units: list[FlatUnit], comm: Comm, backward: BackwardPolicy, policy: UnitPolicy,
                 pool: BufferPool, secondary_pool: Optional[BufferPool] = None):
        super().__init__(comm, backward.accumulation_steps, backward.reduce_each_micro_batch)
        self.units, self.policy, self.pool = units, policy, pool
        self.secondary_pool = secondary_pool  # hpZ's node pieces, kept from forward to backward
        self._saved_hooks = None  # saved-tensor hooks, active while the model runs forward
        self._hooks_owner: Optional[int] = None  # the unit whose forward entered them
        self._forward_trains = False  # the model's current forward runs with gradients
        self._eval_met = False  # this forward under no_grad had its sync point ([Note: sync points])
        self.root = len(units) - 1
        self.forward_order: list[int] = []
        self.backward_order: list[int] = []
        self._recording = True  # the first step: the orders above are recorded, nothing prefetched
        self._calls: list[set] = [set() for _ in units]  # per unit: its watched calls whose graph is alive
        # [Note: units run on some ranks]: the order training forwards gather units in (the
        # root apart), where each unit is in it, and how far the current forward got.
        self._catchup = list(range(self.root))
        self._position = {u: i for i, u in enumerate(self._catchup)}
        self._catchup_final = False  # the order is the forwards' own, no longer registration order
        self._cursor = 0
        self._ran = [False] * len(units)  # per unit: ran in a training forward since the last backward
        self._ran_stale = False  # a backward ended: the next training forward starts the count over
        self._mixed: list[int] = []  # units this pass's forwards ran on some ranks only
        self._queue_order: Optional[list[int]] = None  # the reduce order, while `_mixed` reduce last
        # Per unit: a training call since the last backward ended had inputs that need no gradient,
        # so nothing tells when its backward is over ([Note: unit done]).
        self._blind = [False] * len(units)
        self._live: set = set()  # units gathered since they were last seen freed
        # Reduce order: children finish backward before the units registered before them,
        # until the first reducing backward has shown the real order (`adopt_recorded_order`).
        self.queue = ReduceQueue(self, units, list(reversed(range(self.root))) + [self.root],
                                 backward.overlap_comm)
        self._order_guessed = False
        self.gathered_peak_nbytes = 0
        self._on_cpu = units[-1].device.type == "cpu"
        for ui, unit in enumerate(units):
            unit.module.register_forward_pre_hook(eager_hook(self._make_pre_forward(ui)))
            # always_call: the root's hook also ends a forward that raised (saved-tensor hooks).
            unit.module.register_forward_hook(eager_hook(self._make_post_forward(ui)), always_call=True)
            for p, name in zip(unit.params, unit.names):
                p.register_post_accumulate_grad_hook(eager_hook(self._make_grad_hook(ui, name)))
            if unit.params or unit.frozen:
                unit.module.register_forward_pre_hook(eager_hook(self._make_input_watch(ui)), with_kwargs=True)
        self._guard_sharded_use(units[-1].module)
        self._owner = [(u, i) for u in units for i in range(len(u.params))]
        self.track([p for u in units for p in u.params], self._clear_grads)
        self._reset_backward_state()
        register_engine(units[-1].module, self)

    def _reset_backward_state(self) -> None:
        # Per unit ([Note: unit done]): calls whose inputs' gradients are not in yet, and calls
        # run without gradients inside a training forward (reentrant checkpointing), whose
        # recomputation in backward is watched instead.
        # Watched calls whose backward has not reached their inputs yet: a forward's calls not
        # yet backpropagated, or never to be while its loss is kept (it then keeps its units
        # gathered through this backward); a call whose graph is freed is dropped
        # (`weakref.finalize`), and one already reached stays so (a retain_graph backward again
        # frees its unit at the first input gradient).
        for calls in self._calls:
            calls.difference_update([c for c in calls if c.settled])
        self._inputs_pending = [len(calls) for calls in self._calls]
        self._watched = [bool(calls) for calls in self._calls]  # a call's inputs needed gradients
        self._deferred = [0] * len(self.units)
        self._accumulating = (None, False)  # (graph task, whether it accumulates any parameter's gradient)
        for unit in self.units:
            unit.training_state = TrainingState.IDLE
        self.queue.rewind()

    def _check_same_unit(self, event: str) -> None:
        """Debug mode: every rank must be at the same gather; name the ranks that are not."""
        if not self.policy.check_same_unit:
            return
        events = self.comm.all_gather_object(event)
        if len(set(events)) > 1:
            detail = "; ".join(f"rank {r}: {e}" for r, e in enumerate(events))
            raise RuntimeError(f"rank {self.comm.rank}: ranks diverged at a stage-3 gather ({detail}); every rank "
                               f"must run the same units in the same order (same branches, same number of steps)")

    def gather(self, ui: int) -> None:
        """Gather unit `ui`'s exact values now and wait for it (outside forward and backward);
        a unit already gathered through a quantized transfer is gathered again, exactly."""
        self._gather(ui, "forward", async_op=False, exact=True)
        self.units[ui].wait()
        self.units[ui].make_exact()

    def start_gather(self, ui: int) -> None:
        """Begin gathering unit `ui` as its forward would, without waiting: its next forward
        (or its reshard) lands it. Every rank starts the same units in the same order."""
        self._gather(ui, "forward", async_op=True)

    def _gather(self, ui: int, phase: str, async_op: bool, exact: bool = False) -> None:
        unit = self.units[ui]
        if unit.state is UnitState.SHARDED:
            self._check_same_unit(f"{phase} gather of unit {unit.name}")
            unit.unshard(phase, async_op=async_op, exact=exact)
            self._live.add(ui)
            held = sum(u.full_nbytes for u in self.units if u.state is not UnitState.SHARDED)
            self.gathered_peak_nbytes = max(self.gathered_peak_nbytes, held)

    def _prefetch(self, order: list[int], ui: int, phase: str) -> None:
        if self._recording or ui not in order:
            return
        at = order.index(ui)
        # A held unit is gathered by every rank at the start of backward ([Note: units run on some ranks]).
        ahead = [u for u in order[at + 1:] if not self.units[u].held][:self.policy.prefetch_units + 1]
        for nxt in ahead[:self.policy.prefetch_units]:
            self._gather(nxt, phase, async_op=True)
        for nxt in ahead[self.policy.prefetch_units:]:  # the one after: its shard read from disk meanwhile
            self.units[nxt].warm()

    # -- forward -----------------------------------------------------------------------------
    def _make_pre_forward(self, ui: int):
        def hook(module, args):
            in_backward = inside_backward()
            unit = self.units[ui]
            if ui == self.root and not in_backward:
                self.check_no_open_backward()
                for u in self.units:  # a new forward: none of them ran in it yet
                    if u.training_state is TrainingState.FORWARD:
                        u.training_state = TrainingState.IDLE
                # A unit inside torch.utils.checkpoint(use_reentrant=True) runs under no_grad
                # but is recomputed in backward: hpZ keeps its node piece whenever the model's
                # forward trains.
                self._forward_trains = torch.is_grad_enabled()
                self._eval_met = False
            if not in_backward and torch.is_grad_enabled() and self._saved_hooks is None:
                # The outermost unit that runs: the root, or the first unit a loop calls itself
                # (`model[1](model[0](x))`), whose saved tensors need the packing as much.
                self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(eager_hook(self._pack), eager_hook(self._unpack))
                self._saved_hooks.__enter__()
                self._hooks_owner, self._forward_trains = ui, True
            if not in_backward and torch.is_grad_enabled() and ui == self.root:  # [Note: sync points]
                self.meet_before_training("the forward")
            elif not (in_backward or torch.is_grad_enabled() or self._forward_trains or self._eval_met) and \
                    unit.state is UnitState.SHARDED and (not unit.empty or unit.frozen):  # an evaluation must gather
                self._eval_met = True
                self.comm.sync_points.call(EVAL_FORWARD, "at stage 3 (each unit is all-gathered from every rank)")
            if not in_backward and (torch.is_grad_enabled() or self._forward_trains):
                self._visit(ui)
            phase = "backward" if in_backward else "forward"
            self._gather(ui, phase, async_op=False)
            unit.wait()
            if not in_backward and unit.training_state is TrainingState.IDLE:
                unit.training_state = TrainingState.FORWARD
            if not in_backward and torch.is_grad_enabled():
                if self._recording and not self._catchup_final and ui not in self.forward_order:
                    self.forward_order.append(ui)
                self._prefetch(self.forward_order, ui, "forward")
        return hook

    def _make_post_forward(self, ui: int):
        def hook(module, args, output):
            if ui == self._hooks_owner and self._saved_hooks is not None:
                self._saved_hooks.__exit__(None, None, None)
                self._saved_hooks, self._hooks_owner = None, None
            if inside_backward():  # recomputation (activation checkpointing): backward needs them
                return None
            training = torch.is_grad_enabled()
            if training:
                for t in output_tensors(output):
                    # A leaf output (an embedding's, made to require a gradient for checkpointing
                    # by `enable_input_require_grads`) ends the backward: nothing of the unit runs
                    # for it, so it does not gather the unit again.
                    if t.requires_grad and (t.grad_fn is not None or isinstance(t, nn.Parameter)):
                        t.register_hook(eager_hook(self._make_pre_backward(ui)))
            if ui == self.root and training and not _raised(output):
                self._pass_over(self._catchup[self._cursor:])
                self._cursor = len(self._catchup)
            if ui == self.root and training and self.recording_order and not self._order_guessed:
                self._guess_reduce_order()
            kept = self.keeper if not training and self.keeper is not None else (lambda uj: False)
            if (self.policy.reshard_after_forward or not training) and not kept(ui):
                self.units[ui].reshard(keep_secondary=self._forward_trains)  # hpZ: a node piece for backward
            if ui == self.root:
                # Prefetched units that this forward did not run are freed.
                for unit in [u for uj, u in enumerate(self.units) if not kept(uj)]:
                    if unit.training_state is TrainingState.IDLE and unit.state is not UnitState.SHARDED:
                        unit.reshard()
                    elif not training:
                        unit.reshard()
            return None
        return hook

    # -- backward ----------------------------------------------------------------------------
    def _make_pre_backward(self, ui: int):
        unit = self.units[ui]

        def hook(grad):
            if unit.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
                return None  # another of its outputs began its backward already
            self.begin_backward()
            unit.training_state = TrainingState.PRE_BACKWARD
            if unit.held:  # gathered by every rank already; some ranks have no backward of it
                unit.attach_grad_views()
                return None
            if self._recording:
                self.backward_order.append(ui)
            self._gather(ui, "backward", async_op=False)
            unit.wait()
            unit.attach_grad_views()
            self._prefetch(self.backward_order, ui, "backward")
            return None
        return hook

    def _make_grad_hook(self, ui: int, name: str):
        unit = self.units[ui]

        def hook(param):
            over = unit.training_state is TrainingState.POST_BACKWARD
            if not self.first_arrival(param, name, over):
                return
            if over:
                raise RuntimeError(
                    f"rank {self.comm.rank}: parameter {name} of stage-3 unit {unit.name} received its gradient after "
                    f"the unit's backward was over (the gradients of its inputs were complete), so the unit was "
                    f"already reduced without it ([Note: unit done] in schedule/stage3.py). Its use must lie on a "
                    f"path from the unit's inputs to its outputs inside the unit's forward: pass the tensors it "
                    f"combines with as arguments of the unit's forward, or make the enclosing module the unit")
            self._maybe_done(ui)
        return hook

    def _maybe_done(self, ui: int) -> None:
        """End the unit's backward if it is over ([Note: unit done]): its watched calls' inputs
        have their gradients and no parameter this pass reaches still waits for its own."""
        unit = self.units[ui]
        if unit.training_state in (TrainingState.IDLE, TrainingState.POST_BACKWARD):
            return
        if not self._watched[ui] or self._blind[ui] or self._inputs_pending[ui] > 0:
            return
        if unit.params and (not inside_backward() or self._grads_to_come(unit)):
            return
        self._unit_done(unit)
        if self.reduces_now:
            self.record_done(ui)
        self.queue.launch_ready()

    def _grads_to_come(self, unit: FlatUnit) -> bool:
        """Whether this pass will still accumulate a gradient into one of the unit's
        parameters, or accumulates none at all (it computes gradients of inputs only)."""
        reached = False
        for p in unit.params:
            if _will_accumulate(p):
                if id(p) not in self._fired:
                    return True
                reached = True
        return not reached and not self._pass_accumulates()

    def _pass_accumulates(self) -> bool:
        """Whether the running pass accumulates any parameter's gradient (once per graph task)."""
        task = torch._C._current_graph_task_id()
        if self._accumulating[0] != task:
            self._accumulating = (task, any(_will_accumulate(p) for u in self.units for p in u.params))
        return self._accumulating[1]

    def _make_input_watch(self, ui: int):
        """Forward pre-hook of a unit: its inputs that need a gradient pass through
        `_BackwardDone`, which tells when the unit's backward is over ([Note: unit done])."""
        def settle(call: _WatchedCall, backward: bool) -> None:
            if not call.settled:
                call.settled = True
                self._inputs_pending[ui] -= 1
            if backward:
                self._watched[ui] = True
            # A recomputation (reentrant checkpointing) runs its backward with no hook of its
            # outputs first: the unit is still in FORWARD.
            if backward or self.units[ui].training_state is TrainingState.PRE_BACKWARD:
                self._maybe_done(ui)

        def forget(call: _WatchedCall) -> None:  # its graph was freed: no backward will reach it
            self._calls[ui].discard(call)
            settle(call, backward=False)

        def hook(module, args, kwargs):
            if not torch.is_grad_enabled():
                if self._forward_trains and not inside_backward():
                    self._deferred[ui] += 1  # reentrant checkpointing: its recomputation is watched
                return None
            if inside_backward():
                if self._deferred[ui] == 0:
                    return None  # a recomputation whose first run is watched already
                self._deferred[ui] -= 1
            where = [("a", i) for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
            where += [("k", k) for k, v in kwargs.items() if torch.is_tensor(v) and v.requires_grad]
            if not where:
                if not inside_backward():
                    self._blind[ui] = True
                return None
            call = _WatchedCall(ui)
            self._calls[ui].add(call)
            self._inputs_pending[ui] += 1
            self._watched[ui] = True
            outs = _BackwardDone.apply(lambda: settle(call, backward=True),
                                       *[args[i] if kind == "a" else kwargs[i] for kind, i in where])
            weakref.finalize(outs[0].grad_fn, forget, call)
            args, kwargs = list(args), dict(kwargs)
            for (kind, i), t in zip(where, outs):
                if kind == "a":
                    args[i] = t
                else:
                    kwargs[i] = t
            return tuple(args), kwargs
        return hook

    def _unit_done(self, unit: FlatUnit) -> None:
        """Every gradient of the unit is in (or the backward ended): free the parameters,
        gather the gradients into one buffer; its reduction may launch."""
        unit.reshard()  # first, so that the gradient buffer can reuse the parameters' pooled buffer
        unit.accumulate_grads()
        unit.training_state = TrainingState.POST_BACKWARD
        if self._on_cpu:  # the unit's activations were just freed: [Note: long-lived host buffers]
            hostmem.release_free_heap(min_free=hostmem.STEP_RELEASE_MIN_FREE)

    def finish_backward(self) -> None:
        for unit in self.units:
            if unit.training_state is not TrainingState.POST_BACKWARD:
                self._unit_done(unit)
        if self.reduces_now:
            self.queue.flush()
            self.units[-1].placement.synchronize()  # offloaded gradient shards: their copies landed
        self._end_mixed()
        if self.reduces_now:
            self.queue.adopt_recorded_order()
        if self.forward_order:
            self._recording = False
        self._blind = [False] * len(self.units)
        self._ran_stale, self._cursor = True, 0
        self._reset_backward_state()

    def abandon_backward(self) -> None:
        """A backward that gave no parameter a gradient (e.g. torch.autograd.grad with
        respect to inputs): free what it gathered, reduce nothing, count nothing."""
        for unit in self.units:
            if unit.training_state is TrainingState.PRE_BACKWARD or unit.held:
                unit.discard_grads()
                unit.reshard()
        self._end_mixed()
        self._reset_backward_state()

    def _guess_reduce_order(self) -> None:
        """Before the first backward: units finish backward roughly in reverse forward
        order, a better guess than reverse registration order for a model that registers
        its modules in another order than it runs them (rank 0's, as everywhere)."""
        self._order_guessed = True
        self.queue.order = self.agreed_order([ui for ui in reversed(self.forward_order) if ui != self.root],
                                             self.queue.order)

    def _clear_grads(self, indices: list[int]) -> None:
        clear_by_owner(self._owner, indices)

    def after_step(self) -> None:
        """The shards changed: a node piece kept by a forward that had no backward (hpZ) is stale."""
        super().after_step()
        for unit in self.units:
            unit.drop_secondary()

    def reset(self) -> None:
        """After a backward or forward that raised ([Note: failed backward] in schedule/base.py):
        wait for reductions in flight, drop unreduced gradients, free every gathered unit."""
        super().reset()
        self.queue.wait_all(failed=True)  # no new collective now: the other ranks may not be reducing
        self.units[-1].placement.synchronize()  # offloaded gradient shards: before zero_grad zeroes them
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks, self._hooks_owner = None, None
        for unit in self.units:
            unit.discard_grads()
            unit.reshard()
        self._end_mixed()
        self._blind = [False] * len(self.units)
        self._ran_stale, self._cursor = True, 0
        self._reset_backward_state()


def _raised(output) -> bool:
    """In a forward hook registered with always_call: whether the forward raised (torch then
    calls it from its exception handler, with no output). The other ranks went on: no
    collective may follow."""
    return output is None and sys.exc_info()[0] is not None


def _will_accumulate(p: torch.Tensor) -> bool:
    """Whether the running backward pass will accumulate a gradient into `p`."""
    return torch._C._will_engine_execute_node(get_gradient_edge(p).node)
