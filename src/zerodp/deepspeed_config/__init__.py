"""A DeepSpeed JSON config as zerodp's Config, key by key (docs/deepspeed.md).

    cfg, outside = zerodp.Config.from_deepspeed("ds_config.json")
    model, optimizer = zerodp.initialize(model, outside.optimizer or torch.optim.AdamW, cfg)

[Note: every DeepSpeed key accounted for]
DeepSpeed ignores a key it does not know (a typo falls back to the default, silently). Here
every key of the file is one of three kinds, and a key of none of them is refused by name:
- mapped: a Config field (`zero_optimization.stage` -> `stage`, ...), or a value the training
  loop applies outside the Config (`gradient_clipping`, the `optimizer` and `scheduler`
  blocks, the batch sizes): `Outside`.
- without effect on the results (logging, profiling, checkpoint and performance knobs zerodp
  has no counterpart for): accepted and logged once, by name.
- refused: it changes the results and zerodp has no such thing (progressive layer drop, a
  partial offload ratio, fp16 hysteresis, ...), so accepting it would train differently from
  DeepSpeed without a word. The error names the key and what to do.

"auto" is the Hugging Face Trainer's: a value taken from `TrainingArguments` (and from the
model's hidden size for three bucket sizes), as `HfTrainerDeepSpeedConfig` fills it. Given
no TrainingArguments, each "auto" becomes what a default `TrainingArguments()` gives, listed
in `Outside.auto` and logged; one that needs the run's length (`total_num_steps`) is
refused unless `num_training_steps` is given.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

from ..config_values import DTYPES, ConfigError
from .optim import build_optimizer, build_scheduler
from .zero import check_number, refuse_unknown, translate_zero

log = logging.getLogger(__name__)

__all__ = ["DeepSpeedTranslation", "Outside", "from_deepspeed"]

AUTO = "auto"

# What a default TrainingArguments() fills an "auto" with (transformers' defaults), when none is given.
_ARG_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_grad_norm": 1.0,
                 "learning_rate": 5e-5, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
                 "weight_decay": 0.0, "fp16": False, "bf16": False, "fp16_full_eval": False, "bf16_full_eval": False}

# Keys with no effect on what is trained: logging, profiling, checkpoint files, performance.
_TOP_WITHOUT_EFFECT = {
    "wall_clock_breakdown", "steps_per_print", "logging", "memory_breakdown", "dump_state", "flops_profiler",
    "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "monitor", "timers", "checkpoint", "nebula",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "dataloader_drop_last", "aio", "autotuning",
    "load_universal_checkpoint", "use_node_local_storage", "seq_parallel_communication_data_type",
    "checkpoint_tag_validation", "graph_harvesting", "disable_allgather_comm_off"}
# Blocks DeepSpeed runs when enabled, each changing the results, with no zerodp counterpart.
_REFUSED_BLOCKS = {
    "progressive_layer_drop": "it drops layers at random during training",
    "curriculum_learning": "it changes which samples (and sequence lengths) each step sees",
    "data_efficiency": "it changes which samples each step sees",
    "compression_training": "it prunes or quantizes the model while training",
    "quantize_training": "it quantizes the weights while training",
    "eigenvalue": "it drives quantize_training's schedule",
    "elasticity": "it changes the batch size with the number of GPUs",
    "sparse_attention": "it replaces the model's attention",
    "pipeline": "zerodp has no pipeline parallelism",
    "hybrid_engine": "it switches to DeepSpeed's inference kernels for generation",
    "weight_quantization": "it quantizes the weights",
    "torch_autocast": "it runs the forward under torch.autocast; zerodp casts the parameters "
                      "(Config.mixed_precision)",
    "compile": "DeepSpeed's compiler passes: use Config(compile_units=True)",
    "tensor_parallel": "DeepSpeed's AutoTP: use Config(tensor_parallel_size=...)",
    "amp": "apex AMP: use bf16 or fp16 (Config.mixed_precision)",
    "zenflow": "it updates part of the gradients asynchronously",
}


@dataclass(frozen=True)
class Outside:
    """What a DeepSpeed config asks of the training loop rather than of the Config."""

    grad_clip: Optional[float] = None
    """`gradient_clipping`: the norm to clip to after each backward window
    (`optimizer.clip_grad_norm_(grad_clip)`, the HF Trainer's `max_grad_norm`); None: no clipping."""
    micro_batch_size: Optional[int] = None
    """`train_micro_batch_size_per_gpu`: the batch each rank's forward takes."""
    train_batch_size: Optional[int] = None
    """`train_batch_size`: micro batch x accumulation steps x data-parallel ranks."""
    optimizer: Optional[Callable] = None
    """The `optimizer` block as `params -> torch optimizer` (what `zerodp.initialize` takes), over
    every trainable parameter in one group, as DeepSpeed builds it; None without a block."""
    scheduler: Optional[Callable] = None
    """The `scheduler` block as `optimizer -> LR scheduler`, stepped once per optimizer step
    (as DeepSpeed's engine steps it); None without a block."""
    auto: Mapping[str, Any] = field(default_factory=dict)
    """Every "auto" of the file and the value it became."""
    without_effect: tuple = ()
    """Keys accepted that change nothing here (logged once)."""
    notes: tuple = ()
    """Where a mapping is not one to one (also logged)."""


class DeepSpeedTranslation(NamedTuple):
    config: Any  # the zerodp.Config
    outside: Outside


def load_json(source: Union[str, os.PathLike, Mapping]) -> dict:
    if isinstance(source, Mapping):
        return json.loads(json.dumps(source))  # a deep copy of plain values; nothing of the caller's changes
    path = os.fspath(source)
    try:
        with open(path, encoding="utf-8-sig") as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"DeepSpeed config {path!r} could not be read as JSON: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"DeepSpeed config {path!r} holds {type(values).__name__}, not a mapping of keys")
    return values


def from_deepspeed(source: Union[str, os.PathLike, Mapping], *, make_config: Callable, training_args=None, model=None,
                   num_training_steps: Optional[int] = None, world_size: Optional[int] = None) -> DeepSpeedTranslation:
    """The Config a DeepSpeed JSON config (a dict or a path) describes, and what the training
    loop must do outside it ([Note: every DeepSpeed key accounted for]). `training_args`
    (transformers' TrainingArguments) resolves "auto" as the HF Trainer does, and values that
    contradict it are refused as the Trainer refuses them; `model` gives the hidden size of the
    three bucket sizes' "auto"; `num_training_steps` the schedulers'. `make_config`: the Config class
    (`Config.from_deepspeed` passes itself: this module builds on the config's values, not on it)."""
    return _Translator(load_json(source), training_args, model, num_training_steps, world_size, make_config).run()


class _Translator:
    def __init__(self, ds: dict, args, model, num_training_steps: Optional[int], world_size: Optional[int],
                 make_config: Callable):
        self.ds, self.args, self.model, self.steps = ds, args, model, num_training_steps
        self.make_config = make_config
        self.world_size = world_size if world_size is not None else getattr(args, "world_size", None)
        self.fields: dict = {}  # Config field -> value
        self.source: dict = {}  # Config field -> the DeepSpeed key it came from
        self.auto: dict = {}
        self.without_effect: list = []
        self.notes: list = []
        self.mismatches: list = []

    # -- values --------------------------------------------------------------------------------
    def arg(self, name: str):
        return getattr(self.args, name) if self.args is not None else _ARG_DEFAULTS[name]

    def value(self, block: dict, key: str, where: str, resolve: Optional[Callable] = None, default=None):
        """`block[key]`, "auto" resolved by `resolve()` (refused where there is none); a value
        TrainingArguments also sets must agree with it, as the HF Trainer requires."""
        name = f"{where}{key}"
        if key not in block:
            return default
        v = block[key]
        if v == AUTO:
            if resolve is None:
                raise ConfigError(f"DeepSpeed {name}='auto': only the HF Trainer's keys take \"auto\" (nothing "
                                  f"resolves this one): give a value")
            v = resolve()
            self.auto[name] = v
        elif resolve is not None and self.args is not None and name in _MUST_MATCH:
            try:
                expected = resolve()
            except ConfigError:  # not known yet (the run's length): the HF Trainer checks it later, as zerodp's does
                expected = None
            if _differs(v, expected):
                self.mismatches.append(f"{name}={v!r} vs TrainingArguments {_MUST_MATCH[name]}={expected!r}")
        return v

    def set(self, name: str, value, key: str) -> None:
        self.fields[name], self.source[name] = value, key

    def ignored(self, key: str) -> None:
        self.without_effect.append(key)

    # -- the whole file --------------------------------------------------------------------------
    def run(self) -> DeepSpeedTranslation:
        ds = self.ds
        stray = sorted(set(_auto_keys(ds)) - _HF_AUTO)
        if stray:
            raise ConfigError(f"DeepSpeed {stray[0]}='auto': the HF Trainer resolves \"auto\" only for "
                              f"{sorted(_HF_AUTO)} (and DeepSpeed takes none): give a value")
        self.precision(ds)
        if ds.get("communication_data_type") is not None:
            dtype = {"bfp16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32",
                     "float32": "fp32", "bf16": "bf16"}.get(str(ds["communication_data_type"]).lower())
            if dtype is None:
                raise ConfigError(f"DeepSpeed communication_data_type={ds['communication_data_type']!r}: use one of "
                                  f"{sorted(DTYPES)}")
            self.set("reduce_dtype", dtype, "communication_data_type")
        translate_zero(self, ds.get("zero_optimization", {}))  # its bucket sizes count elements of the reduce dtype
        self.batch(ds)
        clip = self.value(ds, "gradient_clipping", "", lambda: self.arg("max_grad_norm"), 0.0)
        check_number(clip, "gradient_clipping", minimum=0.0)
        self.flags(ds)
        self.activation_checkpointing(ds.get("activation_checkpointing"))
        optimizer = build_optimizer(ds["optimizer"], self.optimizer_params) if "optimizer" in ds else None
        scheduler = build_scheduler(ds["scheduler"], self.scheduler_params) if "scheduler" in ds else None
        handled = {"zero_optimization", "fp16", "bf16", "bfloat16", "gradient_accumulation_steps",
                   "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu",
                   "communication_data_type", "optimizer", "scheduler", "activation_checkpointing",
                   "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "data_types",
                   "disable_allgather"}
        for key in ds:
            if key in handled:
                continue
            if key in _TOP_WITHOUT_EFFECT or (key in _REFUSED_BLOCKS and _disabled(ds[key])):
                self.ignored(key)
            elif key in _REFUSED_BLOCKS:
                raise ConfigError(f"DeepSpeed {key} is enabled, and {_REFUSED_BLOCKS[key]}: zerodp would train "
                                  f"without it; remove the block (or set \"enabled\": false)")
            else:
                raise ConfigError(f"DeepSpeed key {key!r} has no zerodp equivalent (or is not a DeepSpeed key): "
                                  f"remove it ([Note: every DeepSpeed key accounted for] in integrations/deepspeed.py)")
        if self.mismatches:
            raise ConfigError("DeepSpeed config values contradict the TrainingArguments (the HF Trainer refuses "
                              "them too): " + "; ".join(self.mismatches) + ". Set them to \"auto\" or make them agree")
        config = self.config()
        outside = Outside(grad_clip=float(clip) if clip else None, micro_batch_size=self.micro,
                          train_batch_size=self.train_batch, optimizer=optimizer, scheduler=scheduler,
                          auto=dict(self.auto), without_effect=tuple(self.without_effect), notes=tuple(self.notes))
        self.report(outside)
        return DeepSpeedTranslation(config, outside)

    def config(self):
        try:
            return self.make_config(**self.fields)
        except ConfigError as e:
            keys = ", ".join(f"{self.source[f]} (Config.{f}={self.fields[f]!r})" for f in self.fields)
            raise ConfigError(f"the DeepSpeed config maps to a Config that is not allowed: {e}. From: {keys}") from None

    def report(self, outside: Outside) -> None:
        if outside.without_effect:
            log.warning("DeepSpeed keys without effect under zerodp (accepted, nothing to do): %s",
                        ", ".join(outside.without_effect))
        if outside.auto and self.args is None:
            log.warning("DeepSpeed \"auto\" values resolved without TrainingArguments (a default TrainingArguments' "
                        "values): %s", ", ".join(f"{k}={v!r}" for k, v in outside.auto.items()))
        for note in outside.notes:
            log.info("DeepSpeed config: %s", note)

    # -- precision -----------------------------------------------------------------------------------
    def precision(self, ds: dict) -> None:
        if self.args is not None:
            # accelerate's DeepSpeedPlugin adds the block TrainingArguments' precision asks for when
            # the file has none (set_mixed_precision): the HF Trainer trains in it.
            for key, on in (("fp16", self.arg("fp16")), ("bf16", self.arg("bf16"))):
                if on and key not in ds and (key != "bf16" or "bfloat16" not in ds):
                    ds[key] = {"enabled": True}
                    self.auto[f"{key}.enabled"] = True
        fp16 = _block(ds, "fp16")
        bf16 = _block(ds, "bf16") if "bf16" in ds else _block(ds, "bfloat16")
        bf16_key = "bf16" if "bf16" in ds else "bfloat16"
        fp16_on = bool(self.value(fp16, "enabled", "fp16.", lambda: self.arg("fp16") or self.arg("fp16_full_eval"),
                                  False))
        bf16_on = bool(self.value(bf16, "enabled", f"{bf16_key}.",
                                  lambda: self.arg("bf16") or self.arg("bf16_full_eval"), False))
        if fp16_on and bf16_on:
            raise ConfigError("DeepSpeed fp16.enabled and bf16.enabled are both true: enable one")
        if bf16_on:
            self.set("mixed_precision", "bf16", f"{bf16_key}.enabled")
            self.bf16(bf16, bf16_key)
        elif bf16:
            self.without_effect.extend(f"{bf16_key}.{k}" for k in bf16 if k != "enabled")
        if fp16_on:
            self.set("mixed_precision", "fp16", "fp16.enabled")
            self.fp16(fp16)
        elif fp16:
            self.without_effect.extend(f"fp16.{k}" for k in fp16 if k != "enabled")

    def fp16(self, fp16: dict) -> None:
        for key, why in (("auto_cast", "it casts the forward's floating inputs to fp16, which zerodp does not: cast "
                                       "them in the model or the loop"),
                         ("fp16_master_weights_and_grads", "zerodp keeps fp32 master weights and gradients")):
            if fp16.get(key):
                raise ConfigError(f"DeepSpeed fp16.{key}=true: {why}; remove it")
        scale = fp16.get("loss_scale", 0)
        check_number(scale, "fp16.loss_scale", minimum=0.0)
        if scale:
            self.set("loss_scale", float(scale), "fp16.loss_scale")
            self.without_effect.extend(f"fp16.{k}" for k in ("initial_scale_power", "loss_scale_window", "hysteresis",
                                                             "consecutive_hysteresis", "min_loss_scale") if k in fp16)
            return
        power = fp16.get("initial_scale_power", 16)
        check_number(power, "fp16.initial_scale_power", minimum=0, integer=True)
        self.set("initial_loss_scale", float(2 ** power), "fp16.initial_scale_power")
        window = fp16.get("loss_scale_window", 1000)
        check_number(window, "fp16.loss_scale_window", minimum=1, integer=True)
        self.set("loss_scale_growth_interval", int(window), "fp16.loss_scale_window")
        self.notes.append("fp16.loss_scale_window: zerodp doubles the scale after that many clean steps; DeepSpeed "
                          "one clean step later")
        hysteresis = fp16.get("hysteresis", 2)  # DeepSpeed's default is 2
        if hysteresis != 1:
            raise ConfigError(f"DeepSpeed fp16.hysteresis={hysteresis} (DeepSpeed's default is 2): DeepSpeed then "
                              f"keeps the loss scale at the first overflows and zerodp halves it at every one, so the "
                              f"scales, and the steps they skip, part ways; set \"hysteresis\": 1 to train with "
                              f"zerodp's policy")
        # With hysteresis 1 there is nothing for consecutive_hysteresis to restore.
        self.without_effect.extend(f"fp16.{k}" for k in ("hysteresis", "consecutive_hysteresis") if k in fp16)
        if fp16.get("min_loss_scale", 1) != 1:
            raise ConfigError(f"DeepSpeed fp16.min_loss_scale={fp16['min_loss_scale']}: zerodp's dynamic scale "
                              f"stops at 1; set it to 1")
        unknown = set(fp16) - {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                               "hysteresis", "consecutive_hysteresis", "min_loss_scale",
                               "fp16_master_weights_and_grads"}
        refuse_unknown(unknown, "fp16.")

    def bf16(self, bf16: dict, key: str) -> None:
        if bf16.get("bf16_master_weights_and_grads"):
            raise ConfigError(f"DeepSpeed {key}.bf16_master_weights_and_grads=true: zerodp keeps fp32 master weights")
        if bf16.get("check_grad_overflow"):
            self.set("nonfinite_grads", "skip", f"{key}.check_grad_overflow")
        self.without_effect.extend(f"{key}.{k}" for k in ("immediate_grad_update", "bf16_optimizer_states")
                                   if k in bf16)
        refuse_unknown(set(bf16) - {"enabled", "immediate_grad_update", "check_grad_overflow",
                                    "bf16_master_weights_and_grads", "bf16_optimizer_states"}, f"{key}.")

    # -- the rest -----------------------------------------------------------------------------------
    def batch(self, ds: dict) -> None:
        gas = self.value(ds, "gradient_accumulation_steps", "", lambda: self.arg("gradient_accumulation_steps"))
        if gas is not None:
            check_number(gas, "gradient_accumulation_steps", minimum=1, integer=True)
            self.set("grad_accumulation_steps", int(gas), "gradient_accumulation_steps")
        micro = self.value(ds, "train_micro_batch_size_per_gpu", "", lambda: self.arg("per_device_train_batch_size"))
        world = self.world_size

        def total():
            if world is None:
                return None
            return world * self.arg("per_device_train_batch_size") * self.arg("gradient_accumulation_steps")

        train = self.value(ds, "train_batch_size", "", total)
        for key, v in (("train_micro_batch_size_per_gpu", micro), ("train_batch_size", train)):
            if v is not None:
                check_number(v, key, minimum=1, integer=True)
        if None not in (micro, train, world) and train != micro * (gas or 1) * world:
            raise ConfigError(f"DeepSpeed train_batch_size={train} is not train_micro_batch_size_per_gpu={micro} x "
                              f"gradient_accumulation_steps={gas or 1} x {world} ranks: fix one of them")
        self.micro, self.train_batch = micro, train

    def flags(self, ds: dict) -> None:
        """Top-level switches whose default is what zerodp does."""
        for key, default, why in (
                ("prescale_gradients", False, "it divides gradients before their reduction, a different rounding"),
                ("gradient_predivide_factor", 1.0, "it splits the gradient average in two divisions"),
                ("sparse_gradients", False, "zerodp reduces embedding gradients dense"),
                ("disable_allgather", False, "it replaces the parameter all-gather with broadcasts")):
            if key not in ds:
                continue
            if ds[key] != default:
                raise ConfigError(f"DeepSpeed {key}={ds[key]!r}: {why}, which zerodp does not do; remove it")
            self.ignored(key)
        data_types = ds.get("data_types")
        if data_types is not None:
            accum = (data_types or {}).get("grad_accum_dtype")
            if accum not in (None, "fp32", "float32") or set(data_types) - {"grad_accum_dtype"}:
                raise ConfigError(f"DeepSpeed data_types={data_types!r}: zerodp accumulates gradients in the reduce "
                                  f"dtype (Config.reduce_dtype); remove data_types")
            self.ignored("data_types")

    def activation_checkpointing(self, block) -> None:
        """DeepSpeed's checkpointing API runs only where the model calls it; its partitioning
        and host options are zerodp's Pa and Pa+cpu, applied to torch's checkpoint."""
        if not block:
            return
        if block.get("partition_activations"):
            self.set("partition_activations", True, "activation_checkpointing.partition_activations")
        if block.get("cpu_checkpointing"):
            self.set("activations_on_host", True, "activation_checkpointing.cpu_checkpointing")
        for k in block:
            if k not in ("partition_activations", "cpu_checkpointing") or not block[k]:
                self.ignored(f"activation_checkpointing.{k}")
        self.notes.append("activation_checkpointing: zerodp applies it to torch.utils.checkpoint (and HF's "
                          "gradient_checkpointing_enable), not to deepspeed.checkpointing")

    def hidden_size(self) -> Optional[int]:
        config = getattr(self.model, "config", None)
        for c in (config, getattr(config, "text_config", None)):
            if c is None:
                continue
            if getattr(c, "hidden_size", None):
                return int(c.hidden_size)
            if getattr(c, "hidden_sizes", None):
                return int(max(c.hidden_sizes))
        return None

    def optimizer_params(self, key: str, value):
        """An optimizer.params value, "auto" resolved from TrainingArguments."""
        resolve = {"lr": lambda: self.arg("learning_rate"),
                   "betas": lambda: [self.arg("adam_beta1"), self.arg("adam_beta2")],
                   "eps": lambda: self.arg("adam_epsilon"),
                   "weight_decay": lambda: self.arg("weight_decay")}.get(key)
        return self.value({key: value}, key, "optimizer.params.", resolve)

    def scheduler_params(self, key: str, value):
        def total():
            if self.steps is None:
                raise ConfigError("DeepSpeed scheduler.params.total_num_steps='auto' needs the run's length: give "
                                  "num_training_steps (the HF Trainer gives its own)")
            return self.steps

        def warmup():
            # The HF Trainer's: at least 1 (DeepSpeed refuses 0); a default TrainingArguments warms up 0 steps.
            if self.args is None:
                return 1
            if self.steps is not None:
                return max(1, self.args.get_warmup_steps(self.steps))
            steps = getattr(self.args, "warmup_steps", 0)
            if 0 < steps < 1:  # a ratio of the run
                raise ConfigError(f"DeepSpeed scheduler.params.warmup_num_steps='auto' with TrainingArguments("
                                  f"warmup_steps={steps}), a ratio of the run: give num_training_steps")
            return max(1, int(steps))

        resolve = {"warmup_min_lr": lambda: 0, "warmup_max_lr": lambda: self.arg("learning_rate"),
                   "total_num_steps": total, "warmup_num_steps": warmup}.get(key)
        return self.value({key: value}, key, "scheduler.params.", resolve)


# Keys the HF Trainer fills from TrainingArguments and checks when they are not "auto".
_MUST_MATCH = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
               "gradient_accumulation_steps": "gradient_accumulation_steps",
               "train_batch_size": "world_size x per_device_train_batch_size x gradient_accumulation_steps",
               "gradient_clipping": "max_grad_norm", "optimizer.params.lr": "learning_rate",
               "optimizer.params.betas": "[adam_beta1, adam_beta2]", "optimizer.params.eps": "adam_epsilon",
               "optimizer.params.weight_decay": "weight_decay", "scheduler.params.warmup_max_lr": "learning_rate",
               "fp16.enabled": "fp16 or fp16_full_eval", "bf16.enabled": "bf16 or bf16_full_eval",
               "scheduler.params.total_num_steps": "num_training_steps",
               "scheduler.params.warmup_num_steps": "warmup_steps"}


# The keys whose "auto" the HF Trainer fills (HfTrainerDeepSpeedConfig).
_HF_AUTO = set(_MUST_MATCH) | {"scheduler.params.warmup_min_lr", "zero_optimization.reduce_bucket_size",
                               "zero_optimization.stage3_prefetch_bucket_size",
                               "zero_optimization.stage3_param_persistence_threshold"}


def _auto_keys(block, prefix: str = ""):
    for key, value in block.items():
        if value == AUTO:
            yield f"{prefix}{key}"
        elif isinstance(value, dict):
            yield from _auto_keys(value, f"{prefix}{key}.")


def _differs(value, expected) -> bool:
    if expected is None:
        return False
    if isinstance(value, (list, tuple)) and isinstance(expected, (list, tuple)):
        return list(value) != list(expected)
    return value != expected


def _block(ds: dict, key: str) -> dict:
    block = ds.get(key) or {}
    if not isinstance(block, dict):
        raise ConfigError(f"DeepSpeed {key}={block!r}: give a mapping")
    return block


def _disabled(block) -> bool:
    return isinstance(block, dict) and block.get("enabled") is False or block is False or block is None


