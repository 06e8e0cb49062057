"""What a checkpoint's COMPLETE, metadata.json and rank{r}.json may hold, checked before any
value is used.

[Note: a checkpoint is input]
A checkpoint directory may have been copied, edited or planted by someone else, so every
name and value read from it is checked against what `save` writes before it is used:
file names against the format's own pattern (no name can point outside the directory),
numbers for type, range and finiteness, shapes for non-negative integers whose pieces cover
them exactly once within the bytes the files really hold, hyperparameters against the
type of the optimizer's own value, RNG states by setting them on scratch generators. A
failure is an InvalidCheckpoint naming the file, the field and the value; nothing was
changed (see [Note: validate, then write] in sharded.py).
"""
from __future__ import annotations

import math
import random
import re

import torch

from ..config import DTYPES
from .format import COMPLETE, METADATA, REPLICATED, InvalidCheckpoint, dtype_name, is_format_name, rank_file
from .rng import from_b64

__all__ = ["check_hyperparameters", "check_listing", "check_metadata", "check_rng", "check_tp_record", "saved_states"]

SHA256 = re.compile(r"[0-9a-f]{64}")
COMPUTE_DTYPES = {dtype_name(d) for d in DTYPES.values()}
MASTER_BYTES = 4  # the fp32 master of every element is in the rank files


def _show(value) -> str:
    try:
        text = repr(value)
    except RecursionError:  # JSON nested nearly as deep as the decoder allows
        return "a value nested too deeply to show"
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(path: str, file: str, field: str, value, what: str) -> InvalidCheckpoint:
    return InvalidCheckpoint(f"checkpoint {path}: {file} has {field} = {_show(value)}, {what}; zerodp did not "
                             f"write this (the file was changed or comes from elsewhere): use another checkpoint")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_int(path: str, file: str, field: str, v, lo: int = 0, hi: int | None = None) -> int:
    if not _is_int(v) or v < lo or (hi is not None and v >= hi):
        limit = f"at least {lo}" if hi is None else f"in [{lo}, {hi})"
        raise _bad(path, file, field, v, f"not an integer {limit}")
    return v


def check_listing(path: str, marker) -> dict:
    """COMPLETE's {name: {size, sha256}}: only names the format writes, sizes and digests well formed."""
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict):
        raise InvalidCheckpoint(f"checkpoint {path}: {COMPLETE} has no list of files; use another checkpoint")
    for name, d in files.items():
        if not is_format_name(name):
            raise InvalidCheckpoint(f"checkpoint {path}: {COMPLETE} lists {name!r}, which is not a file a zerodp "
                                    f"checkpoint has ({METADATA}, {REPLICATED}, rank<r>.safetensors, rank<r>.json); "
                                    f"it was changed after the save: use another checkpoint")
        if not (isinstance(d, dict) and _is_int(d.get("size")) and d["size"] >= 0
                and isinstance(d.get("sha256"), str) and SHA256.fullmatch(d["sha256"])):
            raise _bad(path, COMPLETE, f"the entry of {name}", d, "not a size and a sha256")
    if METADATA not in files:
        raise InvalidCheckpoint(f"checkpoint {path}: {METADATA} is not listed in {COMPLETE}; use another checkpoint")
    return files


def _check_shape(path: str, field: str, shape) -> int:
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise _bad(path, METADATA, field, shape, "not a list of non-negative integers")
    return math.prod(shape)


def _check_dtype(path: str, field: str, name) -> None:
    if not isinstance(name, str) or not isinstance(getattr(torch, name, None), torch.dtype):
        raise _bad(path, METADATA, field, name, "not a torch dtype")


def _check_pieces(path: str, name: str, info: dict, meta: dict, files: dict, held: dict,
                  section: str = "params", element_bytes: int = MASTER_BYTES) -> None:
    """The pieces of one parameter cover [0, numel) exactly once (of each tensor-parallel
    rank's slice, for a split parameter: [Note: tensor-parallel pieces] in tp_pieces.py),
    from rank files that exist and hold at least their bytes: a forged shape cannot make a
    reader allocate more than the checkpoint's files hold."""
    field = f"{section}[{name!r}]"
    numel = _check_shape(path, f"{field}.shape", info.get("shape"))
    pieces = info.get("pieces")
    if not isinstance(pieces, list):
        raise _bad(path, METADATA, f"{field}.pieces", pieces, "not a list")
    size = _check_split(path, field, info)
    tp_size = meta.get("tensor_parallel_size", 1)
    if "split" in info and info["split"].get("axis") == "ep":  # an expert bank: [Note: tensor-parallel pieces]
        tp_size = meta.get("expert_parallel_size", 1)
        if size != tp_size:
            raise _bad(path, METADATA, f"{field}.split", info["split"],
                       f"not a split into the checkpoint's expert_parallel_size {tp_size}")
    elif "split" in info and size != tp_size:
        raise _bad(path, METADATA, f"{field}.split", info["split"],
                   f"not a split into the checkpoint's tensor_parallel_size {tp_size}")
    slice_numel = numel // size
    tp_rank, end = 0, 0
    for piece in pieces:
        width = 3 if size == 1 and "split" not in info else 4
        if isinstance(piece, list) and len(piece) == 4 and width == 4 and _is_int(piece[3]) \
                and piece[3] == tp_rank + 1 and end == slice_numel:
            tp_rank, end = tp_rank + 1, 0  # the next tensor-parallel rank's slice starts
        if not (isinstance(piece, list) and len(piece) == width and all(_is_int(v) for v in piece)
                and 0 <= piece[0] < meta["world_size"] and piece[1] == end and piece[2] > 0
                and (width == 3 or piece[3] == tp_rank)):
            shown = "" if width == 3 else f", tensor-parallel rank {tp_rank}"
            raise _bad(path, METADATA, f"{field}.pieces", piece,
                       f"not [rank < world_size {meta['world_size']}, start {end}, numel > 0{shown}]")
        rank, n = piece[0], piece[2]
        if rank % tp_size != (piece[3] if width == 4 else 0):  # [Note: tensor-parallel pieces]
            wanted = f"tensor-parallel rank {piece[3]}'s slice" if width == 4 else "an unsplit parameter"
            raise _bad(path, METADATA, f"{field}.pieces", piece,
                       f"a piece of {wanted} in {rank_file(rank)}, which holds tensor-parallel rank "
                       f"{rank % tp_size}'s pieces (rank {rank} of {tp_size} tensor-parallel ranks)")
        if rank_file(rank) not in files:
            raise _bad(path, METADATA, f"{field}.pieces", piece, f"its {rank_file(rank)} is not listed in {COMPLETE}")
        held[rank] = held.get(rank, 0) + n * element_bytes
        end += n
    if numel and (end != slice_numel or tp_rank != size - 1):
        raise _bad(path, METADATA, f"{field}.pieces", pieces, f"they do not cover the {numel} elements of its shape "
                   f"({size} tensor-parallel slices of {slice_numel})")


def _check_split(path: str, field: str, info: dict) -> int:
    """A split parameter's description: integers that cut its shape evenly. Returns its
    tensor-parallel size (1 without a split)."""
    split = info.get("split")
    if split is None:
        return 1
    shape = info["shape"]
    if not (isinstance(split, dict) and set(split) - {"axis"} == {"dim", "parts", "size"}
            and split.get("axis", "tp") in ("tp", "ep")
            and all(_is_int(v) and v >= 1 for k, v in split.items() if k not in ("dim", "axis"))
            and _is_int(split["dim"]) and 0 <= split["dim"] < len(shape)
            and shape[split["dim"]] % (split["parts"] * split["size"]) == 0):
        raise _bad(path, METADATA, f"{field}.split", split, f"not a tensor-parallel split of shape {shape}")
    return split["size"]


def saved_states(meta: dict, name: str) -> list:
    """The optimizer state names saved for trainable parameter `name`: its own where they
    differ from the checkpoint's (Muon beside AdamW, SGD without momentum in one group),
    else every one of `state_keys`."""
    return meta["params"][name].get("states", meta["state_keys"])


def _check_params(path: str, meta: dict, files: dict) -> None:
    params = meta.get("params")
    if not isinstance(params, dict):
        raise _bad(path, METADATA, "params", params, "not a mapping")
    tp_size = meta.setdefault("tensor_parallel_size", 1)  # recorded only under tensor parallelism
    if not _is_int(tp_size) or tp_size < 1 or meta["world_size"] % tp_size:
        raise _bad(path, METADATA, "tensor_parallel_size", tp_size,
                   f"not an integer >= 1 dividing world_size {meta['world_size']}")
    ep_size = meta.get("expert_parallel_size", 1)  # recorded only under expert parallelism
    if not _is_int(ep_size) or ep_size < 1 or meta["world_size"] % ep_size:
        raise _bad(path, METADATA, "expert_parallel_size", ep_size,
                   f"not an integer >= 1 dividing world_size {meta['world_size']}")
    held: dict = {}
    for name, info in params.items():
        if not isinstance(info, dict):
            raise _bad(path, METADATA, f"params[{name!r}]", info, "not a mapping")
        _check_int(path, METADATA, f"params[{name!r}].group", info.get("group"), 0, len(meta["param_groups"]))
        states = info.get("states", meta["state_keys"])
        if not (isinstance(states, list) and len(set(states)) == len(states)
                and all(isinstance(k, str) and k in meta["state_keys"] for k in states)):
            raise _bad(path, METADATA, f"params[{name!r}].states", states,
                       f"not a list of distinct names from state_keys {meta['state_keys']}")
        _check_dtype(path, f"params[{name!r}].dtype", info.get("dtype"))
        _check_pieces(path, name, info, meta, files, held)
    frozen = meta.setdefault("frozen", {})  # checkpoints written before frozen parameters were sharded lack it
    if not isinstance(frozen, dict):
        raise _bad(path, METADATA, "frozen", frozen, "not a mapping")
    for name, info in frozen.items():
        if not isinstance(info, dict) or name in params:
            raise _bad(path, METADATA, f"frozen[{name!r}]", info, "not a mapping for a name params does not have")
        _check_dtype(path, f"frozen[{name!r}].dtype", info.get("dtype"))
        _check_pieces(path, name, info, meta, files, held, "frozen", getattr(torch, info["dtype"]).itemsize)
    for rank, nbytes in held.items():
        if nbytes > files[rank_file(rank)]["size"]:
            raise _bad(path, METADATA, f"the pieces of rank {rank}", f"{nbytes} bytes",
                       f"more than its {rank_file(rank)} holds ({files[rank_file(rank)]['size']} bytes)")


def _check_replicated(path: str, meta: dict, files: dict) -> None:
    replicated = meta.get("replicated")
    if not isinstance(replicated, dict):
        raise _bad(path, METADATA, "replicated", replicated, "not a mapping")
    if replicated and REPLICATED not in files:
        raise _bad(path, METADATA, "replicated", list(replicated)[:3], f"but {REPLICATED} is not listed in {COMPLETE}")
    nbytes = 0
    for name, info in replicated.items():
        field = f"replicated[{name!r}]"
        if not isinstance(info, dict):
            raise _bad(path, METADATA, field, info, "not a mapping")
        _check_dtype(path, f"{field}.dtype", info.get("dtype"))
        nbytes += _check_shape(path, f"{field}.shape", info.get("shape")) * getattr(torch, info["dtype"]).itemsize
        if nbytes > files[REPLICATED]["size"]:
            raise _bad(path, METADATA, f"{field}.shape", info["shape"],
                       f"more than {REPLICATED} holds ({files[REPLICATED]['size']} bytes)")


def _check_keys(path: str, meta: dict) -> None:
    keys = meta.get("state_dict_keys")
    if not isinstance(keys, list):
        raise _bad(path, METADATA, "state_dict_keys", keys, "not a list")
    seen = set()
    for entry in keys:
        ok = isinstance(entry, list) and len(entry) == 3 and all(isinstance(v, str) for v in entry)
        sections = {"param": meta["params"], "frozen": meta["frozen"], "replicated": meta["replicated"]}
        source = sections.get(entry[1], {}) if ok else {}
        if not ok or entry[2] not in source or entry[0] in seen:
            raise _bad(path, METADATA, "state_dict_keys", entry,
                       "not [a new state_dict key, 'param', 'frozen' or 'replicated', a name the checkpoint holds]")
        seen.add(entry[0])


def _check_optimizer_fields(path: str, meta: dict) -> None:
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise _bad(path, METADATA, "param_groups", groups, "not a list of mappings")
    scalars = meta.get("scalar_states")
    if not isinstance(scalars, list) or len(scalars) != len(groups) or not all(isinstance(s, dict) for s in scalars):
        raise _bad(path, METADATA, "scalar_states", scalars, f"not a list of {len(groups)} mappings")
    for gi, values in enumerate(scalars):
        for k, v in values.items():
            if not _is_number(v):
                raise _bad(path, METADATA, f"scalar_states[{gi}][{k!r}]", v, "not a finite number")
    keys = meta.get("state_keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) and k and "/" not in k for k in keys):
        raise _bad(path, METADATA, "state_keys", keys, "not a list of state names")
    scaler = meta.get("loss_scaler")
    if not (isinstance(scaler, dict) and _is_number(scaler.get("scale")) and scaler["scale"] > 0
            and _is_int(scaler.get("clean_steps")) and scaler["clean_steps"] >= 0
            and _is_int(scaler.get("skipped_steps")) and scaler["skipped_steps"] >= 0):
        raise _bad(path, METADATA, "loss_scaler", scaler,
                   "not {scale: a finite number > 0, clean_steps and skipped_steps: integers >= 0}")


def check_metadata(path: str, meta, files: dict) -> None:
    """Every field `load` and `consolidate` use, checked once, before either uses one."""
    if not isinstance(meta, dict):
        raise _bad(path, METADATA, "its top level", meta, "not a mapping")
    _check_int(path, METADATA, "world_size", meta.get("world_size"), 1)
    _check_int(path, METADATA, "stage", meta.get("stage"), 0, 4)
    _check_int(path, METADATA, "step", meta.get("step"), 0)
    if meta.get("compute_dtype") not in COMPUTE_DTYPES:
        raise _bad(path, METADATA, "compute_dtype", meta.get("compute_dtype"), f"not one of {sorted(COMPUTE_DTYPES)}")
    if meta.get("master_dtype") != "float32":
        raise _bad(path, METADATA, "master_dtype", meta.get("master_dtype"), "not 'float32'")
    config = meta.get("config")
    if not isinstance(config, dict) or config.get("mixed_precision") not in DTYPES:
        raise _bad(path, METADATA, "config.mixed_precision", config.get("mixed_precision")
                   if isinstance(config, dict) else config, f"not one of {sorted(DTYPES)}")
    for field in ("model", "optimizer"):
        if not isinstance(meta.get(field), str):
            raise _bad(path, METADATA, field, meta.get(field), "not a name")
    if not isinstance(meta.get("extra"), dict):
        raise _bad(path, METADATA, "extra", meta.get("extra"), "not a mapping")
    _check_optimizer_fields(path, meta)
    _check_params(path, meta, files)
    _check_replicated(path, meta, files)
    _check_keys(path, meta)


# -- against the live optimizer --------------------------------------------------------------
def _kind(v) -> str:
    if v is None or isinstance(v, bool):
        return "flag"  # torch keeps foreach/fused/capturable as None or a bool
    if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1):
        return "number"
    if isinstance(v, str):
        return "text"
    if isinstance(v, (list, tuple)):
        return "sequence"
    return type(v).__name__


def _fits(saved, live) -> bool:
    """Whether `restore_hyperparameters` may put `saved` where the optimizer holds `live`:
    the same kind (a tensor lr takes a number), numbers finite, sequences element by element.
    A live None (a default left to the optimizer) takes any scalar."""
    if live is None and saved is not None and not isinstance(saved, (list, dict)):
        return _kind(saved) != "number" or _is_number(saved)
    if _kind(saved) != _kind(live):
        return False
    if _kind(live) == "number":
        return _is_number(saved)
    if _kind(live) == "sequence":
        return isinstance(saved, list) and len(saved) == len(live) and all(map(_fits, saved, live))
    return True


def check_hyperparameters(path: str, saved: list, groups: list) -> None:
    """Each saved hyperparameter `load` would restore fits the optimizer's own value's type."""
    for gi, (values, group) in enumerate(zip(saved, groups)):
        for k, v in values.items():
            if k != "params" and k in group and not _fits(v, group[k]):
                raise _bad(path, METADATA, f"param_groups[{gi}][{k!r}]", v,
                           f"which does not fit the optimizer's {_show(group[k])} (a {type(group[k]).__name__})")


def check_rng(path: str, name: str, obj) -> dict:
    """A rank's RNG states, each set on a scratch generator first: one that would not set
    fails here, before anything changed, instead of after the weights were written."""
    state = obj.get("rng") if isinstance(obj, dict) else None
    try:
        if not isinstance(state, dict):
            raise ValueError("no 'rng' mapping")
        torch.Generator().set_state(from_b64(state["torch"]))
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        for s in state.get("cuda", []):
            from_b64(s)
        if "numpy" in state:
            _check_numpy(state["numpy"])
    except Exception as e:  # noqa: BLE001 - any malformed part is the same finding
        raise InvalidCheckpoint(f"checkpoint {path}: {name} holds no valid RNG state ({type(e).__name__}: "
                                f"{_show(str(e))}); zerodp did not write this: use another checkpoint") from e
    return state


def check_tp_record(path: str, name: str, obj) -> dict | None:
    """What a rank's rank{r}.json records of its pieces under tensor parallelism
    ([Note: tensor-parallel pieces] in tp_pieces.py), or None where it records nothing."""
    record = obj.get("tensor_parallel") if isinstance(obj, dict) else None
    if record is None:
        return None
    if not (isinstance(record, dict) and _is_int(record.get("rank")) and _is_int(record.get("size"))
            and 0 <= record["rank"] < record["size"] and isinstance(record.get("splits"), dict)):
        raise InvalidCheckpoint(f"checkpoint {path}: {name} has tensor_parallel = {_show(record)}, not "
                                f"{{rank, size, splits}}; zerodp did not write this: use another checkpoint")
    return record


def _check_numpy(state) -> None:
    try:
        import numpy as np
    except ImportError:
        return
    kind, keys, pos, has_gauss, cached = state
    np.random.RandomState().set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
