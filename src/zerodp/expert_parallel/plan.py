"""Which modules of a model hold expert banks, and splitting them by expert in place.

An expert-parallel plan maps name patterns (``*`` stands for one name component, e.g. a
layer index) to a style, as transformers 5 writes them in an MoE config's
`base_model_ep_plan`:

- ``ep_dispatch_experts``: a module that holds a bank of experts and is called as
  ``experts(hidden_states, top_k_index, top_k_weights)`` (transformers' `MixtralExperts`,
  `Qwen3MoeExperts`, ...), with a `num_experts` attribute. Its forward is wrapped so that
  each token goes to the rank of its expert and back (dispatch.py);
- ``grouped_gemm``: a parameter of such a module whose dim 0 is the expert (a fused bank,
  ``[num_experts, ...]``): split into `ep_size` equal runs of whole experts.

[Note: expert split]
Expert-parallel rank e of a group of k holds experts [e E/k, (e+1) E/k) of every bank, in
order, and its module's `num_experts` becomes E/k: the module's own forward runs unchanged
on local expert ids. A bank is cut like a tensor-parallel split of dim 0 into k parts
(`TensorSplit(0, 1, k)`), so the checkpoint's map between a rank's slice and the bank's
global coordinates is that one ([Note: tensor-parallel split] in tensor_parallel/split.py).

A Hugging Face model without a plan of its own uses its config's `base_model_ep_plan`
under the base model's prefix; any model can carry `expert_parallel_plan` (a class or
instance attribute of the same form), and `apply_expert_parallel` takes one too.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ..config import ConfigError
from ..distributed import Comm
from ..tensor_parallel.plan import under_base_model
from ..tensor_parallel.split import TensorSplit
from .dispatch import ExpertDispatch

__all__ = ["ExpertParallelModel", "apply_expert_parallel", "ep_plan_of"]

MODULE_STYLE, PARAM_STYLE = "ep_dispatch_experts", "grouped_gemm"
STYLES = (MODULE_STYLE, PARAM_STYLE)

# Models already split: splitting again would cut the slices.
_SPLIT: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@dataclass(frozen=True)
class ExpertParallelModel:
    """What `apply_expert_parallel` did: each split bank's cut by parameter name ([Note:
    expert split]), the experts modules by name, and the expert-data-parallel comm whose
    shard axis ZeRO shards the banks over ([Note: expert-parallel axes] in
    distributed/topology.py)."""

    splits: dict  # parameter name -> TensorSplit(0, 1, ep_size)
    modules: dict  # module name -> the experts module (its forward dispatches)
    expert_comm: Comm
    ep_size: int

    @property
    def param_ids(self) -> frozenset:
        return frozenset(id(p) for m in self.modules.values() for p in m.parameters())


def ep_plan_of(model: nn.Module, plan: Optional[dict] = None) -> dict[str, str]:
    """The model's expert-parallel plan: `plan`, else its own `expert_parallel_plan`, else a
    Hugging Face config's `base_model_ep_plan` under the base model's prefix. Raises
    ConfigError naming the fix when there is none or a style is unknown."""
    if plan is None:
        plan = getattr(model, "expert_parallel_plan", None)
        if plan is None:
            base = getattr(getattr(model, "config", None), "base_model_ep_plan", None)
            if not base:
                raise ConfigError(f"Config.expert_parallel_size > 1, but {type(model).__name__} has no "
                                  f"expert-parallel plan: give it an `expert_parallel_plan` (name pattern -> one of "
                                  f"{STYLES}) or use a model whose config has `base_model_ep_plan`")
            plan = under_base_model(model, base)
    plan = dict(plan)
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"expert-parallel plan: {pattern!r} -> {style!r} is not a style zerodp splits: use "
                              f"one of {STYLES}")
    return plan


def _matches(name: str, pattern: str) -> bool:
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(w in ("*", p) for p, w in zip(parts, want))


def _choose(model: nn.Module, plan: dict, ep_size: int) -> tuple[dict, dict]:
    """The experts modules and the banks the plan names, checked before anything changes."""
    module_patterns = [p for p, s in plan.items() if s == MODULE_STYLE]
    param_patterns = [p for p, s in plan.items() if s == PARAM_STYLE]
    modules = {n: m for n, m in model.named_modules() if any(_matches(n, p) for p in module_patterns)}
    params = {n: p for n, p in model.named_parameters() if any(_matches(n, pat) for pat in param_patterns)}
    if not modules:
        raise ConfigError(f"the expert-parallel plan of {type(model).__name__} matches no module for "
                          f"{module_patterns or sorted(plan)}: check the module names")
    for name, module in modules.items():
        where = f"expert-parallel plan: {name} ({type(module).__name__})"
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or isinstance(experts, bool):
            raise ConfigError(f"{where} has no integer `num_experts`: an {MODULE_STYLE} module holds a bank of "
                              f"experts, called as experts(hidden_states, top_k_index, top_k_weights)")
        if experts % ep_size:
            raise ConfigError(f"{where}: its {experts} experts do not split into Config.expert_parallel_size="
                              f"{ep_size} equal groups: use a divisor of {experts}")
        own = dict(module.named_parameters(prefix=name))
        unsplit = [n for n in own if n not in params]
        if unsplit:
            raise ConfigError(f"{where}: its parameters {unsplit[:3]} are not {PARAM_STYLE} in the plan; every "
                              f"parameter of an experts module must be a bank split by expert (dim 0)")
        for n, p in own.items():
            if p.dim() == 0 or p.shape[0] != experts:
                raise ConfigError(f"{where}: {n} of shape {tuple(p.shape)} is not a bank of its {experts} experts "
                                  f"(dim 0 must be the expert)")
        if any(isinstance(m, nn.Module) and m is not module and any(True for _ in m.parameters())
               for m in module.modules()):
            raise ConfigError(f"{where} has submodules with parameters: zerodp splits fused banks "
                              f"([num_experts, ...] parameters of the module itself)")
    inside = {n for name, m in modules.items() for n in dict(m.named_parameters(prefix=name))}
    stray = [n for n in params if n not in inside]
    if stray:
        raise ConfigError(f"expert-parallel plan: {stray[:3]} are {PARAM_STYLE} but lie in no "
                          f"{MODULE_STYLE} module: the plan must name the module that dispatches to them")
    return modules, params


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, comm: Comm, expert_comm: Comm,
                          plan: Optional[dict] = None) -> ExpertParallelModel:
    """Split `model`'s expert banks in place over the ``ep`` axis of `comm`'s topology and
    wrap each experts module's forward with the token dispatch. Every rank first takes data
    rank 0's banks (the replication DDP does at construction), then keeps its own experts.
    The parameters stay the same `nn.Parameter` objects."""
    if model in _SPLIT:
        raise ConfigError(f"this {type(model).__name__} was already split for expert parallelism: build a new model")
    k, rank = comm.topology.ep_size, comm.topology.ep_rank
    modules, params = _choose(model, ep_plan_of(model, plan), k)
    split = TensorSplit(0, 1, k)
    for p in params.values():
        comm.broadcast(p.data, 0, "init", label="expert-parallel start")
        p.data = split.cut(p.data, rank).contiguous().clone()
    for name, module in modules.items():
        total = module.num_experts
        module.num_experts = total // k
        module.forward = ExpertDispatch(module.forward, comm, total, name)
    _SPLIT.add(model)
    return ExpertParallelModel({n: split for n in params}, modules, expert_comm, k)
