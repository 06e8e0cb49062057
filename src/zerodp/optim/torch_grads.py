"""The optimizer's answers to torch's gradient utilities on sharded gradients: each
parameter's exact norm, scaling and clamping of its shard ([Note: torch's utilities on
sharded gradients] in schedule/grad_handle.py)."""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .master import piece_runs

__all__ = ["ShardGradAccess"]


class ShardGradAccess:
    """Per trainable parameter, the runs of the owned master pieces that hold its gradient; the
    norms of every parameter are computed together, once per change of the gradients."""

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer)  # the optimizer owns this; no cycle through it
        self._index = {id(p): k for k, (_, p) in enumerate(optimizer.trainable)}
        self._names = [n for n, _ in optimizer.trainable]
        self._runs: Optional[list] = None  # per parameter: (master tensor, start, end) in its flat view
        self._table: Optional[tuple] = None  # (norm type, per-parameter norms), until the gradients change

    @property
    def optimizer(self):
        opt = self._optimizer()
        if opt is None:
            raise RuntimeError("the optimizer that holds these gradients is gone")
        return opt

    def invalidate(self) -> None:
        """The gradients changed (a step, a clearing, a clip): the norms are computed again."""
        self._table = None

    def _runs_by_param(self) -> list:
        if self._runs is None:
            runs: list = [[] for _ in self._names]
            at = {n: k for k, n in enumerate(self._names)}
            for shard in self.optimizer.stepper.all_shards():
                for pi, si, a, b in piece_runs(shard.storage):
                    runs[at[shard.storage.names[si]]].append((shard.master_tensors[pi], a, b))
            self._runs = runs
        return self._runs

    def _grad_runs(self, param: nn.Parameter) -> list[torch.Tensor]:
        return self._grad_runs_at(self._index[id(param)])

    def _ready(self, what: str) -> None:
        opt = self.optimizer
        if opt.tensor_parallel is not None:
            raise RuntimeError(f"rank {opt.comm.rank}: {what} on p.grad is not supported with tensor parallelism "
                               f"(each rank holds a slice of a split parameter's gradient): use "
                               f"optimizer.clip_grad_norm_(max_norm), which counts every slice once")
        opt.prepare_grads()

    def norms(self, params: list[nn.Parameter], norm_type: float) -> list[torch.Tensor]:
        """Each parameter's norm of its whole reduced gradient, as DDP's `p.grad` would give."""
        if self._table is None or self._table[0] != norm_type:
            self._ready("a norm")
            self._table = (norm_type, self._all_norms(norm_type))
        table = self._table[1]
        return [table[self._index[id(p)]].to(p.device) for p in params]

    def _all_norms(self, norm_type: float) -> torch.Tensor:
        """One float per parameter from this rank's pieces, pooled over the shard axis in one
        all-reduce (|g|^p summed; the max for the inf-norm): exact whatever the shard boundaries."""
        opt = self.optimizer
        inf = math.isinf(norm_type)
        # Each norm stays where its master is (no host sync per parameter); one stack moves them.
        device = next((m.device for m in opt.stepper.masters()), opt.comm.device)
        local = []
        for k in range(len(self._names)):
            parts = [g.double() for g in self._grad_runs_at(k)]
            if not parts:
                local.append(torch.zeros((), dtype=torch.float64, device=device))
            elif inf:
                local.append(torch.stack([g.abs().amax() for g in parts]).amax().to(device))
            else:
                local.append(sum((g.pow(2) if norm_type == 2 else g.abs().pow(norm_type)).sum()
                                 for g in parts).to(device))
        values = torch.stack(local).to(opt.comm.device)
        if not (opt.config.stage == 0 or opt.comm.shard_size == 1):
            opt.comm.all_reduce(values, "control", op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, axis="shard",
                                label="per-parameter gradient norms")
        return (values if inf else values ** (1.0 / norm_type)).float()

    def _grad_runs_at(self, k: int) -> list[torch.Tensor]:
        return [m.grad.view(-1)[a:b] for m, a, b in self._runs_by_param()[k] if m.grad is not None]

    def scale(self, params: list[nn.Parameter], factor) -> None:
        self._ready("scaling")
        for p in params:
            for g in self._grad_runs(p):
                g.mul_(factor.to(g.device) if torch.is_tensor(factor) else factor)
        self.invalidate()

    def clamp(self, params: list[nn.Parameter], low, high) -> None:
        self._ready("clamping")
        for p in params:
            for g in self._grad_runs(p):
                g.clamp_(min=_on(low, g), max=_on(high, g))
        self.invalidate()

    def refusal(self, what: str, param: nn.Parameter) -> str:
        opt = self.optimizer
        name = self._names[self._index[id(param)]] if id(param) in self._index else "a parameter"
        if opt.config.stage >= 1 and opt.comm.shard_size > 1:
            why = (f"at stage {opt.config.stage} over {opt.comm.shard_size} ranks its reduced gradient is sharded, "
                   f"and no rank holds it whole")
        elif opt.tensor_parallel is not None:
            why = "under tensor parallelism this rank holds a slice of a split parameter's gradient"
        else:
            why = "under fp16 the rank's gradient buffer holds it times the loss scale, not DDP's value"
        return (f"rank {opt.comm.rank}: `{what}` on p.grad of {name}: {why}, so p.grad "
                f"has no values to read. torch.nn.utils.clip_grad_norm_, clip_grad_value_ and get_total_norm over "
                f"the model's parameters (and p.grad.norm(), p.grad.mul_) work as under DDP; for the global norm use "
                f"optimizer.clip_grad_norm_(max_norm), which returns it (docs/contract.md)")


def _on(bound, like: torch.Tensor):
    return bound.to(like.device) if torch.is_tensor(bound) else bound
