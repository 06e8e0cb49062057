"""The values a Config field may take, and how a refusal reads: the base every Config check
and every translation into a Config (a file, a DeepSpeed config) builds on, with no Config of
its own, so that those translations need not import the Config they produce."""
from __future__ import annotations

import json
import math
import reprlib
from typing import Any, Optional

import torch

__all__ = ["ConfigError", "DTYPES", "MAX_FILE_DEPTH", "MAX_TIMEOUT_S", "OFFLOAD_PLACES", "QUANTIZED_BITS",
           "bad_value", "check_flags", "check_positive_finite", "check_positive_int", "check_sequence_parallel",
           "is_number", "is_one_of", "refuse_unless", "parse_config_text", "shown", "torchrun_ranks_per_node", "too_deep"]

# Names accepted for a dtype, and the torch dtype each one means.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


# Where Config.offload_optimizer may put the master and optimizer states.
OFFLOAD_PLACES = ("none", "host", "disk")

# The longest Config.collective_timeout_s: a year. Anything longer means "never", and past
# ~292 years the timeout overflows the 64-bit nanosecond clocks torch converts it to
# (gloo then refuses it as negative).
MAX_TIMEOUT_S = 365 * 24 * 3600

# Bits of each quantized format of `Config.quantize_grads`.
QUANTIZED_BITS = {"int8": 8, "int4": 4}


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names the field, value and fix."""


# A Config file is one mapping of fields to plain values: a list of class names is the
# deepest (unit_modules). Deeper is refused by name before it can exhaust Python's stack.
MAX_FILE_DEPTH = 32

# Containers are shown a few items and levels deep: a YAML alias lets a small file hold a
# value that is huge, or contains itself, whose full repr would not end.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 2, 4, 4, 4, 4


def shown(value: Any, limit: int = 160) -> str:
    """`value` as an error message shows it: its repr, at most `limit` characters."""
    try:
        text = _REPR.repr(value) if isinstance(value, (list, tuple, dict, set)) else repr(value)
    except ValueError:  # an int past Python's 4,300-digit limit on conversion to text
        text = f"<{type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[:limit] + "..."


def bad_value(name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"Config.{name}={shown(value)} is not allowed: {allowed}")


def is_one_of(value: Any, allowed) -> bool:
    """`value in allowed` for the text-valued fields; a list or mapping (unhashable) is not
    one of them rather than a TypeError."""
    return isinstance(value, str) and value in allowed


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_positive_finite(name: str, value: Any, fix: str, at_most: float = math.inf) -> None:
    """A real number in (0, at_most]: nan, inf and negatives are refused here, by name,
    rather than failing far from the Config (an OverflowError in a timedelta) or silently."""
    if not is_number(value) or not math.isfinite(value) or not 0 < value <= at_most:
        raise bad_value(name, value, fix)


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad_value(name, value, "use a positive integer")


def check_flags(config: Any, names) -> None:
    """Each field of `names` on `config` is true or false."""
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise bad_value(name, getattr(config, name), "use true or false")


def refuse_unless(config: Any, allowed: list) -> None:
    """Raise, naming the first field of `allowed` ((name, value, reason) each) whose value on
    `config` is another: what a feature does not compose with yet."""
    for name, value, reason in allowed:
        if getattr(config, name) != value:
            raise bad_value(name, getattr(config, name), reason)


def check_sequence_parallel(config: Any) -> None:
    """Config.sequence_parallel_size, tiled_loss and tiled_mlp, and what does not run beside them
    yet, each with its reason (docs/long_context.md, "Not built")."""
    check_positive_int("sequence_parallel_size", config.sequence_parallel_size)
    compiled = ("compile_units", False, "the tiles' checkpoints run inside the forward a compiled unit would trace")
    if config.tiled_loss is True:
        tiled = (("tensor_parallel_size", 1, "the tensor-parallel head splits the vocabulary and computes its own loss"),
                 compiled)
        refuse_unless(config, [(n, v, f"{why}: use {n}={v!r} with tiled_loss") for n, v, why in tiled])
    if config.tiled_mlp is True:
        tiled = (("tensor_parallel_size", 1, "the tensor-parallel MLP all-reduces its output inside its forward, "
                                             "which tiles would run once per tile, and again when recomputed"),
                 ("expert_parallel_size", 1, "the expert-parallel MLP exchanges its tokens with the other ranks "
                                             "inside its forward, and tiles would split one exchange into many"),
                 compiled)
        refuse_unless(config, [(n, v, f"{why}: use {n}={v!r} with tiled_mlp") for n, v, why in tiled])
    if config.sequence_parallel_size == 1:
        return
    sp = f"sequence_parallel_size={config.sequence_parallel_size}"
    refused = [
        ("tensor_parallel_size", 1, f"tensor and sequence parallelism over the same ranks are not built: use "
                                    f"tensor_parallel_size=1 with {sp}"),
        ("expert_parallel_size", 1, f"expert and sequence parallelism over the same ranks are not built: use "
                                    f"expert_parallel_size=1 with {sp}"),
        ("compile_units", False, f"the attention's all-to-alls run inside the forward a compiled unit would trace: "
                                 f"use compile_units=False with {sp}"),
    ]
    refuse_unless(config, refused)


def parse_config_text(text: str, kind: str, path: str) -> Any:
    """The content of a Config file: JSON or YAML (safe: plain values only)."""
    import yaml

    # YAML's composer and json's decoder recurse once per level of nesting, so a deep file
    # would exhaust Python's stack. A YAML file is measured first; JSON, whose decoder is
    # fast, only once it has failed.
    deep = too_deep(text) if kind == "YAML" else None
    try:
        if deep is None:
            return json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except RecursionError:
        deep = too_deep(text) or ""
    except (ValueError, yaml.YAMLError) as e:  # bad syntax, an int past Python's 4,300 digits
        message = " ".join(str(e).split())
        raise ConfigError(f"Config file {path!r} is not valid {kind}: {message[:300]}: fix the file (one mapping "
                          f"of field names to values)") from None
    where = f"Config.{deep}: its value" if deep else "its content"
    raise ConfigError(f"Config file {path!r}: {where} is nested more than {MAX_FILE_DEPTH} levels deep: a field "
                      f"holds a number, a string, true/false or null, or a list of class names (unit_modules); "
                      f"fix the file")


def too_deep(text: str) -> Optional[str]:
    """The top-level field whose value first nests more than MAX_FILE_DEPTH collections ("" if
    the file is not a mapping), else None. Reads YAML's parse events (JSON is YAML's flow
    style), which keep a stack of their own rather than Python's, and stops there."""
    import yaml

    depth, field, at_key, top_is_mapping = 0, "", True, False
    try:
        for event in yaml.parse(text):
            if depth == 1 and isinstance(event, yaml.NodeEvent):  # a key or a value of the top mapping
                if at_key:
                    field = event.value if isinstance(event, yaml.ScalarEvent) and top_is_mapping else ""
                at_key = not at_key
            if isinstance(event, yaml.CollectionStartEvent):
                top_is_mapping = top_is_mapping or (depth == 0 and isinstance(event, yaml.MappingStartEvent))
                depth += 1
                if depth > MAX_FILE_DEPTH:
                    return field
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError:  # the syntax error is the full parse's to report
        return None
    return None


def torchrun_ranks_per_node(local_world_size: Optional[int], rank: Optional[int], node_rank: Optional[int],
                            needed_by: str) -> int:
    """Ranks on each node, as torchrun says: its LOCAL_WORLD_SIZE, checked against RANK and
    GROUP_RANK (`node_rank`; None where a variable is not set), since a row of the mesh is
    ranks numbered one after another and torchrun numbers them node by node. Raises
    ConfigError naming `needed_by` and the fix."""
    said = {"LOCAL_WORLD_SIZE": local_world_size, "RANK": rank, "GROUP_RANK": node_rank}
    missing = [k for k, v in said.items() if v is None]
    if missing:
        raise ConfigError(f"{needed_by} takes the nodes from torchrun, but {', '.join(missing)} is not set: "
                          f"launch with torchrun (or zerodp launch)"
                          + (", or set replicate_size to the number of nodes" if "replicate" in needed_by else ""))
    if local_world_size < 1 or rank // local_world_size != node_rank:
        raise ConfigError(f"{needed_by}: rank {rank} is on node {node_rank} with {local_world_size} ranks per node, "
                          f"so the ranks are not numbered node by node, as torchrun numbers them")
    return local_world_size
