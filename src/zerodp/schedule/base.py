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
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
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


class BackwardSchedule:
    """Accumulation boundary and end-of-backward bookkeeping for one model."""

    def __init__(self, comm: Comm, accumulation_steps: int, reduce_each_micro_batch: bool):
        self.comm = comm
        self.accumulation_steps = accumulation_steps
        self.reduce_each_micro_batch = reduce_each_micro_batch
        self.micro_step = 0  # backward passes finished since the last step
        self.grads_ready = False  # the boundary backward has finished reducing
        self._backward_open = False  # a backward began and its end callback is queued
        self._fired: set = set()  # parameters whose gradient arrived in this backward
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

    # -- one backward pass ---------------------------------------------------------------------
    def begin_backward(self) -> None:
        """Called by the first hook of a backward pass ([Note: end of backward])."""
        if self.grads_ready:
            raise RuntimeError(
                f"rank {self.comm.rank}: backward ran again after the accumulation boundary "
                f"(grad_accumulation_steps={self.accumulation_steps}) without optimizer.step(): "
                f"call step() and zero_grad() first")
        if not self._backward_open:
            self._backward_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

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

    def _end_backward(self) -> None:
        self._backward_open = False
        if not self._fired:
            # A backward that reached the model's outputs but no trainable parameter
            # (torch.autograd.grad(loss, inputs): adversarial inputs, gradient penalties):
            # not a micro-batch, nothing to reduce.
            self.abandon_backward()
            return
        self.finish_backward()
        self._fired.clear()
        if self.at_boundary:
            self.grads_ready = True
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

    def reset(self) -> None:
        """Start over from no backward ([Note: failed backward]); subclasses release their buffers."""
        self._backward_open = False
        self._fired.clear()
        self.micro_step = 0
        self.grads_ready = False
        if self._recorded is not None:  # the failed pass's record is partial
            self._recorded = []
