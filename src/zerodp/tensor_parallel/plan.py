"""Which modules of a model are split for tensor parallelism, and splitting them in place.

A plan maps module-name patterns (``*`` stands for one name component, e.g. a layer index)
to a style:

- ``colwise``: a Linear's output features (and bias) are split; its input enters the
  tensor-parallel region (`copy_to_tp`, shared by the layers fed the same tensor:
  [Note: tensor-parallel layers]);
- ``colwise_packed2`` / ``colwise_packed3``: the same for a Linear whose output packs 2 or 3
  equal projections (GPT-2's fused q, k, v): each is split on its own, so every rank keeps
  whole heads of each;
- ``rowwise``: a Linear's input features are split; its outputs are summed over the ranks;
  the bias is replicated;
- ``embedding``: an Embedding's vocabulary rows are split;
- ``lm_head``: a column-parallel Linear over the vocabulary that all-gathers its output.

The bundled GPT carries its plan (`GPT.tensor_parallel_plan`); any model can, as a class
attribute of that name. A Hugging Face model without one uses its config's own
`base_model_tp_plan` (transformers' names: colwise, rowwise, colwise_gather_output,
embedding, packed_colwise), under the base model's prefix, plus its input embedding and LM
head. The parameters stay the same `nn.Parameter` objects (their data becomes this rank's
slice), so an optimizer already built on them and the model's state-dict names stay valid.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..config import ConfigError
from ..distributed import Comm
from .layers import ColumnParallelLinear, RegionEntry, RowParallelLinear, VocabParallelEmbedding
from .rng import SplitRegionRNG
from .split import TensorSplit

__all__ = ["plan_of", "apply_tensor_parallel", "under_base_model"]

STYLES = ("colwise", "colwise_packed2", "colwise_packed3", "rowwise", "embedding", "lm_head")
# transformers' style names -> ours; any other is refused, naming it.
HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather_output": "lm_head",
             "embedding": "embedding", "packed_colwise": "colwise_packed2"}

# Models already split: splitting again would cut the slices.
_SPLIT: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def under_base_model(model: nn.Module, plan: dict) -> dict:
    """A Hugging Face config's plan for the base model ({name pattern: style}) under the
    model's names: prefixed with its `base_model_prefix` where the model wraps a base model
    (LlamaForCausalLM's "model."), as transformers applies its own plans."""
    prefix = getattr(model, "base_model_prefix", "")
    has_base = bool(prefix) and hasattr(model, prefix)
    return {f"{prefix}.{pattern}" if has_base else pattern: style for pattern, style in plan.items()}


def plan_of(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan: its own `tensor_parallel_plan`, else a Hugging Face
    model's `base_model_tp_plan` with its embedding and LM head. Raises ConfigError naming the
    fix when the model has neither."""
    own = getattr(model, "tensor_parallel_plan", None)
    if own is not None:
        return dict(own)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        raise ConfigError(f"Config.tensor_parallel_size > 1, but {type(model).__name__} has no tensor-parallel plan: "
                          f"give its class a `tensor_parallel_plan` (module name pattern -> one of {STYLES}), as "
                          f"zerodp.demo.models.GPT does")
    for pattern, style in base.items():
        if style not in HF_STYLES:
            raise ConfigError(f"{type(model).__name__}'s base_model_tp_plan asks {pattern!r} to be {style!r}, which "
                              f"zerodp does not split: give the model a `tensor_parallel_plan` with one of {STYLES}")
    plan = {pattern: HF_STYLES[style] for pattern, style in under_base_model(model, base).items()}
    names = {id(m): n for n, m in model.named_modules()}
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embedding, nn.Embedding):
        plan[names[id(embedding)]] = "embedding"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        plan[names[id(head)]] = "lm_head"
    return plan


def _matches(name: str, pattern: str) -> bool:
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(w in ("*", p) for p, w in zip(parts, want))


class _Splitter:
    """Cuts each parameter once (a tied one, met twice, must be cut the same way). `plan`
    checks a cut and records it; `apply` makes every recorded cut, so that a plan that fails
    part-way leaves the model untouched."""

    def __init__(self, comm: Comm):
        self.size, self.rank = comm.topology.tp_size, comm.topology.tp_rank
        self.cut: dict[int, tuple] = {}
        self.params: list[nn.Parameter] = []

    def plan(self, p: nn.Parameter, dim: int, parts: int, where: str) -> None:
        how = (dim, parts)
        if id(p) in self.cut:
            if self.cut[id(p)] != how:
                raise ConfigError(f"{where}: its parameter is tied to one split another way: give the tied modules "
                                  f"styles that split it alike (embedding and lm_head both split rows)")
            return
        n = p.shape[dim]
        if n % (parts * self.size):
            raise ConfigError(f"{where}: dim {dim} of its {tuple(p.shape)} parameter does not split into {parts} x "
                              f"{self.size} equal slices: use a tensor_parallel_size that divides "
                              f"{n // parts} (or pad the model's dimension)")
        self.cut[id(p)] = how
        self.params.append(p)

    def apply(self) -> None:
        with torch.no_grad():
            for p in self.params:
                p.data = self.split_of(p).cut(p.data, self.rank).contiguous().clone()

    def split_of(self, p: nn.Parameter) -> TensorSplit:
        dim, parts = self.cut[id(p)]
        return TensorSplit(dim, parts, self.size)


def apply_tensor_parallel(model: nn.Module, comm: Comm, plan: dict[str, str] | None = None) -> dict[str, TensorSplit]:
    """Split `model` in place over the ``tp`` axis of `comm`'s topology; returns how each
    parameter now split was cut, by name (the others are replicated over the tensor-parallel
    ranks)."""
    if model in _SPLIT:
        raise ConfigError(f"this {type(model).__name__} was already split for tensor parallelism: build a new model")
    own = getattr(model, "tensor_parallel_plan", None) is not None or plan is not None
    plan = plan_of(model) if plan is None else plan
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"tensor-parallel plan: {pattern!r} -> {style!r} is not a style: use one of {STYLES}")
    _check_heads(model, comm.topology.tp_size)
    modules = dict(model.named_modules())
    splitter = _Splitter(comm)
    chosen = []  # (name, module, style), checked before anything changes
    for name, module in modules.items():
        style = next((s for pat, s in plan.items() if _matches(name, pat)), None)
        if style is not None:
            _plan_split(module, style, name, splitter)
            chosen.append((name, module, style))
    unmatched = [pat for pat in plan if not any(_matches(name, pat) for name, _, _ in chosen)]
    if not chosen or (own and unmatched):
        raise ConfigError(f"the tensor-parallel plan of {type(model).__name__} matches no module for "
                          f"{unmatched or sorted(plan)}: check the module names")
    rng = SplitRegionRNG(comm.device, comm.topology.tp_rank)
    splitter.apply()
    region = RegionEntry(comm)
    for name, module, style in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, attr, _parallel_module(module, style, comm, region, rng))
    # No region is open where the root module's forward begins or ends: one left open (an
    # exception in it, a recomputation without preserve_rng_state that stopped early) must not
    # leave the replicated region drawing this rank's numbers: [Note: tensor-parallel random streams].
    model.register_forward_pre_hook(lambda module, args: rng.close())
    model.register_forward_hook(lambda module, args, output: rng.close(), always_call=True)
    _SPLIT.add(model)
    return {n: splitter.split_of(p) for n, p in model.named_parameters() if id(p) in splitter.cut}


def _check_heads(model: nn.Module, tp: int) -> None:
    """Column-parallel attention keeps whole heads on each rank: the model's head counts (its
    config's, as GPTConfig and Hugging Face configs name them) must divide by tp."""
    config = getattr(model, "config", None)
    for name in ("n_head", "num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(f"Config.tensor_parallel_size={tp}: the model's {name}={heads} does not split into "
                              f"{tp} equal groups of whole heads: use a tensor_parallel_size that divides {heads}")


def _plan_split(module: nn.Module, style: str, name: str, splitter: _Splitter) -> None:
    """Check that `module` can be split as `style` and record its parameters' cuts. Only the
    plain torch layers: a subclass with a forward of its own (Gemma's scaled embedding) would
    lose what that forward does."""
    where = f"tensor-parallel plan: {name} ({style})"
    base = nn.Embedding if style == "embedding" else nn.Linear
    if not isinstance(module, base) or type(module).forward is not base.forward:
        raise ConfigError(f"{where} is a {type(module).__name__}, not a plain nn.{base.__name__} (a forward of its "
                          f"own would be lost): leave it out of the plan, or give the model a plan without it")
    if style == "embedding":
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ConfigError(f"{where}: max_norm, scale_grad_by_freq and sparse are not split: leave it out of "
                              f"the plan")
        splitter.plan(module.weight, 0, 1, where)
    elif style == "rowwise":
        splitter.plan(module.weight, 1, 1, where)
    else:
        parts = {"colwise_packed2": 2, "colwise_packed3": 3}.get(style, 1)
        splitter.plan(module.weight, 0, parts, where)
        if module.bias is not None:
            splitter.plan(module.bias, 0, parts, where)


def _parallel_module(module: nn.Module, style: str, comm: Comm, region: RegionEntry,
                     rng: SplitRegionRNG) -> nn.Module:
    """The tensor-parallel layer that takes over `module`'s (already cut) parameters."""
    if style == "embedding":
        return VocabParallelEmbedding(module.weight, comm, module.padding_idx)
    if style == "rowwise":
        return RowParallelLinear(module.weight, module.bias, comm, rng)
    return ColumnParallelLinear(module.weight, module.bias, region, gather_output=style == "lm_head", rng=rng)
