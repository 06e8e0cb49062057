"""A plain model out, a plain model in: consolidate a sharded checkpoint into one full
state dict (and export it as one safetensors file), and fill a sharded model from a full
state dict, each rank reading only the elements it owns. See [Note: checkpoint layout]
in format.py.
"""
from __future__ import annotations

import contextlib
import math
import os
import uuid
from collections.abc import Mapping

import torch
from safetensors import safe_open
from torch import nn

from .files import write_safetensors
from .format import (
    REPLICATED,
    TMP_TAG,
    CheckpointError,
    ModelView,
    PathLike,
    describe_error,
    dtype_name,
    frozen_runs,
    model_view,
    plain_module,
    raise_if_failed,
    write_replicated,
)
from .reader import Reader, flat_range, name_mismatch, open_checkpoint
from .tp_pieces import local_runs, ranks_of, split_rank, splits_of

__all__ = ["consolidate", "export", "load_pretrained"]


def _resolve_dtype(dtype, meta: dict) -> torch.dtype | None:
    if dtype == "compute":
        return getattr(torch, meta["compute_dtype"])
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"dtype={dtype!r}: use a torch dtype, 'compute' (the dtype training ran in) or None")


def consolidate(path: PathLike, dtype: torch.dtype | str | None = torch.float32) -> dict:
    """The full state_dict of the model a checkpoint was saved from, with the model's own
    names (tied weights under every name, buffers and frozen parameters included), so
    `model.load_state_dict(sd, strict=True)` works on the plain, unwrapped model.

    Runs in one process, no process group needed. dtype=torch.float32 (default) gives the
    fp32 master weights and upcasts floating buffers; "compute" gives the weights the
    model trained with (bf16/fp16 under mixed precision); None keeps the saved dtypes
    (fp32 master weights, buffers as they were).

    A checkpoint whose files or values are not what zerodp writes raises InvalidCheckpoint
    (a ValueError) before anything is allocated by its sizes ([Note: a checkpoint is input]
    in schema.py)."""
    path, meta, files = open_checkpoint(path)
    dtype = _resolve_dtype(dtype, meta)
    use_param = dtype is not None and dtype_name(dtype) == meta["compute_dtype"] != "float32"
    params, out = {}, {}
    with Reader(path, files) as reader:
        for name, info in meta["params"].items():
            numel = math.prod(info["shape"])
            kind, read_dtype = ("param", dtype) if use_param else ("master", torch.float32)
            whole = [(0, 0, numel)] if numel else []  # by original coordinates: [Note: tensor-parallel pieces]
            t = reader.read_runs(kind, name, info, whole, numel, read_dtype).view(info["shape"])
            params[name] = t if dtype is None else t.to(dtype)
        replicated = {}
        for k, info in meta["replicated"].items():
            reader.tensor_slice(REPLICATED, k, info["shape"])  # the file's shape is metadata.json's
            t = reader.file(REPLICATED).get_tensor(k)
            replicated[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        for k, info in meta["frozen"].items():  # frozen parameters saved as runs (stage 3, or split)
            numel = math.prod(info["shape"])
            t = reader.read_runs("frozen", k, info, [(0, 0, numel)] if numel else [], numel,
                                 getattr(torch, info["dtype"])).view(info["shape"])
            replicated[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    for key, kind, src in meta["state_dict_keys"]:
        out[key] = params[src] if kind == "param" else replicated[src]
    return out


def export(path: PathLike, out_file: PathLike, dtype: torch.dtype | str | None = torch.float32) -> str:
    """Write `consolidate(path, dtype)` to one safetensors file (tied weights stored under
    each name, so `safetensors.torch.load_file` + `load_state_dict(strict=True)` works)."""
    sd = consolidate(path, dtype)
    seen, tensors = set(), {}
    for k, t in sd.items():
        tensors[k] = t.clone() if id(t) in seen else t.contiguous()
        seen.add(id(t))
    out_file = os.path.abspath(os.fspath(out_file))
    os.makedirs(os.path.dirname(out_file), exist_ok=True)
    side = f"{out_file}{TMP_TAG}{uuid.uuid4().hex[:12]}"
    try:
        write_safetensors(side, tensors)
        os.replace(side, out_file)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(side)
    return out_file


# -- load_pretrained ----------------------------------------------------------------------
def load_pretrained(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | PathLike,
                    optimizer, *, strict: bool = True) -> None:
    """Fill a model already passed through `zerodp.initialize` from a full state_dict (a
    mapping, or a .safetensors file such as `export` writes), each rank reading only the
    elements it owns. A tied weight may appear under any of its names. Optimizer states
    are left as they are (start from a fresh optimizer). With strict=True, keys the model
    does not have are an error. Raises before changing anything, on every rank."""
    model = plain_module(model)  # a torch.compile'd model saves and loads as the module it wraps
    comm = ranks_of(optimizer)
    splits = splits_of(optimizer)
    masters, replicated, frozen, view = [], {}, [], None
    try:
        view = model_view(model, optimizer)
        with _FullSource(state_dict) as source:
            where = _pretrained_keys(view, source.shapes, optimizer.owned_slices(), strict, source.label, splits)
            def read(s) -> torch.Tensor:  # the slice's elements, from the original's coordinates
                key = where[s.name]
                runs = local_runs(source.shapes[key], splits.get(s.name), split_rank(optimizer, s.name), s.start,
                                  s.numel)
                return torch.cat([source.flat_range(key, g, n) for g, _, n in runs])
            masters = [(s, read(s).to(torch.float32)) for s in optimizer.owned_slices() if s.numel]
            replicated = {k: source.tensor(k) for k in view.replicated}
            # Frozen parameters sharded at stage 3: each rank reads the rows of its runs only.
            frozen = [(s, read(s)) for s in frozen_runs(model, optimizer) if s.numel]
        local = {"ok": True}
    except Exception as e:  # noqa: BLE001 - reported through the exchange, so no rank waits forever
        local = {"ok": False, "error": describe_error(e)}
    raise_if_failed(comm.all_gather_object(local, "checkpoint"), "load_pretrained")
    with torch.no_grad():
        for s, value in masters:
            s.write(s.master, value)
        write_replicated(replicated, view.replicated)
        for s, value in frozen:
            s.write(value)
    optimizer.sync_params_from_master("checkpoint")


class _FullSource:
    """A full state_dict given as a mapping or as a safetensors file, read by element range."""

    def __init__(self, source: Mapping[str, torch.Tensor] | PathLike):
        self._file = None
        if isinstance(source, Mapping):
            self.label, self._dict = "state_dict", source
            self.shapes = {k: list(v.shape) for k, v in source.items()}
            return
        self.label = os.fspath(source)
        if not os.path.isfile(self.label):
            raise CheckpointError(f"pretrained weights {self.label} do not exist (expected a .safetensors file)")
        try:
            self._file = safe_open(self.label, framework="pt", device="cpu")
        except Exception as e:
            raise CheckpointError(f"pretrained weights {self.label} are not a safetensors file ({e})") from e
        self.shapes = {k: self._file.get_slice(k).get_shape() for k in self._file.keys()}  # noqa: SIM118

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._file is not None:
            self._file.__exit__(*exc)

    def flat_range(self, key: str, start: int, numel: int) -> torch.Tensor:
        if self._file is not None:
            return flat_range(self._file, key, self.shapes[key], start, numel)
        return self._dict[key].detach().reshape(-1)[start: start + numel].clone()

    def tensor(self, key: str) -> torch.Tensor:
        if self._file is not None:
            return self._file.get_tensor(key)
        return self._dict[key].detach().clone()


def _pretrained_keys(view: ModelView, shapes: dict, slices: list, strict: bool, label: str, splits: dict) -> dict:
    """For each trainable parameter, the key of `shapes` that holds it (any of its tied
    names); raises listing missing, unexpected and mis-shaped names."""
    where, expected, found = {}, {}, {}
    # Full shapes (see `_read_for_rank`), a split parameter's the original's.
    slice_shapes = {s.name: list(s.shape) if s.name not in splits else splits[s.name].global_shape(s.shape)
                    for s in slices}
    slice_shapes.update(view.frozen)
    for name, keys in [*view.aliases().items(), *view.aliases("frozen").items()]:
        key = next((k for k in keys if k in shapes), keys[0])
        where[name] = key
        expected[key] = slice_shapes.get(name, shapes.get(key))
        if key in shapes:
            found[key] = shapes[key]
    for k, t in view.replicated.items():
        expected[k] = list(t.shape)
        if k in shapes:
            found[k] = shapes[k]
    known = {key for key, _, _ in view.keys}
    if strict:
        found.update({k: v for k, v in shapes.items() if k not in known})
    problem = name_mismatch(label, "pretrained", expected, found)
    if problem:
        raise CheckpointError(problem)
    return where
