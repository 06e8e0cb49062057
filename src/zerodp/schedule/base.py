"""What the stage 0-2 reducer and the stage-3 engine share: the accumulation boundary, the
end-of-backward callback, the queue of reductions and the order they are launched in, and
starting over after a backward that raised.

[Note: end of backward]
Reductions still waiting when autograd finishes (unused parameters, the last bucket) are
flushed by a callback queued on autograd's graph task. It must be queued on the *outer*
task: `torch.utils.checkpoint(..., use_reentrant=True)` runs a nested backward whose
callbacks fire when that nested pass ends, long before the real one does. So the root
module's forward registers a hook on its outputs, which fires first in the outer backward
and queues the callback there; a parameter's hook queues it only if no output hook ran
(a loss built from something other than the model's outputs).

[Note: failed backward]
If a backward raises, autograd drops its callbacks, so the schedule is left mid-pass:
buckets or units half reduced, buffers out of the pool. `optimizer.zero_grad()` starts
over (waits for what is in flight, returns every buffer, zeroes the gradients), which is
what the common loop "catch the error, skip the batch" calls; a forward with gradients
enabled that finds a pass still open raises, naming that fix, rather than silently mixing
the failed pass's partial gradients into the next step.

[Note: nested end of backward]
The first hook of a pass may run inside a nested backward anyway: a loop that calls the
model's submodules itself (no root forward, no output hook) and checkpoints one of them
with `use_reentrant=True`. The callback queued there fires when the nested pass ends, while
autograd is still evaluating the checkpoint's node of the outer pass
(`torch._C._current_autograd_node()` is that node; at the end of an outer pass it is None).
The pass is then handed over: a pre-hook on the nodes that take the checkpoint's input
gradients runs in the outer pass and queues the callback there. A hook that fires in an
enclosing pass (a smaller graph-task id) queues it there too; a callback whose pass was
handed over does nothing.

[Note: gradient clearing]
Each trainable parameter has a gradient or none, as DDP's `p.grad is None` says: torch's
optimizer steps only parameters that have one (none: no weight decay, no momentum, no Adam
step), and a backward adds to a gradient that is there. zerodp keeps the gradients in its
own buffers (the flat gradient at stages 0-1, the reduced shard at stages 2-3), so it must
learn how the loop cleared them. `optimizer.zero_grad(set_to_none)` tells it. Everything
else goes through `p.grad`, which zerodp keeps non-None exactly while the parameter has a
gradient, as DDP would: at stages 0-1 the parameter's view of the flat gradient (DDP's
gradient_as_bucket_view); at stages 2-3, where the rank holds only its shard, a *handle*: a
tensor of the parameter's shape whose elements all alias one zero element (no memory), put
there when a step's gradient is final. `GradPresence.observe` reads every `.grad` when a
backward pass begins (a hook on each parameter runs before autograd adds to its `.grad`)
and at the step:
- None where the engine left a view or handle (`model.zero_grad()`, which Hugging Face's
  Trainer calls, or `p.grad = None`): cleared; its buffers are zeroed and it has no
  gradient until a backward reaches it.
- a handle whose version moved (`model.zero_grad(set_to_none=False)`): a zero gradient.
- the view or handle as left (no clearing at all): the gradient is still there, and the
  next window adds to it, as torch does.
This is FSDP2's choice, whose sharded gradient lives in the sharded parameter's `.grad`, so
that clearing `.grad` clears it. DeepSpeed's step consumes the gradient instead: there
`model.zero_grad()` is a no-op, and a loop that does not clear silently clears anyway.
A backward that reaches a parameter on any rank gives it a gradient on every rank (DDP's
find_unused_parameters): when a window began with a parameter that had none, the ranks
agree at its end which parameters have one (one MAX all-reduce of a byte per parameter).
Between micro-batches a gradient already reduced (stage 2 with reduce_each_micro_batch) or
held in a unit's buffer (stage 3) has no handle, so clearing inside a window is seen only
at stages 0-1 and stage 2 without per-micro-batch reduction: elsewhere clear with
`optimizer.zero_grad()`, which also starts the window over. Once a step's gradients are
reduced, stage 1 over several ranks shows handles too (its view then holds unreduced sums
outside the owned chunk), and a handle answers torch's gradient utilities from the shards:
[Note: torch's utilities on sharded gradients] in grad_handle.py.

[Note: DDP's accumulation flag]
DDP scripts accumulate by turning the all-reduce off for the micro-batches before the last:
`with model.no_sync():` or, as nanoGPT's train.py does, `model.require_backward_grad_sync =
(micro_step == last)` before the forward; DDP reads the flag in its forward. zerodp gives the
model the same attribute and context manager and reads the flag in the root module's forward
pre-hook: a backward is the accumulation boundary when the flag was set at its forward and
`Config.grad_accumulation_steps` backward passes have run (the default 1: the flag alone
decides). The backward passes before the boundary accumulate what the stage keeps (the flat
gradient at stages 0-1, a unit's or bucket's reduced shard at stages 2-3, where the memory
saving needs the reduction), so the step sees DDP's sum; only where the reduction happens
differs, never the result. A loop that calls `loss.backward()` itself divides its loss by
its accumulation steps itself, as under DDP; `optimizer.backward(loss)` divides by
`Config.grad_accumulation_steps`, which is 1 unless the Config sets it.

[Note: hooks stay eager]
torch.compile traces a module's `__call__`, and with it the forward hooks that run inside
it, so a compiled model or block would trace zerodp's hooks: stage 3's gather swaps each
parameter's `.data` from its 1-D shard to its gathered view, and a graph traced around that
swap captures the parameters as shards (inductor then fails, or recompiles each step).
Every hook zerodp registers (module hooks, tensor and post-accumulate gradient hooks, the
saved-tensor pack and unpack, the end-of-backward callback) is wrapped by `eager_hook`,
which tells dynamo to run it as it is (FSDP2's hooks are wrapped the same way): a compiled
frame breaks its graph at the hook, the hook gathers, frees or reduces eagerly, and the
module's own forward is traced and compiled with the parameters already gathered, so no
compiled frame sees a shard and the guards on the parameters' shapes hold every step. The
only hook left traceable is stage 3's sharded-use check (`Stage3Engine._guard_sharded_use`),
on the layers inside the units: a graph break there would split every compiled block at
each of its layers, so under tracing it does nothing (a shard reaching a compiled frame
fails that frame's guards on the parameters' shapes instead). docs/compile.md.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..distributed import Comm
from .presence import GradPresence

# Reductions allowed to be in flight at once before the oldest is waited for: a finished
# one gives its buffer back to the pool, so the pool stays a few buckets or units large
# whatever the model size (the paper's constant-size buffers, CB).
MAX_IN_FLIGHT = 2


def eager_hook(fn: Callable) -> Callable:
    """`fn` as a hook that torch.compile never traces ([Note: hooks stay eager])."""
    return torch._dynamo.disable(fn, recursive=True, reason="zerodp hook: gathers, frees and reduces run eagerly")


def inside_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def output_tensors(output, depth: int = 3) -> list[torch.Tensor]:
    """Tensors in a forward's output: pytree containers (tuples, dicts, Hugging Face
    ModelOutputs), and the fields of dataclasses and plain objects pytree does not know."""
    found = []
    for leaf in tree_flatten(output)[0]:
        if torch.is_tensor(leaf):
            found.append(leaf)
        elif depth > 0 and dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += output_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)], depth - 1)
        elif depth > 0 and hasattr(leaf, "__dict__") and not isinstance(leaf, (type, torch.nn.Module)):
            found += output_tensors(list(vars(leaf).values()), depth - 1)
    return found


class _Reduction(NamedTuple):
    """A launched reduction: its item, the collective's handle (None when it ran
    synchronously), and whether the reduced chunk is added to a gradient the item keeps."""
    item: object
    work: object
    accumulate: bool


class ReduceQueue:
    """A schedule's gradient reductions, launched strictly in `order`, the same on every rank,
    so that every rank issues the same collectives even when autograd finishes them in
    another order: first a guess, then the order they became ready in the first reducing
    backward (rank 0's, `BackwardSchedule.adopt_recorded_order`).

    An item is a storage that owns its collectives: a bucket of a flat param group at
    stages 0-2 (sharding/bucket.py), a unit at stage 3 (sharding/flat_unit.py). Each offers
    `ready_to_reduce` (its gradients are all in), `accumulates` (its reduced chunk is added
    to a gradient it keeps), `launch_reduce(accumulate, async_op) -> work`,
    `reduced_chunk(accumulate)` (where the rank's chunk is before `finish_reduce`),
    `finish_reduce(accumulate)` (land the chunk, free the buffer), `scattered` (its
    reduction is a reduce-scatter over the shard axis), `label` (the ledger's) and
    `storage_part` (what `on_final_grads` is told)."""

    def __init__(self, schedule: "BackwardSchedule", items: list, order: list[int], async_op: bool):
        self.schedule, self.items, self.async_op = schedule, items, async_op
        self.order = order  # indices of `items`, in launch order
        self._next = 0  # position in `order` of the next launch in this backward
        self._in_flight: deque = deque()

    def launch_ready(self, flush: bool = False) -> None:
        """In a backward that reduces: launch items in order up to the first that is not
        ready; with `flush` (the end of backward: unused parameters), all that are left."""
        if not self.schedule.reduces_now:
            return
        while self._next < len(self.order):
            item = self.items[self.order[self._next]]
            if not (flush or item.ready_to_reduce):
                return
            self.schedule.meet_before_training("the backward")
            self._launch(item)
            self._next += 1

    def _launch(self, item) -> None:
        accumulate = item.accumulates
        self._in_flight.append(_Reduction(item, item.launch_reduce(accumulate, self.async_op), accumulate))
        # Bound the reductions in flight: a finished one gives its buffer back to the pool at
        # once, and at most MAX_IN_FLIGHT wait behind the wire (CB).
        while self._in_flight and (len(self._in_flight) > MAX_IN_FLIGHT or self._in_flight[0].work is None
                                   or self._in_flight[0].work.is_completed()):
            self._finish(self._in_flight.popleft())

    def _finish(self, done: _Reduction, failed: bool = False) -> None:
        """Wait for one reduction and land it. After a `failed` backward, no new collective
        (the other ranks may not be reducing) and no announcement."""
        if done.work is not None:
            done.work.wait()
        item, comm = done.item, self.schedule.comm
        if not failed and item.scattered and comm.topology.replicate_size > 1:
            # Hybrid sharding ([Note: mesh axes]): the reduce-scatter summed within a replica
            # row; the owned chunk is then summed over the rows (each holds other data).
            comm.all_reduce(item.reduced_chunk(done.accumulate), "backward", axis="replicate", label=item.label)
        item.finish_reduce(done.accumulate)
        if not failed and self.schedule.at_boundary and self.schedule.on_final_grads is not None:
            self.schedule.on_final_grads(*item.storage_part)  # [Note: gradient streaming] in optim/streaming.py

    def flush(self) -> None:
        """End of a reducing backward: launch what is left, wait for everything in flight."""
        self.launch_ready(flush=True)
        self.wait_all()

    def wait_all(self, failed: bool = False) -> None:
        while self._in_flight:
            self._finish(self._in_flight.popleft(), failed)

    def adopt_recorded_order(self) -> None:
        self.order = self.schedule.adopt_recorded_order(self.order)

    def rewind(self) -> None:
        """A new backward launches from the start of `order`."""
        self._next = 0


class BackwardSchedule:
    """Accumulation boundary and end-of-backward bookkeeping for one model."""

    def __init__(self, comm: Comm, accumulation_steps: int, reduce_each_micro_batch: bool):
        self.comm = comm
        self.accumulation_steps = accumulation_steps
        self.reduce_each_micro_batch = reduce_each_micro_batch
        self.micro_step = 0  # backward passes finished since the last step
        self.grads_ready = False  # the boundary backward has finished reducing
        self._backward_open = False  # a backward began and its end callback is queued
        self._end_task: Optional[int] = None  # the graph task the callback waits for ([Note: nested end of backward])
        self._handover: list = []  # pre-hooks that carry the pass over to the outer graph task
        self._window_open = False  # a backward of this accumulation window has begun
        self._fired: set = set()  # parameters whose gradient arrived in this backward
        self.presence: Optional[GradPresence] = None  # [Note: gradient clearing]; see `track`
        # Buckets or units in the order they were done in the first reducing backward;
        # None once that order is adopted (`adopt_recorded_order`).
        self._recorded: Optional[list[int]] = []
        # Called with each part whose owned gradient is final for this step (a unit, or a
        # group and segment): [Note: gradient streaming] in optim/streaming.py.
        self.on_final_grads: Optional[Callable] = None
        # DDP's `require_backward_grad_sync` as the last training forward read it ([Note:
        # DDP's accumulation flag]).
        self.sync_requested = True
        self.window_met = False  # this window's first collective had its sync point (`meet_before_training`)

    @property
    def at_boundary(self) -> bool:
        return self.sync_requested and self.micro_step + 1 >= self.accumulation_steps

    def note_forward(self, sync: bool) -> None:
        """A training forward of the root module ran with DDP's flag `sync` ([Note: DDP's
        accumulation flag]); read once per forward, as DDP reads it."""
        if self._backward_open:
            return  # a forward inside a backward (reentrant checkpointing) belongs to that pass
        self.sync_requested = bool(sync)

    @property
    def reduces_now(self) -> bool:
        """Whether this backward reduces gradients (else they accumulate unsharded)."""
        return self.at_boundary or self.reduce_each_micro_batch

    def track(self, params: list[nn.Parameter], clear: Callable[[list[int]], None],
              views: Optional[list[torch.Tensor]] = None) -> None:
        """Follow `params`' gradients ([Note: gradient clearing]); a hook on each runs before
        autograd adds to its `.grad`, so a pass always begins before any of them changes."""
        self.presence = GradPresence(self.comm, params, clear, views)
        for p in params:
            p.register_hook(eager_hook(self._grad_arrives))

    def _grad_arrives(self, grad):
        self.begin_backward()
        return None

    def observe_clearing(self) -> None:
        """What the loop did to `.grad` since the last backward (at the step)."""
        if self.presence is not None and not self._backward_open:
            self.presence.observe(backward=False)

    def clear_gradients(self, set_to_none: bool) -> None:
        """optimizer.zero_grad(): the storages are zeroed by the optimizer; `.grad` follows."""
        if self.presence is not None:
            self.presence.reset(set_to_none)

    # -- one backward pass ---------------------------------------------------------------------
    def begin_backward(self) -> None:
        """Called by the first hook of a backward pass ([Note: end of backward]), and again
        by later ones, which hand the pass to an enclosing graph task if they run in one."""
        if self.grads_ready:
            raise RuntimeError(
                f"rank {self.comm.rank}: backward ran again after the accumulation boundary "
                f"(grad_accumulation_steps={self.accumulation_steps}) without optimizer.step(): to accumulate "
                f"over several backward passes, run the ones before the last under `with model.no_sync():` "
                f"(or set model.require_backward_grad_sync = False), as with DDP, or set "
                f"Config(grad_accumulation_steps=k); otherwise call step() and zero_grad() first")
        task = torch._C._current_graph_task_id()
        if not self._backward_open:
            self._backward_open = True
            self._queue_end(task)
            if self.presence is not None:
                self.presence.observe(backward=True)
            if not self._window_open:
                self._window_open = True
                self.start_window()
        elif self._end_task is None or task < self._end_task:
            self._queue_end(task)  # an enclosing pass: its end is this pass's end

    def _queue_end(self, task: int) -> None:
        self._drop_handover()
        self._end_task = task
        torch.autograd.Variable._execution_engine.queue_callback(eager_hook(lambda: self._end_backward(task)))

    def _hand_over(self, node) -> bool:
        """The callback fired at the end of a nested pass, inside `node` of the outer one
        ([Note: nested end of backward]): whether the outer pass will run a pre-hook that
        queues it again there."""
        nexts = [fn for fn, _ in node.next_functions if fn is not None]
        if not nexts:
            return False  # nothing of the outer pass follows the node: this is the end
        self._end_task = None
        self._handover = [fn.register_prehook(eager_hook(self._resume_outer)) for fn in nexts]
        return True

    def _resume_outer(self, grad_outputs):
        self._drop_handover()
        if self._backward_open and self._end_task is None:
            self._queue_end(torch._C._current_graph_task_id())
        return None

    def _drop_handover(self) -> None:
        for h in self._handover:
            h.remove()
        self._handover = []

    def start_window(self) -> None:
        """Subclasses: the first backward of an accumulation window begins."""

    def watch_outputs(self, output) -> None:
        """Queue the end-of-backward callback from the model's outputs, in the outer graph task."""
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(eager_hook(self._output_grad_hook))

    def _output_grad_hook(self, grad):
        self.begin_backward()
        return None

    def first_arrival(self, param: torch.Tensor, name: str, already_reduced: bool) -> bool:
        """Whether this is the parameter's first gradient in this backward. A second one
        comes only from nested backward passes (`use_reentrant=True` checkpointing of a
        parameter used in several segments); once its bucket or unit was reduced it would
        be lost, so that is an error rather than a silently wrong gradient."""
        if id(param) not in self._fired:
            self._fired.add(id(param))
            return True
        if already_reduced:
            raise RuntimeError(
                f"rank {self.comm.rank}: parameter {name} received a second gradient in one backward, after its "
                f"gradients were reduced: it is used inside several torch.utils.checkpoint(use_reentrant=True) "
                f"segments, each of which runs its own backward; use use_reentrant=False")
        return False

    def _end_backward(self, task: int) -> None:
        if task != self._end_task:
            return  # the pass was handed to an enclosing graph task
        outer = torch._C._current_autograd_node()
        if outer is not None and self._hand_over(outer):
            return
        self._backward_open, self._end_task = False, None
        if not self._fired:
            # A backward that reached the model's outputs but no trainable parameter
            # (torch.autograd.grad(loss, inputs): adversarial inputs, gradient penalties):
            # not a micro-batch, nothing to reduce.
            self.abandon_backward()
            if self.presence is not None:
                self.presence.restore()
            return
        self.finish_backward()
        if self.presence is not None:
            self.presence.note_used(self._fired)
        self._fired.clear()
        if self.at_boundary:
            if self.presence is not None:
                self.presence.settle()
            self.grads_ready = True
        elif self.presence is not None:
            self.presence.remember()
        self.micro_step += 1

    def finish_backward(self) -> None:
        """Subclasses: flush and wait for this pass's reductions."""
        raise NotImplementedError

    def abandon_backward(self) -> None:
        """Subclasses: undo what a backward that produced no parameter gradient set up."""

    def check_no_open_backward(self) -> None:
        """Called at the start of a training forward ([Note: failed backward])."""
        if self._backward_open and torch.is_grad_enabled() and not inside_backward():
            raise RuntimeError(
                f"rank {self.comm.rank}: the previous backward did not finish (it raised), and its gradients "
                f"are half reduced: call optimizer.zero_grad() before the next forward, as after any "
                f"failed step")

    # -- across passes -------------------------------------------------------------------------
    def agreed_order(self, first: list[int], order: list[int]) -> list[int]:
        """`order` with rank 0's `first` moved to the front, on every rank (reductions must
        be issued in one order everywhere); the rest keep their places."""
        first = list(self.comm.all_gather_object(list(first))[0])
        chosen = set(first)
        return first + [i for i in order if i not in chosen]

    @property
    def recording_order(self) -> bool:
        return self._recorded is not None

    def record_done(self, item: int) -> None:
        """A bucket or unit was done (its reduction could launch) in the first reducing backward."""
        if self._recorded is not None:
            self._recorded.append(item)

    def adopt_recorded_order(self, order: list[int]) -> list[int]:
        """Once, after the first reducing backward: `order` led by what that backward
        recorded, as DDP rebuilds its buckets after its first iteration. A model that
        registers its modules in another order than it runs them would otherwise hold every
        gradient until the first-registered bucket or unit is done."""
        if self._recorded is None:
            return order
        recorded, self._recorded = self._recorded, None
        return self.agreed_order(recorded, order)

    def meet_before_training(self, doing: str) -> None:
        """Right before the first collective of an accumulation window (a stage-3 training
        forward's first gather, else the first reduction), once: the ranks check that none
        waits in a call the others skipped ([Note: sync points] in distributed/sync_points.py)."""
        if not self.window_met:
            self.window_met = True
            self.comm.sync_points.before_training(f"{doing} of step {self.comm.ledger.step}")

    def after_step(self) -> None:
        self.micro_step = 0
        self.grads_ready = False
        self._window_open = False
        self.window_met = False

    def reset(self) -> None:
        """Start over from no backward ([Note: failed backward]); subclasses release their buffers."""
        self._backward_open, self._end_task, self._window_open = False, None, False
        self.window_met = False
        self._drop_handover()
        self._fired.clear()
        self.micro_step = 0
        self.grads_ready = False
        if self._recorded is not None:  # the failed pass's record is partial
            self._recorded = []
