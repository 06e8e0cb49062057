"""The model's weights, whole, one tensor at a time: what an RL trainer pushes to its
generation engine after each step (vLLM's `load_weights`, SGLang's, a plain model's
`load_state_dict`), at any stage.

[Note: weight stream]
`iter_full_params` yields `(name, tensor)` under the names of the model's own state dict
(Hugging Face's names, which `from_pretrained` and vLLM's `load_weights` take), every
tensor whole. At stage 3 each unit is gathered in turn (one all-gather of the exact stored
values per part) into a buffer of its own, not the pool's, and its tensors are yielded as
views of it, each under every one of its names (tied weights: one tensor, both names); the
unit's smallest tensor comes last, as a copy, so that once the consumer moves past the
unit's other tensors nothing holds the buffer and it is freed before the next unit is
gathered. So the stream adds one unit plus its smallest tensor to what the rank holds (a
merged LoRA weight, a conversion to another dtype or device, or a tensor-parallel join adds
that one tensor, and its temporaries, beside them), as long as the consumer keeps no
yielded tensor past the next one, as weight loaders do; `full_state_dict`, which returns
every tensor at once, adds the whole model. A yielded tensor is never overwritten, but may
share its unit's buffer: keeping one keeps that buffer (clone what you keep). At stages
0-2 the parameters are whole and each is copied out, one at a time.

A PEFT model streams its merged weights under the base model's names, as
`merge_and_unload().state_dict()` names them: each LoRA layer's delta (peft's own
`get_delta_weight`, B·A·scaling) is added to its base weight while their unit is gathered,
so the base is never gathered whole and the training model is not changed. The adapters
themselves and a `modules_to_save` original are not streamed. Under tensor parallelism
each split parameter is all-gathered over its tensor-parallel group and joined into the
original ([Note: tensor-parallel split]) before it is yielded; under expert parallelism each
expert bank over its expert-parallel group, as `full_state_dict` gathers them.

Collective: every rank iterates the stream to its end, in step (a rank that stops early
leaves the others waiting in a gather). With `rank=r` only process r yields tensors; the
others run the same collectives and yield nothing.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from ..sharding.rows import gather_split
from .format import plain_module
from .tp_pieces import ExpertSplit, ranks_of, splits_of

__all__ = ["iter_full_params", "merged_name", "refuse_unmergeable"]


def merged_name(key: str, adapter: str) -> Optional[str]:
    """A PEFT base model's state-dict key as merge_and_unload names it; None for what the
    merge drops (the adapters themselves, the original of a modules_to_save copy)."""
    parts = key.split(".")
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None
    out, i = [], 0
    while i < len(parts):
        if parts[i] == "base_layer":
            i += 1
        elif parts[i] == "modules_to_save" and i + 1 < len(parts) and parts[i + 1] == adapter:
            i += 2
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out)


def refuse_unmergeable(peft_model: nn.Module, base: nn.Module, adapter: str, lora_layer: type) -> None:
    """What this merge does not compute (it adds B·A·scaling to a Linear's weight): refused
    by name rather than written wrong."""
    config = getattr(peft_model, "peft_config", {}).get(adapter)
    if config is None:
        raise ValueError(f"the model has no adapter {adapter!r} (it has {sorted(peft_model.peft_config)})")
    kind = str(getattr(config, "peft_type", "")).split(".")[-1]
    why = (f"its peft_type is {kind}, not LORA" if kind != "LORA"
           else "it uses DoRA (use_dora=True), whose merge rescales each weight" if getattr(config, "use_dora", False)
           else "it trains LoRA biases (lora_bias=True)" if getattr(config, "lora_bias", False)
           else None)
    embedded = [n for n, m in base.named_modules() if isinstance(m, lora_layer) and adapter in getattr(
        m, "lora_embedding_A", {})]
    if why is None and embedded:
        why = f"it puts LoRA on embeddings ({embedded[:3]})"
    if why is not None:
        raise ValueError(f"zerodp's unit-by-unit merge does not support adapter {adapter!r}: {why}. Save the "
                         f"adapters (model.save_pretrained) and merge them in one process with peft's "
                         f"merge_and_unload, or use plain LoRA on linear layers")


class _Plan:
    """What the stream yields and how: names by tensor, the LoRA layer of each merged base
    weight, the tensor-parallel split of each split parameter."""

    def __init__(self, model: nn.Module, optimizer, adapter: str, buffers: bool):
        self.merging = hasattr(model, "get_base_model") and hasattr(model, "peft_config")
        source = model.get_base_model() if self.merging else model
        self.lora: dict = {}
        if self.merging:
            from peft.tuners.lora import LoraLayer

            if splits_of(optimizer):  # its units hold each rank's slices of the base and the adapters
                raise NotImplementedError(
                    "merging LoRA adapters under tensor or expert parallelism is not built: stream them from the "
                    "one-process state dict instead (zerodp.consolidate of a checkpoint loaded into a plain PEFT "
                    "model, then merge_and_unload)")
            refuse_unmergeable(model, source, adapter, LoraLayer)
            self.lora = {id(m.base_layer.weight): m for m in source.modules()
                         if isinstance(m, LoraLayer) and adapter in m.lora_A and hasattr(m.base_layer, "weight")}
        self.params = {id(p) for p in source.parameters()}
        self.names: dict[int, list[str]] = {}  # id(tensor) -> its names, in state-dict order
        self.tensors: dict[int, torch.Tensor] = {}
        for key, t in source.state_dict(keep_vars=True).items():
            name = merged_name(key, adapter) if self.merging else key
            if name is None or (id(t) not in self.params and not buffers):
                continue
            self.names.setdefault(id(t), []).append(name)
            self.tensors[id(t)] = t
        splits = splits_of(optimizer)
        self.splits = {id(p): splits[n] for n, p in model.named_parameters() if n in splits}
        self.adapter = adapter
        units = optimizer.stage3.units if optimizer.stage3 is not None else []
        self.unit_ids = [{id(p) for p in u.all_params()} for u in units]
        for ids in self.unit_ids:  # a merge needs the adapters gathered with their base weight
            for wid, layer in self.lora.items():
                pair = (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)
                if wid in ids and any(id(p) not in ids for p in pair):
                    raise ValueError(f"{self.names.get(wid, ['?'])[0]}: its LoRA adapters lie in another stage-3 "
                                     f"unit; set Config.unit_modules so that a LoRA layer and its base stay in one "
                                     f"unit")

    def value(self, i: int, whole: dict, comm, keep: bool) -> tuple[Optional[torch.Tensor], bool]:
        """The whole value of tensor `i` (a view of its unit's gathered buffer in `whole` at
        stage 3) and whether it is a tensor of its own; (None, _) on a rank that keeps
        nothing, after its part in any collective."""
        t = self.tensors[i]
        value, fresh = whole.get(i, t.detach()), False
        layer = self.lora.get(i)
        if layer is not None and keep:
            pair = [layer.lora_A[self.adapter].weight, layer.lora_B[self.adapter].weight]
            with _viewing(pair, [whole.get(id(p), p.data) for p in pair]):  # peft's own delta, B·A·scaling
                merged = layer.get_delta_weight(self.adapter).to(value.dtype)
            value, fresh = merged.add_(value), True  # value + delta, bit for bit (addition commutes)
        split = self.splits.get(i)
        if split is not None:  # every rank of the tensor- (expert-) parallel group takes part
            axis = "ep" if isinstance(split, ExpertSplit) else "tp"  # an expert bank: its rows by expert
            value, fresh = gather_split(comm, value, split, label="weight stream", axis=axis), True
        return (value if keep else None), fresh


@contextlib.contextmanager
def _viewing(params: list, values: list):
    """The parameters read `values` (their gathered views) within the block, their own
    storage again after it."""
    saved = [p.data for p in params]
    for p, v in zip(params, values):
        p.data = v
    try:
        yield
    finally:
        for p, d in zip(params, saved):
            p.data = d


def iter_full_params(model: nn.Module, optimizer, *, rank: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                     device=None, buffers: bool = False,
                     adapter: str = "default") -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` for every parameter of the model, whole, under the model's own
    state-dict names (a PEFT model: the base's names, LoRA adapter `adapter` merged), one
    stage-3 unit gathered at a time ([Note: weight stream]); with `buffers`, the buffers
    too, after the parameters. Each tensor is in `dtype` on `device` when
    given (else the model's compute dtype, where the parameter lives), never overwritten,
    possibly a view of its unit's gathered buffer (clone what you keep). Collective: every
    rank iterates it to the end; with `rank`, only that process yields (the others yield
    nothing)."""
    model = plain_module(model)
    ranks = ranks_of(optimizer)
    if rank is not None and not 0 <= rank < ranks.world_size:
        raise ValueError(f"rank={rank}: there are {ranks.world_size} processes (0..{ranks.world_size - 1})")
    plan = _Plan(model, optimizer, adapter, buffers)
    return _stream(plan, optimizer, rank is None or ranks.rank == rank, dtype, device)


def _gather_part(part) -> list[torch.Tensor]:
    """A stage-3 unit's part (its trainable parameters, or a frozen part) whole, in a buffer
    of its own rather than the pool's (what is yielded from it is never overwritten): each
    parameter a view of it. One all-gather of the exact stored values."""
    source = part.gather_source()
    full = torch.empty(part.layout.padded_numel, dtype=source.dtype, device=source.device)
    part.collectives.all_gather(full, source, "checkpoint", label=f"{part.label} (weight stream)")
    part.release_staged()
    return part.layout.views(full)


@torch.no_grad()  # a generator: torch enters no_grad around each step, not across its yields
def _stream(plan: _Plan, optimizer, keep: bool, dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
    optimizer.settle()  # a delayed update in flight reaches the parameters first
    units = optimizer.stage3.units if optimizer.stage3 is not None else []

    def emit(ids: list[int], whole: dict, last_copied: bool):
        for k, i in enumerate(ids):
            value, fresh = plan.value(i, whole, optimizer.comm, keep)
            if value is None:
                continue
            # The unit's last tensor does not hold its buffer while the next unit is gathered.
            copy = not fresh and (not whole or (last_copied and k == len(ids) - 1))
            out = value.to(device=device or value.device, dtype=dtype or value.dtype, copy=copy)
            value = None
            for name in plan.names[i]:
                yield name, out
            out = None  # dropped before the next tensor is made

    done: set = set()
    for unit, unit_ids in zip(units, plan.unit_ids):
        mine = [i for i in plan.tensors if i in unit_ids]
        if not mine:
            continue  # every rank skips it: the names are the same on every rank
        whole = {id(p): v for part in unit.parts() for p, v in zip(part.params, _gather_part(part))}
        smallest = min(mine, key=lambda i: whole[i].numel())  # last, copied: [Note: weight stream]
        mine = [i for i in mine if i != smallest] + [smallest]
        yield from emit(mine, whole, last_copied=True)
        whole = None
        done.update(mine)
    rest = [i for i in plan.tensors if i not in done]
    yield from emit([i for i in rest if i in plan.params], {}, False)  # replicated parameters; stages 0-2: all
    yield from emit([i for i in rest if i not in plan.params], {}, False)  # buffers, whole at every stage
