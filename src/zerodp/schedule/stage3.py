"""Stage 3 (Pos+g+p, ZeRO arXiv 1910.02054 §5.3): parameters gathered per unit on demand.

Hooks call methods of a unit (sharding/flat_unit.py); the unit calls its collective
strategy (distributed/collectives.py).

Forward: a unit's pre-hook gathers its parameters (and prefetches the next
`prefetch_units` units of the order recorded on the first step); its post-hook frees
them (`reshard_after_forward`) and registers a hook on its outputs' gradients.
Backward: that gradient hook fires before any of the unit's backward ops run, and
gathers the unit again (prefetching the next units of the recorded backward order).
When every trainable parameter of a unit has its gradient accumulated
(`register_post_accumulate_grad_hook`), the gradients move into a flat buffer, the
parameters are freed, and the buffer is reduce-scattered into the unit's gradient shard
(every micro-batch, or only at the accumulation boundary with reduce_each_micro_batch=False).
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
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Callable, Iterable, Iterator, Optional, Union

import torch
import torch.nn as nn

from ..policies import BackwardPolicy, UnitPolicy
from ..distributed import Comm
from ..distributed.sync_points import EVAL_FORWARD
from ..memory import hostmem
from ..memory.pool import BufferPool
from ..sharding.flat_unit import FlatUnit, TrainingState, UnitState
from .base import BackwardSchedule, ReduceQueue, eager_hook, inside_backward, output_tensors
from .presence import clear_by_owner

log = logging.getLogger(__name__)

# Model -> its stage-3 engine, for gathered_parameters(); weak both ways (the engine holds
# the model), so that a model and its optimizer die when the user drops them.
_ENGINES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


class _UnitView:
    """Marks a saved tensor packed as a view of a unit's gathered buffer."""


class _WatchedCall:
    """One call of a unit with frozen parameters whose inputs pass through `_BackwardDone`:
    `settled` once the current backward reached its inputs (or its graph was freed)."""

    __slots__ = ("unit", "settled")

    def __init__(self, unit: int):
        self.unit, self.settled = unit, False


class _BackwardDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once their gradients are complete,
    i.e. once every op of the unit that reads them, and so its frozen weights, has run its
    backward ([Note: frozen parameters] in sharding/frozen.py)."""

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


class Stage3Engine(BackwardSchedule):
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
        self._pending = [0] * len(units)  # per unit: parameters whose gradient is not in yet
        self._calls: list[set] = [set() for _ in units]  # per unit: its watched calls whose graph is alive
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
            if unit.frozen:
                unit.module.register_forward_pre_hook(eager_hook(self._make_input_watch(ui)), with_kwargs=True)
        self._guard_sharded_use(units[-1].module)
        self._owner = [(u, i) for u in units for i in range(len(u.params))]
        self.track([p for u in units for p in u.params], self._clear_grads)
        self._reset_backward_state()
        _ENGINES[units[-1].module] = weakref.ref(self)

    def _guard_sharded_use(self, model: nn.Module) -> None:
        """A module whose parameters belong to a unit that is not gathered when it runs
        would compute with 1-D shards (wrong shapes on some ranks, a hang on the others).
        Each module holding unit parameters checks, just before its forward, that their
        units are gathered, and raises naming them; registered after the units' own
        hooks, so a unit's gather runs first."""
        unit_of = {id(p): ui for ui, u in enumerate(self.units) for p in u.all_params()}
        for mname, m in model.named_modules():
            mine = [(pname, unit_of[id(p)]) for pname, p in m.named_parameters(recurse=False) if id(p) in unit_of]
            if mine:
                m.register_forward_pre_hook(self._make_sharded_check(mname or "<root>", type(m).__name__, mine))

    def _make_sharded_check(self, mname: str, kind: str, mine: list):
        def hook(module, args):
            # Traced by torch.compile, not run ([Note: hooks stay eager] in schedule/base.py):
            # read there, `mine` would specialise a block's graph to each instance. A compiled
            # frame meets only gathered parameters: a shard fails the graph's shape guards.
            if torch.compiler.is_compiling():
                return
            for pname, ui in mine:
                if self.units[ui].state is UnitState.SHARDED:
                    unit = self.units[ui]
                    raise RuntimeError(
                        f"rank {self.comm.rank}: {mname} ({kind}) ran while its parameter {pname!r} is sharded: "
                        f"stage-3 unit {unit.name} that holds it was not gathered, because that unit's forward "
                        f"does not enclose this call. Units must be modules whose forward runs every use of "
                        f"their parameters: set Config.unit_modules to the model's block class, or run the "
                        f"call inside zerodp.gathered_parameters(...)")
        return hook

    # -- helpers -----------------------------------------------------------------------------
    def _reset_backward_state(self) -> None:
        self._pending = [len(u.params) for u in self.units]
        # Units holding frozen parameters: calls whose inputs' gradients are not in yet, and
        # calls run without gradients inside a training forward (reentrant checkpointing),
        # whose recomputation in backward is watched instead.
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
        ahead = order[at + 1: at + 2 + self.policy.prefetch_units]
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
            phase = "backward" if in_backward else "forward"
            self._gather(ui, phase, async_op=False)
            unit.wait()
            if not in_backward and unit.training_state is TrainingState.IDLE:
                unit.training_state = TrainingState.FORWARD
            if not in_backward and torch.is_grad_enabled():
                if self._recording and ui not in self.forward_order:
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

    # -- saved tensors (see [Note: unit storage] in sharding/flat_unit.py) ------------------
    def _pack(self, t: torch.Tensor):
        if t.layout is not torch.strided:
            return t
        ptr = t.untyped_storage().data_ptr()
        for ui in list(self._live):  # the few gathered units, not every unit
            buffers = self.units[ui].gathered_buffers()
            if not buffers:
                self._live.discard(ui)
            for bi, buf in buffers:
                if ptr == buf.untyped_storage().data_ptr():
                    return (_UnitView, ui, bi, t.storage_offset(), tuple(t.shape), t.stride())
        return t

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] is _UnitView):
            return packed
        _, ui, bi, offset, shape, stride = packed
        unit = self.units[ui]
        if unit.buffer(bi) is None or unit.state is UnitState.SHARDED:
            raise RuntimeError(f"rank {self.comm.rank}: backward needs the parameters of stage-3 unit {unit.name}, "
                               f"which are not gathered: was a parameter of it used outside the unit's forward?")
        unit.wait()
        view = unit.buffer(bi).as_strided(shape, stride, offset)
        # A backward with create_graph=True (a gradient penalty) records what it unpacks in
        # the double-backward graph, which outlives this gather: the pooled buffer is reused
        # by the next forward, so that graph gets a copy of its own.
        return view.clone() if torch.is_grad_enabled() else view

    # -- backward ----------------------------------------------------------------------------
    def _make_pre_backward(self, ui: int):
        unit = self.units[ui]

        def hook(grad):
            if unit.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
                return None  # another of its outputs began its backward already
            self.begin_backward()
            unit.training_state = TrainingState.PRE_BACKWARD
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
            if not self.first_arrival(param, name, unit.training_state is TrainingState.POST_BACKWARD):
                return
            self._pending[ui] -= 1
            self._maybe_done(ui)
        return hook

    def _maybe_done(self, ui: int) -> None:
        """The unit's backward is over once its trainable parameters' gradients are in and,
        with frozen parameters, its inputs' gradients too; a unit with frozen parameters whose
        inputs need no gradient (the root, taking token ids) stays gathered until backward ends."""
        if self.units[ui].frozen and not self._watched[ui]:
            return
        if self._pending[ui] == 0 and self._inputs_pending[ui] <= 0:
            if self.units[ui].training_state is TrainingState.POST_BACKWARD:
                return
            self._unit_done(self.units[ui])
            if self.reduces_now:
                self.record_done(ui)
            self.queue.launch_ready()

    def _make_input_watch(self, ui: int):
        """Forward pre-hook of a unit with frozen parameters: its inputs that need a gradient
        pass through `_BackwardDone`, which tells when the unit's backward is over."""
        def settle(call: _WatchedCall, backward: bool) -> None:
            if not call.settled:
                call.settled = True
                self._inputs_pending[ui] -= 1
            if backward:
                self._watched[ui] = True
            if self.units[ui].training_state is TrainingState.PRE_BACKWARD:
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
            self.queue.adopt_recorded_order()
        if self.forward_order:
            self._recording = False
        self._reset_backward_state()

    def abandon_backward(self) -> None:
        """A backward that gave no parameter a gradient (e.g. torch.autograd.grad with
        respect to inputs): free what it gathered, reduce nothing, count nothing."""
        for unit in self.units:
            if unit.training_state is TrainingState.PRE_BACKWARD:
                unit.discard_grads()
                unit.reshard()
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
        self._reset_backward_state()


@contextlib.contextmanager
def gathered_parameters(target: Union[nn.Module, Iterable[nn.Parameter]], modify: bool = False,
                        optimizer=None) -> Iterator[None]:
    """Full parameters present on every rank inside the block. With `modify=True`, rank
    0's values are written back to every rank's shard on exit (and to the fp32 master
    if `optimizer` is given), as DeepSpeed's GatheredParameters(modifier_rank=0) does.
    Outside stage 3 the parameters are already full; the block is still a valid no-op."""
    if optimizer is not None:
        optimizer.settle()  # a delayed update lands before the parameters are read or edited
    params = list(target.parameters()) if isinstance(target, nn.Module) else list(target)
    wanted = {id(p) for p in params}
    chosen: list[tuple[Stage3Engine, FlatUnit]] = []
    for engine in [ref() for ref in list(_ENGINES.values())]:
        if engine is None:
            continue
        for unit in engine.units:
            if any(id(p) in wanted for p in unit.all_params()):
                chosen.append((engine, unit))
    # Every chosen unit is gathered at once: a one-off peak the pools give back on exit
    # (kept, it would hold the whole model's parameters for the rest of the run).
    marks = {id(unit.pool): (unit.pool, unit.pool.mark()) for _, unit in chosen}
    for engine, unit in chosen:
        engine.gather(engine.units.index(unit))
    try:
        yield
    finally:
        if modify:
            with torch.no_grad():
                for engine, unit in chosen:
                    # Over the unit's own ranks: an expert bank's are those that hold its experts.
                    if not unit.empty:
                        unit.comm.broadcast(unit.full, 0, "init")
                        unit.shard.copy_(unit.own_chunk(unit.full))
                    for part in unit.frozen:
                        unit.comm.broadcast(part.full, 0, "init")
                        part.write_back()
                if optimizer is not None:
                    optimizer.refresh_master_from_params()
        for _, unit in chosen:
            unit.reshard()
        for pool, mark in marks.values():
            pool.release_since(mark)
