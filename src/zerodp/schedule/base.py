"""What the stage 0-2 reducer and the stage-3 engine share: the accumulation boundary, the
end-of-backward callback, the order reductions are launched in, and starting over after a
backward that raised.

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
`optimizer.zero_grad()`, which also starts the window over. A handle reads as zeros, not
the gradient: in-place arithmetic on it fails (e.g. torch.nn.utils.clip_grad_norm_ over
`model.parameters()`, which would not see the sharded gradient anyway); use
`optimizer.clip_grad_norm_`.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..distributed import Comm

# Reductions allowed to be in flight at once before the oldest is waited for: a finished
# one gives its buffer back to the pool, so the pool stays a few buckets or units large
# whatever the model size (the paper's constant-size buffers, CB).
MAX_IN_FLIGHT = 2


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


def _handle(param: nn.Parameter, shared: dict) -> torch.Tensor:
    """A zero tensor of `param`'s shape whose elements all alias one element of `shared`'s
    storage for its dtype and device ([Note: gradient clearing]): no memory of its own, and
    a version counter of its own, so that zeroing it in place is seen."""
    key = (param.dtype, param.device)
    if key not in shared:
        shared[key] = torch.zeros(1, dtype=param.dtype, device=param.device).untyped_storage()
    return torch.empty(0, dtype=param.dtype, device=param.device).set_(shared[key], 0, param.shape,
                                                                        [0] * param.dim())


def clear_by_owner(owner: dict, indices: list[int]) -> None:
    """Clear the gradients of the tracked parameters `indices`, one call per storage that holds
    them (`owner[k]` is the (flat group or unit, local index) of parameter k)."""
    by_storage: dict = {}
    for k in indices:
        storage, i = owner[k]
        by_storage.setdefault(id(storage), (storage, []))[1].append(i)
    for storage, local in by_storage.values():
        storage.clear_grads(local)


class GradPresence:
    """Which trainable parameters have a gradient, as DDP's `p.grad is not None` says, and
    what the loop did to `.grad` since the engine last set it ([Note: gradient clearing])."""

    def __init__(self, comm: Comm, params: list[nn.Parameter], clear: Callable[[list[int]], None],
                 views: Optional[list[torch.Tensor]] = None):
        self.comm, self.params = comm, params
        self.views = views  # stages 0-1: each parameter's view of the flat gradient; else handles
        self._clear = clear  # zero what the engine holds of these parameters' gradients
        self.index = {id(p): k for k, p in enumerate(params)}
        self.present = [False] * len(params)  # as DDP before the first backward
        self._left: list = [None] * len(params)  # weak references to what the engine left in .grad
        self._versions = [0] * len(params)
        self._handles = [False] * len(params)  # what it left is a handle
        self._stripped: list = []  # (index, handle) taken out of the way of the pass in progress
        self.absent_seen = False  # a parameter without a gradient began this window
        self.remember()

    def has_grad(self, param: nn.Parameter) -> bool:
        return self.present[self.index[id(param)]]

    def any_grad(self) -> bool:
        return any(self.present)

    def remember(self) -> None:
        """Whatever each `.grad` holds now is the engine's doing."""
        for k, p in enumerate(self.params):
            g = p.grad
            self._left[k] = weakref.ref(g) if g is not None else None
            self._versions[k] = g._version if g is not None else 0

    def observe(self, backward: bool) -> None:
        """Take in what the loop did to each `.grad`; with `backward` (a pass begins), also
        get `.grad` ready for autograd: the flat gradient's view at stages 0-1, no handle."""
        cleared, zeroed, assigned = [], [], []
        for k, p in enumerate(self.params):
            g = p.grad
            had = self._left[k] is not None  # a cleared handle is gone: its weak reference is dead
            if g is None:
                if had:
                    cleared.append(k)
                    self.present[k], self._handles[k] = False, False
            elif had and g is self._left[k]():
                if self._handles[k] and g._version != self._versions[k]:
                    zeroed.append(k)
            else:  # a tensor of the loop's own replaces the gradient
                assigned.append((k, g))
                self.present[k], self._handles[k] = True, False
        if cleared or zeroed or assigned:
            self._clear(sorted(cleared + zeroed + [k for k, _ in assigned]))
        for k, g in assigned if self.views is not None else ():  # stages 0-1: into the flat gradient
            self.views[k].copy_(g)
            self.params[k].grad = self.views[k]
        if backward:
            self._ready_for_autograd()
            self.absent_seen = self.absent_seen or not all(self.present)
        self.remember()

    def _ready_for_autograd(self) -> None:
        for k, p in enumerate(self.params):
            if self.views is not None:
                if p.grad is None:  # zero since it was cleared: autograd adds in place
                    p.grad = self.views[k]
            elif self._handles[k] and p.grad is not None:
                self._stripped.append((k, p.grad))
                p.grad = None
                self._handles[k] = False

    def restore(self) -> None:
        """A pass that reached no parameter ended: the handles it took away are put back."""
        for k, handle in self._stripped:
            if self.params[k].grad is None:
                self.params[k].grad = handle
                self._handles[k] = True
        self._stripped.clear()
        self.remember()

    def note_used(self, param_ids) -> None:
        for i in param_ids:
            k = self.index.get(i)
            if k is not None:
                self.present[k] = True

    def settle(self) -> None:
        """A step's gradients are final: every rank agrees which parameters have one (a
        parameter that a backward reached on any rank), and `.grad` shows it."""
        if self.absent_seen and self.comm.world_size > 1:
            t = torch.tensor(self.present, dtype=torch.uint8, device=self.comm.device)
            self.comm.all_reduce(t, "control", op=dist.ReduceOp.MAX, label="parameters with a gradient")
            self.present = [bool(v) for v in t.tolist()]
        self.absent_seen = False
        self.publish(views_always=False)

    def reset(self, set_to_none: bool) -> None:
        """optimizer.zero_grad(set_to_none): no gradient, or a zero one, everywhere. With
        set_to_none `.grad` is None, as DDP's (torch DCP's state probe relies on it); the next
        backward hands autograd the flat gradient's view again (stages 0-1)."""
        self.present = [not set_to_none] * len(self.params)
        self.absent_seen = False
        self._stripped.clear()
        self.publish(views_always=False)

    def publish(self, views_always: bool) -> None:
        shared: dict = {}
        for k, p in enumerate(self.params):
            if self.views is not None:
                p.grad = self.views[k] if self.present[k] or views_always else None
            else:
                p.grad = _handle(p, shared) if self.present[k] else None
                self._handles[k] = self.present[k]
        self._stripped.clear()
        self.remember()


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

    @property
    def at_boundary(self) -> bool:
        return self.micro_step + 1 >= self.accumulation_steps

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
            p.register_hook(self._grad_arrives)

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
                f"(grad_accumulation_steps={self.accumulation_steps}) without optimizer.step(): "
                f"call step() and zero_grad() first")
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
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_backward(task))

    def _hand_over(self, node) -> bool:
        """The callback fired at the end of a nested pass, inside `node` of the outer one
        ([Note: nested end of backward]): whether the outer pass will run a pre-hook that
        queues it again there."""
        nexts = [fn for fn, _ in node.next_functions if fn is not None]
        if not nexts:
            return False  # nothing of the outer pass follows the node: this is the end
        self._end_task = None
        self._handover = [fn.register_prehook(self._resume_outer) for fn in nexts]
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
                t.register_hook(self._output_grad_hook)

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

    def after_step(self) -> None:
        self.micro_step = 0
        self.grads_ready = False
        self._window_open = False

    def reset(self) -> None:
        """Start over from no backward ([Note: failed backward]); subclasses release their buffers."""
        self._backward_open, self._end_task, self._window_open = False, None, False
        self._drop_handover()
        self._fired.clear()
        self.micro_step = 0
        self.grads_ready = False
        if self._recorded is not None:  # the failed pass's record is partial
            self._recorded = []
