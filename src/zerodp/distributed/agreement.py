"""Every rank must build the same model, optimizer and Config: checked once, at initialize.

Ranks that differ (another stage or bucket size, one extra layer, another learning rate or
fp16 loss scale, another tensor-parallel plan) would otherwise pair mismatched collectives:
gloo aborts one rank while the other waits, or, worse, both run and silently train different
models. One small collective of descriptions, compared with rank 0's, turns that into an
error on every rank that names what differs and what each rank had.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from .comm import Comm
from ..config import Config


def describe(model: nn.Module, inner: torch.optim.Optimizer, config: Config) -> dict[str, Any]:
    """What every rank must agree on, as plain, comparable data."""
    described = {
        "Config": config.to_dict(),
        "parameters (name, shape, dtype, requires_grad)": [
            (n, tuple(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad) for n, p in model.named_parameters()],
        "buffers (name, shape, dtype)": [
            (n, tuple(b.shape), str(b.dtype).replace("torch.", "")) for n, b in model.named_buffers()],
        "optimizer": type(inner).__name__,
        "optimizer param groups (size and hyperparameters)": [
            (len(g["params"]), {k: _comparable(v) for k, v in sorted(g.items()) if k != "params"})
            for g in inner.param_groups],
    }
    return described


def _comparable(value: Any) -> Any:
    """A hyperparameter as data equal across ranks exactly when the values are: a tensor by
    its values (its repr rounds, and names the device), a callable by its qualified name
    (its repr holds an address that differs per process)."""
    if torch.is_tensor(value):
        return ("tensor", str(value.dtype), tuple(value.shape), value.detach().cpu().tolist())
    if isinstance(value, (list, tuple)):
        return type(value)(_comparable(v) for v in value)
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return repr(value)


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _first_difference(mine: Any, theirs: Any, at: str = "") -> str:
    """Where two descriptions first differ, e.g. "item 0[1]['lr']: '0.1' vs '0.2'"."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for k in sorted(set(mine) | set(theirs), key=str):
            if mine.get(k) != theirs.get(k):
                return _first_difference(mine.get(k), theirs.get(k), f"{at}[{k!r}]")
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                return _first_difference(a, b, f"{at}[{i}]")
        if len(mine) != len(theirs):
            return f"{at or 'length'}: {len(mine)} vs {len(theirs)} items"
    return f"{at}: {_short(mine)} vs {_short(theirs)}" if at else f"{_short(mine)} vs {_short(theirs)}"


def check_ranks_agree(comm: Comm, described: Optional[dict[str, Any]], problem: Optional[BaseException]) -> None:
    """Raise on every rank if a rank failed before this point (`problem`: re-raised on that
    rank, named on the others) or if any rank's description differs from rank 0's."""
    mine = {"problem": None if problem is None else f"{type(problem).__name__}: {problem}", "described": described}
    everyone = comm.all_gather_object(mine, label="zerodp.initialize agreement")
    _raise_first_failure(comm, problem, [d["problem"] for d in everyone], "zerodp.initialize")
    differs = first_disagreement([d["described"] for d in everyone])
    if differs:
        raise ValueError(f"rank {comm.rank}: ranks disagree on the {differs}. Every rank must build the "
                         f"same model, optimizer and Config before zerodp.initialize")


def raise_if_any_failed(comm: Comm, problem: Optional[BaseException], what: str, phase: str = "control") -> None:
    """After a check each rank ran alone (`problem`: its error, or None): raise on every
    rank if any failed, before a collective that the failed ones would never join."""
    mine = None if problem is None else f"{type(problem).__name__}: {problem}"
    _raise_first_failure(comm, problem, comm.all_gather_object(mine, phase, label=what), what)


def _raise_first_failure(comm: Comm, problem: Optional[BaseException], problems: list, what: str) -> None:
    failed = [(r, p) for r, p in enumerate(problems) if p is not None]
    if problem is not None:
        raise problem
    if failed:
        raise RuntimeError(f"rank {comm.rank}: {what} failed on rank {failed[0][0]}"
                           f"{f' (and {len(failed) - 1} more)' if len(failed) > 1 else ''}: {failed[0][1]}")


def first_disagreement(everyone: list[dict[str, Any]]) -> Optional[str]:
    """The first key on which some rank's description differs from rank 0's, with what
    each had ("Config (rank 0 vs rank 1: ['stage']: '2' vs '3')"), or None."""
    for key in everyone[0]:
        values = [d.get(key) for d in everyone]
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            detail = "; ".join(f"rank 0 vs rank {r}: {_first_difference(values[0], values[r])}" for r in differ[:3])
            return f"{key} ({detail})"
    return None


def describe_trained(model: nn.Module, optimizer) -> dict[str, Any]:
    """What every rank must agree on once initialized (checked again at load): stage-3
    parameters are 1-D shards of rank-dependent sizes by then, so trainable parameters are
    compared by name, and only what stays replicated by shape; frozen stage-3 parameters
    (sharded too) by name and dtype."""
    trainable = {id(p) for _, p in optimizer.trainable}
    sharded = ({t.untyped_storage().data_ptr() for t in optimizer.frozen_tensors()}
               if optimizer.stage3 is not None else set())
    items = [(n, t) for n, t in model.state_dict(keep_vars=True).items() if id(t) not in trainable]
    return {
        "Config": optimizer.config.to_dict(),
        "trainable parameters": [n for n, _ in optimizer.trainable],
        "replicated tensors (name, shape, dtype)": [
            (n, tuple(t.shape) if t.untyped_storage().data_ptr() not in sharded else "sharded",
             str(t.dtype).replace("torch.", "")) for n, t in items],
        "optimizer": type(optimizer.inner).__name__,
    }
