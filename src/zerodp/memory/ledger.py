"""The ledger of bytes each rank holds, by category, measured from the storages it holds.

Categories follow the paper's model states (arXiv 1910.02054, §3.1): compute-dtype
parameters, gradients, fp32 master weights and the optimizer's per-element states
(Adam's exp_avg and exp_avg_sq), plus zerodp's pooled communication buffers and, under
ZeRO++'s hpZ, the secondary parameter pieces kept from forward to backward.

[Note: measured ledger]
Nothing here is computed from a formula. Each storage kind (flat group, stage-3 unit,
buffer pool) names the tensors it holds in each category; a `Census` counts each distinct
storage once (views of one buffer count once, at its full size) under the first category
that claims it. Then every tensor reachable from the optimizer's objects is walked
(`walk_tensors`), and any storage no category claimed is reported under `other`, by the
attribute that holds it, instead of being hidden. Tests compare the categories with the
paper's formula and the total with a census of every live tensor in the process.
"""
from __future__ import annotations

import collections
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

import torch
import torch.nn as nn

CATEGORIES = ("params", "grads", "master", "optimizer_states", "comm_buffers", "secondary_params",
              "activation_checkpoints", "frozen_params")


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds, by category, counted from the storages it holds."""

    params: int
    grads: int
    master: int
    optimizer_states: int
    comm_buffers: int
    secondary_params: int  # hpZ: the pool of node-sharded copies (its high-water mark: none is freed)
    numel: int  # Ψ: trainable elements, unpadded
    padded_numel: int  # Ψ with the flat buffers' padding
    world_size: int  # N of the formula: the ranks states are sharded over (the shard axis)
    stage: int
    gathered_params_peak: int = 0  # stage 3: largest bytes of full unit parameters held at once
    other: int = 0  # storages held outside every category (e.g. optimizer scalar states)
    host_offloaded: int = 0  # of the above, held in host memory by Config.offload_optimizer="host"
    disk_offloaded: int = 0  # of the above, held in files under Config.offload_dir ("disk")
    other_by_owner: tuple = ()  # (holder, bytes) of each part of `other`
    # Checkpointed layers' saved inputs held now, between a forward and its backward, by
    # zerodp's checkpoint store (Pa, Pa+cpu: [Note: partitioned activation checkpoints]);
    # of them, in host memory (Pa+cpu); and the most held at once since the store's last reset.
    activation_checkpoints: int = 0
    activation_checkpoints_on_host: int = 0
    activation_checkpoints_peak: int = 0
    # Frozen parameters (requires_grad=False): replicated at stages 0-2, sharded at stage 3
    # ([Note: frozen parameters] in sharding/frozen.py); no gradient, master or state.
    frozen_params: int = 0
    # [Note: whole-parameter alignment] in layout.py: of padded_numel - numel, the elements
    # added so that parameters stepped whole lie in one rank's chunk; and per rank of the shard
    # axis, the parameter elements (padding not counted) whose master and states it holds.
    alignment_padding: int = 0
    owned_numel: tuple = ()
    # Under tensor parallelism: the largest logits the LM head has produced on this rank with
    # gradients enabled (evaluation's are not counted), in bytes (whole vocabulary when
    # gathered; this rank's slice under `keep_logits_split`).
    # Autograd holds them, not the engine, so they are a peak beside the categories, not in `total`.
    logits_peak: int = 0
    # Expert parallelism ([Note: expert-parallel axes] in distributed/topology.py): of the
    # categories above, the bytes of the expert banks' storages (this rank's E/k experts,
    # sharded over the expert_world_size = N/k ranks that hold them), and their elements.
    expert_params: int = 0
    expert_grads: int = 0
    expert_master: int = 0
    expert_optimizer_states: int = 0
    expert_numel: int = 0
    expert_world_size: int = 0

    @property
    def owned_imbalance(self) -> float:
        """Largest rank's owned parameter elements over the mean (1.0: balanced)."""
        if not self.owned_numel or not sum(self.owned_numel):
            return 1.0
        return max(self.owned_numel) * len(self.owned_numel) / sum(self.owned_numel)

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states + self.frozen_params

    @property
    def total(self) -> int:
        """Every byte the engine and optimizer hold."""
        return (self.model_state + self.comm_buffers + self.secondary_params + self.activation_checkpoints
                + self.other)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["other_by_owner"] = dict(self.other_by_owner)
        return {**out, "model_state": self.model_state, "total": self.total, "owned_imbalance": self.owned_imbalance}


def storage_key(t: torch.Tensor):
    st = t.untyped_storage()
    return (st.data_ptr(), t.device), st.nbytes()


class Census:
    """Distinct storages, each under the first category (or holder) that claimed it."""

    def __init__(self) -> None:
        self.owner: dict = {}
        self.nbytes: dict = {}

    def claim(self, category: str, tensors: Iterable) -> None:
        for t in tensors:
            if t is None or t.is_meta:
                continue
            key, nbytes = storage_key(t)
            if nbytes and key not in self.owner:
                self.owner[key], self.nbytes[key] = category, nbytes

    def by_owner(self) -> dict:
        out: dict = collections.Counter()
        for key, owner in self.owner.items():
            out[owner] += self.nbytes[key]
        return dict(out)


def walk_tensors(root) -> Iterator[tuple[str, torch.Tensor]]:
    """(holder, tensor) for every tensor reachable from `root` through zerodp objects,
    torch optimizers and containers; a parameter's `.grad` too. Modules are not entered:
    the storages reach every parameter they hold."""
    stack, seen = [("", root)], set()
    while stack:
        holder, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            yield holder, obj
            if isinstance(obj, nn.Parameter) and obj.grad is not None:
                stack.append((holder + ".grad", obj.grad))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                stack.append((holder, k))
                stack.append((holder, v))
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend((holder, v) for v in obj)
        elif isinstance(obj, nn.Module):
            continue
        elif type(obj).__module__.startswith("zerodp") and hasattr(obj, "__dict__"):
            # zerodp's own objects first: the ZeroOptimizer is also a torch Optimizer, and
            # everything it holds (reducer, engine, units, pools) must be walked.
            for name, v in vars(obj).items():
                stack.append((f"{type(obj).__name__}.{name}", v))
        elif isinstance(obj, torch.optim.Optimizer):
            stack.append((f"{type(obj).__name__}.state", obj.state))
            stack.append((f"{type(obj).__name__}.param_groups", obj.param_groups))


def live_tensor_storages(hold: list | None = None) -> dict:
    """Every storage behind a live Python tensor in this process, found by the garbage
    collector (independent of what zerodp thinks it holds): key -> nbytes. With `hold`,
    the storages are also appended to it, so that none is freed (and its address reused)
    while the caller compares this census with a later one."""
    import gc

    out, tensor = {}, torch.Tensor
    for obj in gc.get_objects():
        try:
            if isinstance(obj, tensor) and not obj.is_meta:  # isinstance inline: millions of objects
                key, nbytes = storage_key(obj)
                if nbytes:
                    out[key] = nbytes
                    if hold is not None:
                        hold.append(obj.untyped_storage())
        except (RuntimeError, ReferenceError):  # tensors without storage (e.g. sparse, functional wrappers)
            continue
    return out


def is_elementwise_state(value, param: torch.Tensor) -> bool:
    """A per-element optimizer state (shaped like its parameter, e.g. Adam's exp_avg), as
    opposed to a 0-dim scalar such as Adam's step counter."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == param.shape


def scalar_state(key: str, value, param: torch.Tensor, name: str = ""):
    """A state that is not per-element, as the plain number checkpoints keep; a tensor that is
    neither (Adafactor's factored row and column moments, one per row or column of a whole
    parameter) is refused, naming it: a checkpoint has no place for it yet."""
    if not torch.is_tensor(value):
        return value
    if value.numel() != 1:
        raise ValueError(f"optimizer state {key!r}{' of ' + name if name else ''} has shape {tuple(value.shape)} "
                         f"for a parameter of shape {tuple(param.shape)}: neither per-element nor a scalar, so "
                         f"zerodp's checkpoints and state dicts cannot hold it (Adafactor's factored moments); "
                         f"train without saving the optimizer, or use an optimizer whose states are per element")
    return float(value)


def formula_bytes(stage: int, numel: int, world_size: int, param_bytes: int, grad_bytes: int,
                  master_bytes: int, state_bytes: int) -> dict:
    """What each category should hold for Ψ=`numel` (already padded) at `stage` on N ranks:
    the paper's Table 1 row split by category (DESIGN.md's stage table). `master_bytes` is 0
    when the fp32 parameters are their own master copy."""
    n = world_size
    shard = numel // n
    return {
        "params": numel * param_bytes if stage < 3 else shard * param_bytes,
        "grads": numel * grad_bytes if stage < 2 else shard * grad_bytes,
        "master": (numel if stage == 0 else shard) * master_bytes,
        "optimizer_states": (numel if stage == 0 else shard) * state_bytes,
    }
