"""DeepSpeed's `zero_optimization` block as Config fields, for integrations/deepspeed.py's
translation ([Note: every DeepSpeed key accounted for] there): each function takes the
translator `t` (its `set`, `value`, `ignored`, `notes`) and one block."""
from __future__ import annotations

import math
import os

from ..config_values import DTYPES, ConfigError

__all__ = ["check_number", "refuse_unknown", "translate_zero"]

AUTO = "auto"

ZERO_WITHOUT_EFFECT = {
    "contiguous_gradients", "reduce_scatter", "allgather_partitions", "use_multi_rank_bucket_allreduce",
    "load_from_fp32_weights", "elastic_checkpoint", "sub_group_size", "cpu_offload_use_pin_memory",
    "stage3_param_persistence_threshold", "stage3_model_persistence_threshold", "stage3_max_reuse_distance",
    "stage3_max_live_parameters", "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "ignore_unused_parameters",
    "legacy_stage1", "round_robin_gradients", "memory_efficient_linear", "pipeline_loading_checkpoint",
    "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks", "leaf_module",
    "mics_hierarchical_params_gather"}
OFFLOAD_WITHOUT_EFFECT = {"pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline_read",
                          "pipeline_write", "pipeline", "cpuadam_cores_perc"}


def translate_zero(t, zero: dict) -> None:
    if not isinstance(zero, dict):
        raise ConfigError(f"DeepSpeed zero_optimization={zero!r}: give a mapping")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"DeepSpeed zero_optimization.stage={stage!r}: use 0, 1, 2 or 3")
    t.set("stage", stage, "zero_optimization.stage")
    z = "zero_optimization."
    legacy = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
    for key, target in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        offload(t, zero.get(key), f"{z}{key}", target)
    for old, new in legacy.items():
        if zero.get(old):
            offload(t, {"device": "cpu"}, f"{z}{old}",
                    "offload_optimizer" if new == "offload_optimizer" else "offload_params")
        elif old in zero:
            t.ignored(f"{z}{old}")
    if "overlap_comm" in zero and zero["overlap_comm"] is not None:
        t.set("overlap_comm", bool(zero["overlap_comm"]), f"{z}overlap_comm")
    buckets(t, zero, stage)
    zeropp(t, zero, stage)
    handled = {"stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param", "overlap_comm",
               "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
               "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
               "zero_quantized_nontrainable_weights", "zeropp_loco_param", "mics_shard_size", "zenflow"}
    for key in zero:
        if key in handled:
            continue
        if key in ZERO_WITHOUT_EFFECT:
            t.ignored(f"{z}{key}")
        else:
            raise ConfigError(f"DeepSpeed key {z}{key} has no zerodp equivalent (or is not a DeepSpeed key): "
                              f"remove it")


def offload(t, block, key: str, field_name: str) -> None:
    if block is None:
        return
    if not isinstance(block, dict):
        raise ConfigError(f"DeepSpeed {key}={block!r}: give a mapping with a \"device\"")
    device = block.get("device", "none")
    place = {"none": "none", "cpu": "host", "nvme": "disk"}.get(device)
    if place is None:
        raise ConfigError(f"DeepSpeed {key}.device={device!r}: use \"none\", \"cpu\" or \"nvme\"")
    if block.get("ratio", 1.0) != 1.0:
        raise ConfigError(f"DeepSpeed {key}.ratio={block['ratio']}: zerodp offloads the whole optimizer (a "
                          f"partial offload updates part of it on the device); remove ratio or set it to 1")
    if block.get("super_offload"):
        raise ConfigError(f"DeepSpeed {key}.super_offload=true has no zerodp equivalent: remove it")
    if place != "none":
        t.set(field_name, place, f"{key}.device")
    if place == "disk":
        path = block.get("nvme_path")
        if not path:
            raise ConfigError(f"DeepSpeed {key}.device='nvme' needs nvme_path (zerodp's offload_dir)")
        if t.fields.get("offload_dir", path) != path:
            raise ConfigError(f"DeepSpeed offload_optimizer.nvme_path={t.fields['offload_dir']!r} and "
                              f"offload_param.nvme_path={path!r}: zerodp keeps both in one offload_dir; use one "
                              f"path")
        t.set("offload_dir", str(path), f"{key}.nvme_path")
    elif "nvme_path" in block:
        t.ignored(f"{key}.nvme_path")
    for k in block:
        if k in OFFLOAD_WITHOUT_EFFECT:
            t.ignored(f"{key}.{k}")
    refuse_unknown(set(block) - OFFLOAD_WITHOUT_EFFECT - {"device", "nvme_path", "ratio", "super_offload"},
                   f"{key}.")


def buckets(t, zero: dict, stage: int) -> None:
    """Bucket sizes count elements in DeepSpeed and bytes in zerodp; "auto" is the HF
    Trainer's: hidden_size**2 elements (0.9 of it for the stage-3 prefetch)."""
    z = "zero_optimization."
    hidden = t.hidden_size()
    reduce = t.value(zero, "reduce_bucket_size", z, lambda: hidden * hidden if hidden else None)
    gather = zero.get("allgather_bucket_size")
    for key in ("stage3_param_persistence_threshold",):
        if zero.get(key) == AUTO:
            t.auto[f"{z}{key}"] = 10 * hidden if hidden else None
    elements = reduce if reduce is not None else gather
    if elements is not None:
        check_number(elements, f"{z}reduce_bucket_size", minimum=1)
        dtype = t.fields.get("reduce_dtype") or t.fields.get("mixed_precision", "fp32")
        itemsize = DTYPES[dtype].itemsize
        t.set("bucket_bytes", int(elements) * itemsize, f"{z}reduce_bucket_size")
        if reduce is not None and gather is not None and gather != reduce:
            t.notes.append(f"{z}allgather_bucket_size={gather} differs from reduce_bucket_size={reduce}: "
                           f"zerodp has one bucket size for both (the reduce one)")
    elif reduce is None and zero.get("reduce_bucket_size") == AUTO:
        t.notes.append("zero_optimization.reduce_bucket_size='auto' without a model's hidden size: zerodp's "
                       "default bucket (Config.bucket_bytes) is kept")
    if stage == 3 and elements is not None:
        t.notes.append("at stage 3 zerodp's bucket is the unit (a module gathered at once): bucket_bytes "
                       "applies to stages 0-2")
    key = "stage3_prefetch_bucket_size" if "stage3_prefetch_bucket_size" in zero else "prefetch_bucket_size"
    prefetch = t.value(zero, key, z, lambda: int(0.9 * hidden * hidden) if hidden else None)
    if prefetch is not None and stage == 3:
        check_number(prefetch, f"{z}{key}", minimum=0)
        if prefetch == 0:
            t.set("prefetch_units", 0, f"{z}{key}")
        else:
            t.notes.append(f"{z}{key}={prefetch} elements: zerodp prefetches by units, Config.prefetch_units "
                           f"(1 unit ahead by default)")
    elif key in zero:
        t.ignored(f"{z}{key}")


def zeropp(t, zero: dict, stage: int) -> None:
    z = "zero_optimization."
    for key, why in (("zero_quantized_nontrainable_weights", "it quantizes the frozen weights themselves"),
                     ("zeropp_loco_param", "LoCo's error feedback changes the reduced gradients"),
                     ("zenflow", "it updates part of the gradients asynchronously")):
        if zero.get(key):
            raise ConfigError(f"DeepSpeed {z}{key} is set and {why}; zerodp has no equivalent: remove it")
        if key in zero:
            t.ignored(f"{z}{key}")
    hpz = zero.get("zero_hpz_partition_size", 1)
    check_number(hpz, f"{z}zero_hpz_partition_size", minimum=0, integer=True)
    if hpz > 1:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is not None and int(local) != hpz:
            raise ConfigError(f"DeepSpeed {z}zero_hpz_partition_size={hpz}: zerodp's secondary partition is the "
                              f"node, {local} ranks here (LOCAL_WORLD_SIZE); use {local}, or run {hpz} per node")
        t.set("hpz", True, f"{z}zero_hpz_partition_size")
        t.notes.append(f"{z}zero_hpz_partition_size={hpz}: zerodp's hpZ partition is the node "
                       f"(LOCAL_WORLD_SIZE ranks)")
    if zero.get("zero_quantized_weights"):
        t.set("quantize_weights", True, f"{z}zero_quantized_weights")
    if zero.get("zero_quantized_gradients"):
        # ZeRO++'s qgZ sends int4 codes (arXiv 2306.10209 §3.3).
        t.set("quantize_grads", "int4", f"{z}zero_quantized_gradients")
    mics = zero.get("mics_shard_size", -1)
    if mics is not None and mics > 0:
        if t.world_size is None:
            raise ConfigError(f"DeepSpeed {z}mics_shard_size={mics}: zerodp's replicate_size is the number of "
                              f"shard groups, world size // {mics}; give world_size (or TrainingArguments), or set "
                              f"Config(replicate_size=...) yourself")
        if t.world_size % mics:
            raise ConfigError(f"DeepSpeed {z}mics_shard_size={mics} does not divide the world size "
                              f"{t.world_size}")
        t.set("replicate_size", t.world_size // mics, f"{z}mics_shard_size")


def refuse_unknown(keys: set, prefix: str) -> None:
    if keys:
        raise ConfigError(f"DeepSpeed key {prefix}{sorted(keys)[0]} has no zerodp equivalent (or is not a DeepSpeed "
                          f"key): remove it")


def check_number(value, key: str, minimum: float, integer: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= minimum
    if ok and integer:
        ok = float(value).is_integer()
    if not ok:
        raise ConfigError(f"DeepSpeed {key}={value!r}: use {'an integer' if integer else 'a number'} >= {minimum}")
