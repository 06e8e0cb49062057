"""The one typed configuration of zerodp, validated at construction.

Every field is documented where it is declared; `tests/test_config.py` pins the set of
fields so options cannot sprawl unnoticed.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Union

import torch

from .config_values import (DTYPES, MAX_TIMEOUT_S, OFFLOAD_PLACES, QUANTIZED_BITS, ConfigError, bad_value, check_flags,
                            check_positive_finite, check_positive_int, check_sequence_parallel, is_one_of,
                            parse_config_text, refuse_unless, shown, torchrun_ranks_per_node)
from .policies import (BackwardPolicy, OffloadPolicy, PrecisionPolicy, StepPolicy, TensorParallelPolicy, UnitPolicy,
                       ZeroPPPolicy)

__all__ = ["Config", "ConfigError", "DTYPES", "torchrun_ranks_per_node"]


@dataclass(frozen=True, kw_only=True)
class Config:
    stage: int = 2
    """ZeRO stage: 0 = DDP (all-reduce), 1 = shard optimizer states, 2 = also gradients,
    3 = also parameters (ZeRO, arXiv 1910.02054, §5.1-5.3)."""

    replicate_size: Union[int, str] = 1
    """Rows of the data-parallel mesh ([Note: mesh axes] in distributed/topology.py): the
    ranks are a replicate x shard grid, model states are sharded along each row only and
    each row holds a full copy (hybrid sharding, FSDP2's HSDP: e.g. the number of nodes, so
    that gathers stay inside a node). Gradients are reduce-scattered within the row, then
    all-reduced across rows. 1 shards over every rank. Must divide the world size.
    "nodes": one row per node, as torchrun says (LOCAL_WORLD_SIZE ranks on each)."""

    mixed_precision: str = "fp32"
    """Compute dtype of the model's parameters: "fp32", "bf16" or "fp16". With bf16/fp16 the
    optimizer updates an fp32 master copy of each rank's shard."""

    cast_buffers: bool = False
    """bf16/fp16: also cast the model's floating buffers to the compute dtype. Off, buffers
    keep their dtype, as FSDP2's MixedPrecisionPolicy does (a rotary `inv_freq` stays
    exact); turn it on for a model whose buffers meet 16-bit weights in one op without a
    cast of their own (nn.BatchNorm's running statistics, an additive positional table)."""

    reduce_dtype: Union[str, None] = None
    """Dtype in which gradients are reduced and the owned gradient shard is kept; None means
    the compute dtype (2 bytes per element under bf16, as the paper counts). "fp32" sums in
    fp32 at twice the bytes."""

    loss_scale: Union[str, float] = "dynamic"
    """fp16 only: "dynamic" (grow/back off, skip steps with inf/nan) or a fixed positive, finite number."""

    nonfinite_grads: str = "raise"
    """fp32/bf16 (no loss scaler): what a step does when the global gradient holds a nan or
    inf (a diverged loss on any rank): "raise" on every rank before the master weights are
    touched, "skip" the step on every rank (counted in `optimizer.skipped_steps`, logged),
    or "proceed" and apply it. fp16 always skips such steps and backs off its loss scale."""

    initial_loss_scale: float = 2.0**16
    """fp16 with dynamic scaling: the scale of the first step (positive, finite)."""

    loss_scale_growth_interval: int = 1000
    """fp16 with dynamic scaling: clean steps after which the scale doubles."""

    bucket_bytes: int = 25 * 2**20
    """Size of one communication bucket (the paper's constant-size buffer, CB, §6.2): at
    stages 0-2 the flat gradient/parameter buffer is split into buckets of at most this many
    bytes, each reduced and gathered as one collective, whatever the model size. At stage 3
    the unit is the bucket."""

    overlap_comm: bool = True
    """Launch each bucket's reduction asynchronously from backward hooks as soon as it is
    full, overlapping the rest of backward; False waits for each reduction in place."""

    grad_accumulation_steps: int = 1
    """Micro-batches per optimizer step; `optimizer.backward(loss)` divides the loss by this
    number. Stages 0-1 communicate at the last micro-batch only; stages 2-3 per
    `reduce_each_micro_batch`."""

    reduce_each_micro_batch: bool = True
    """Stage 2-3 with grad_accumulation_steps > 1: reduce-scatter every micro-batch's
    gradients into the owned shard as its backward runs, so only the (2+K)Ψ/N of the paper
    is held between micro-batches, at one more Ψ of reduce-scatter per micro-batch (as
    DeepSpeed and FSDP2 do). False keeps the full unsharded gradients (2Ψ bytes in 16-bit)
    until the last micro-batch and reduces once per step, as DDP's no_sync(). Stages 0-1
    hold full gradients anyway and always reduce once, at the boundary."""

    unit_modules: tuple = ()
    """Stage 3: module classes (or class names) whose every instance is one unit, gathered
    at once; e.g. (Block,). Empty means automatic units: a Hugging Face model's block classes
    (`_no_split_modules`) and its input embedding when untied from the head, else by
    `unit_min_params`. A unit must be a module that runs (not a ModuleList)."""

    unit_min_params: int = 100_000
    """Stage 3 with no `unit_modules`: a submodule whose parameter count reaches this becomes
    a unit (the smallest such subtrees are chosen)."""

    reshard_after_forward: bool = True
    """Stage 3: free a unit's gathered parameters after its forward and gather them again in
    backward (3Ψ per step); False keeps them until backward (2Ψ, more memory)."""

    prefetch_units: int = 1
    """Stage 3: how many units ahead to gather asynchronously, in forward and backward."""

    hpz: bool = False
    """Stage 3, ZeRO++'s hierarchical partitioning (hpZ, arXiv 2306.10209 §3.2): after a
    unit's forward all-gather over every rank, each rank keeps a secondary copy of the unit
    sharded over the ranks of its node, so that backward gathers inside the node only.
    Costs Ψ/ranks_per_node parameter bytes per rank between forward and backward (the
    ledger's `secondary_params`). Nodes are torchrun's (LOCAL_WORLD_SIZE); needs
    replicate_size=1 and reshard_after_forward=True. See docs/multinode.md."""

    quantize_weights: bool = False
    """Stage 3, ZeRO++'s qwZ: the parameter all-gathers send int8 codes with one fp32 scale
    per block of `quantize_block_size` elements instead of the compute dtype (a quarter of
    fp32's bytes, half of bf16's). Every rank computes with the same dequantized weights;
    the shards and the fp32 master are never quantized, only what is sent."""

    quantize_grads: Union[str, None] = None
    """Stage 3, ZeRO++'s qgZ: "int8" or "int4": each unit's gradients are reduce-scattered
    hierarchically, an all-to-all inside the node then one across nodes, each sending
    blockwise-quantized values and summing the dequantized ones in fp32 (one quantization
    error per level). None: the plain reduce-scatter. Nodes as for `hpz`."""

    quantize_block_size: int = 1024
    """Elements per quantization block of qwZ and qgZ; each block sends one fp32 scale
    (0.4% of the codes at 1024 int8) and its error is at most its largest |value| / 254
    (int8) or / 14 (int4)."""

    offload_optimizer: str = "none"
    """Stages 1-3, ZeRO-Offload: where the fp32 master and the optimizer states live and
    the optimizer steps. "none": beside the parameters. "host": in host memory (pinned on
    CUDA), the step on the CPU; gradients are copied down and the updated parameters up
    every step (docs/offload.md). On a CPU-only run host is the same memory, and the copies
    still happen, so the path is the one a GPU run takes. "disk" (ZeRO-Infinity; CPU runs):
    in files under `offload_dir`, streamed a bucket at a time."""

    offload_params: str = "none"
    """Stage 3, with `offload_optimizer` on: where each unit's parameter shard and gradient
    shard live between uses. "host" (pinned on CUDA) or "disk" (files under `offload_dir`,
    ZeRO-Infinity): each gather first copies the shard to the device, each reduced gradient
    chunk is copied back (docs/offload.md). "none": on the device."""

    offload_dir: Union[str, None] = None
    """offload_optimizer or offload_params "disk": an existing, writable directory on a local disk, one per
    run (each rank uses `rank{r}/` in it); its files are scratch, deleted at the end."""

    delayed_update_after: Union[int, None] = None
    """offload_optimizer="host", ZeRO-Offload's delayed parameter update (DPU): from this
    step on, each step's host update runs in the background, overlapping the next forward
    and backward, which then use the parameters from before it (each gradient is one update
    stale: this changes the maths; the synchronous steps first are the paper's warm-up).
    None: off. docs/offload.md."""

    tensor_parallel_size: int = 1
    """Megatron-style tensor parallelism inside each data-parallel rank (docs/tensor_parallel.md):
    the world is data-parallel x tensor-parallel, tensor-parallel groups are consecutive ranks
    (keep them inside a node), and ZeRO shards over the data-parallel ranks only. The model's
    attention and MLP projections, embedding and LM head are split by a plan (the bundled GPT's,
    or a Hugging Face model's own `base_model_tp_plan`). Must divide the world size."""

    partition_activations: bool = False
    """ZeRO-R's Pa (arXiv 1910.02054 §6.1): each activation checkpoint of a checkpointed layer
    (ours or Hugging Face's `gradient_checkpointing_enable()`) is kept as this rank's
    1/tensor_parallel_size slice and all-gathered over the tensor-parallel ranks just before its
    recomputation. The results are those without it, bit for bit."""

    activations_on_host: bool = False
    """ZeRO-R's Pa+cpu: the kept activation checkpoints (partitioned with
    `partition_activations`, else whole) live in host memory (pinned on CUDA) and are copied
    back ahead of their recomputation. Needs a checkpointed layer in the model."""

    expert_parallel_size: int = 1
    """Expert parallelism for mixture-of-experts models (docs/moe.md): each expert bank the
    model's plan names (its own `expert_parallel_plan`, or a Hugging Face config's
    `base_model_ep_plan`) is split by expert over groups of this many consecutive
    data-parallel ranks, and tokens travel to their experts' ranks and back with all-to-all;
    every rank still reads its own batch. ZeRO shards the expert banks over the N /
    expert_parallel_size ranks that hold the same experts and everything else over all N.
    Must divide the world size and each bank's number of experts; stages 1-3."""

    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism (docs/long_context.md): groups of this many consecutive ranks each read one
    batch and split its sequence, attention on head shards; ZeRO shards over all. Divides the world and heads."""

    tiled_loss: bool = False
    """A Hugging Face causal LM's logits and loss computed in sequence tiles, each recomputed in backward: no
    [tokens, vocab] logits at once ([Note: tiled logits and loss]); the output's logits are then None."""

    tiled_mlp: bool = False
    """Each layer's MLP computed in sequence tiles, each recomputed in backward: no [tokens, intermediate] at once
    ([Note: tiled MLP]); the results are unchanged. The tile size follows from the shapes, so it fits every length."""

    compile_units: bool = False
    """Compile the model with torch.compile, zerodp's hooks outside the compiled code
    (docs/compile.md): stage 3 compiles each unit's own forward (gathered, freed and reduced
    around it, eagerly); stages 0-2, whose hooks wrap only the model's call, its forward whole."""

    collective_timeout_s: float = 300.0
    """How long any of zerodp's collectives waits for the other ranks before every waiting
    rank raises an error naming the ranks that did not arrive and the collective each was
    last in ([Note: no silent hang] in distributed/failure.py); torch's default is 30
    minutes. Raise it for steps or checkpoint writes that keep a rank away longer (at most a
    year, MAX_TIMEOUT_S)."""

    debug: bool = False
    """Check on every gather that all ranks run the same unit (stage 3), raising an error
    that names the unit and the ranks instead of hanging; under tensor parallelism, check at
    every step that the parameters the plan did not split got the same gradient on every
    tensor-parallel rank (one that sees split activations would drift silently)."""

    def __post_init__(self) -> None:
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise bad_value("stage", self.stage, "use 0, 1, 2 or 3")
        if not is_one_of(self.mixed_precision, DTYPES):
            raise bad_value("mixed_precision", self.mixed_precision, f"use one of {sorted(DTYPES)}")
        if self.reduce_dtype is not None and not is_one_of(self.reduce_dtype, DTYPES):
            raise bad_value("reduce_dtype", self.reduce_dtype, f"use None or one of {sorted(DTYPES)}")
        if self.loss_scale != "dynamic":
            # inf would overflow every scaled gradient: each fp16 step skipped, silently, forever.
            check_positive_finite("loss_scale", self.loss_scale, 'use "dynamic" or a positive, finite number')
        if not is_one_of(self.nonfinite_grads, ("raise", "skip", "proceed")):
            raise bad_value("nonfinite_grads", self.nonfinite_grads, 'use "raise", "skip" or "proceed"')
        check_positive_finite("initial_loss_scale", self.initial_loss_scale, "use a positive, finite number")
        check_positive_int("loss_scale_growth_interval", self.loss_scale_growth_interval)
        check_positive_int("bucket_bytes", self.bucket_bytes)
        check_positive_int("grad_accumulation_steps", self.grad_accumulation_steps)
        if self.replicate_size != "nodes":
            check_positive_int("replicate_size", self.replicate_size)
        check_positive_int("unit_min_params", self.unit_min_params)
        check_positive_finite("collective_timeout_s", self.collective_timeout_s,
                         f"use a positive number of seconds, at most {MAX_TIMEOUT_S:,} (a year)",
                         at_most=MAX_TIMEOUT_S)
        if not isinstance(self.prefetch_units, int) or isinstance(self.prefetch_units, bool) or self.prefetch_units < 0:
            raise bad_value("prefetch_units", self.prefetch_units, "use an integer >= 0")
        check_flags(self, ("cast_buffers", "overlap_comm", "reduce_each_micro_batch", "reshard_after_forward", "debug",
                           "hpz", "quantize_weights", "compile_units", "tiled_loss", "tiled_mlp"))
        self._check_zeropp()
        self._check_tensor_parallel()
        self._check_expert_parallel()
        check_sequence_parallel(self)
        if not is_one_of(self.offload_optimizer, OFFLOAD_PLACES):
            raise bad_value("offload_optimizer", self.offload_optimizer, f"use one of {list(OFFLOAD_PLACES)}")
        if not is_one_of(self.offload_params, OFFLOAD_PLACES):
            raise bad_value("offload_params", self.offload_params, f"use one of {list(OFFLOAD_PLACES)}")
        if self.offload_params != "none" and self.stage != 3:
            raise bad_value("offload_params", self.offload_params, f"only stage 3 keeps parameter shards of its own "
                                                              f"(stage={self.stage}): use stage 3")
        if self.offload_params != "none" and self.offload_optimizer == "none":
            raise bad_value("offload_params", self.offload_params, "the optimizer steps where the shards are: set "
                                                              "offload_optimizer to 'host' or 'disk' as well")
        if "disk" in (self.offload_optimizer, self.offload_params) and not isinstance(self.offload_dir,
                                                                                     (str, os.PathLike)):
            raise bad_value("offload_dir", self.offload_dir, 'offload "disk" needs the directory for its '
                                                        'files: give a path')
        if isinstance(self.offload_dir, os.PathLike):  # kept as text: the Config is saved as JSON
            object.__setattr__(self, "offload_dir", os.fspath(self.offload_dir))
        if self.offload_optimizer != "none" and self.stage == 0:
            raise bad_value("offload_optimizer", self.offload_optimizer, "stage 0 (DDP) keeps no shard of its own to "
                                                                    "offload: use stage 1, 2 or 3")
        self._check_delayed_update()
        units = self.unit_modules
        if isinstance(units, (str, type)):
            units = (units,)
        if not isinstance(units, (list, tuple)) or not all(isinstance(u, (str, type)) for u in units):
            raise bad_value("unit_modules", self.unit_modules, "use a list of nn.Module classes or class names")
        object.__setattr__(self, "unit_modules", tuple(units))
        self._check_takes_effect()

    def _check_takes_effect(self) -> None:
        """[Note: no silent setting]
        A field set away from its default where the other fields leave it nothing to do is
        refused, naming what it needs: a setting accepted and then ignored reads as one in
        force. Defaults are never refused, so a saved `to_dict()` (every field, most at their
        defaults) loads again; a checkpoint reads only `mixed_precision` from its own."""
        for name, why, fix in self._without_effect():
            raise bad_value(name, getattr(self, name), f"{why}, so it would have no effect: {fix}, or leave it at "
                                                  f"{_DEFAULTS[name]!r}")

    def _without_effect(self):
        """(field, why, fix) for each field away from its default that nothing reads."""
        for name in (f for f, default in _DEFAULTS.items() if getattr(self, f) != default):
            if name in ("unit_modules", "unit_min_params", "reshard_after_forward", "prefetch_units") \
                    and self.stage != 3:
                yield name, f"only stage 3 gathers units (stage={self.stage})", "use stage=3"
            elif name == "unit_min_params" and self.unit_modules:
                yield name, "it picks units only when unit_modules is empty", "drop unit_modules"
            elif name in ("loss_scale", "initial_loss_scale", "loss_scale_growth_interval") \
                    and self.mixed_precision != "fp16":
                yield name, f"only fp16 scales the loss (mixed_precision={self.mixed_precision!r})", \
                    'use mixed_precision="fp16"'
            elif name in ("initial_loss_scale", "loss_scale_growth_interval") and self.loss_scale != "dynamic":
                yield name, f"only dynamic scaling changes the scale (loss_scale={self.loss_scale!r})", \
                    'use loss_scale="dynamic"'
            elif name == "nonfinite_grads" and self.mixed_precision == "fp16":
                yield name, "under fp16 the loss scaler skips every step with a nan/inf gradient and backs off", \
                    'use mixed_precision="bf16" or "fp32"'
            elif name == "reduce_each_micro_batch" and self.stage < 2:
                yield name, f"stages 0-1 always reduce once, at the accumulation boundary (stage={self.stage})", \
                    "use stage=2 or 3"
            elif name == "quantize_block_size" and not (self.quantize_weights or self.quantize_grads):
                yield name, "only qwZ and qgZ quantize in blocks", "set quantize_weights or quantize_grads"
            elif name == "offload_dir" and "disk" not in (self.offload_optimizer, self.offload_params):
                yield name, "only disk offload writes files", "set offload_optimizer or offload_params to 'disk'"
            elif name == "debug" and self.stage != 3 and self.tensor_parallel_size == 1:
                yield name, f"it checks stage 3's gathers and tensor parallelism's gradients, and neither runs " \
                            f"(stage={self.stage}, tensor_parallel_size=1)", "use stage=3 or tensor_parallel_size > 1"

    def _check_delayed_update(self) -> None:
        after = self.delayed_update_after
        if after is None:
            return
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise bad_value("delayed_update_after", after, "use None or a step number >= 0")
        if self.offload_optimizer != "host" or self.offload_params != "none":
            raise bad_value("delayed_update_after", after, "the delayed update runs the host optimizer beside the next "
                                                      "step, on its own copy of the gradients: set "
                                                      "offload_optimizer='host' and offload_params='none'")

    def _check_tensor_parallel(self) -> None:
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        for name in ("partition_activations", "activations_on_host"):
            if not isinstance(getattr(self, name), bool):
                raise bad_value(name, getattr(self, name), "use true or false")
        if self.tensor_parallel_size == 1:
            if self.partition_activations:
                raise bad_value("partition_activations", True, "it splits checkpoints over the tensor-parallel ranks, "
                                                          "and tensor_parallel_size=1 has one: set "
                                                          "tensor_parallel_size, or use activations_on_host alone")
            return
        if self.compile_units:
            raise bad_value("compile_units", True, "the tensor-parallel layers run their collectives inside the forward "
                                              "a compiled unit would trace: use compile_units=False, or "
                                              "tensor_parallel_size=1")
        # Offload, hybrid sharding and qwZ run beside it: a rank's shard of its slice goes to the
        # host or disk as any shard does, the data-parallel ranks form the replicate x shard mesh,
        # and qwZ's quantized gathers run on the shard axis alone (docs/tensor_parallel.md,
        # "Combinations"). hpZ and qgZ are refused, for the reason below.
        tp = f"tensor_parallel_size={self.tensor_parallel_size}"
        reasons = {"hpz": f"hpZ keeps a copy per node, and under {tp} the data-parallel group skips the "
                          f"tensor-parallel ranks, over which ZeRO++'s node axes are not built",
                   "quantize_grads": f"qgZ reduces node by node, and under {tp} the data-parallel group skips the "
                                     f"tensor-parallel ranks, over which ZeRO++'s node axes are not built"}
        for name, off in (("hpz", False), ("quantize_grads", None)):
            if getattr(self, name) != off:
                raise bad_value(name, getattr(self, name), f"{reasons[name]}; use {off!r}, or tensor_parallel_size=1")

    def _check_expert_parallel(self) -> None:
        check_positive_int("expert_parallel_size", self.expert_parallel_size)
        if self.expert_parallel_size == 1:
            return
        ep = f"expert_parallel_size={self.expert_parallel_size}"
        # What does not compose with expert parallelism yet, each with its reason (docs/moe.md).
        if self.stage == 0:
            raise bad_value("stage", 0, f"stage 0 all-reduces every gradient over all ranks, while under {ep} an "
                                        f"expert's gradient is reduced over the ranks that hold that expert: use "
                                        f"stage 1, 2 or 3")
        refuse_unless(self, [
            ("tensor_parallel_size", 1, f"tensor and expert parallelism over the same ranks are not built: use "
                                        f"tensor_parallel_size=1 with {ep}"),
            ("replicate_size", 1, f"hybrid sharding's replicate rows are not built beside the expert-parallel "
                                  f"groups: use replicate_size=1 with {ep}"),
            ("offload_optimizer", "none", f"the offloaded step is not built for the expert shards: use "
                                          f"offload_optimizer='none' with {ep}"),
            ("offload_params", "none", f"the offloaded shards are not built for the expert units: use "
                                       f"offload_params='none' with {ep}"),
            ("compile_units", False, f"the token dispatch reads each exchange's sizes on the host inside the "
                                     f"forward a compiled unit would trace: use compile_units=False with {ep}"),
            ("hpz", False, f"ZeRO++'s node axes are not built over the expert-data-parallel ranks: use "
                           f"hpz=False with {ep}"),
            ("quantize_weights", False, f"ZeRO++'s quantized gathers are not built for the expert units: use "
                                        f"quantize_weights=False with {ep}"),
            ("quantize_grads", None, f"ZeRO++'s node axes are not built over the expert-data-parallel ranks: use "
                                     f"quantize_grads=None with {ep}"),
        ])

    def _check_zeropp(self) -> None:
        if self.quantize_grads is not None and not is_one_of(self.quantize_grads, QUANTIZED_BITS):
            raise bad_value("quantize_grads", self.quantize_grads, f"use None or one of {sorted(QUANTIZED_BITS)}")
        check_positive_int("quantize_block_size", self.quantize_block_size)
        used = [n for n in ("hpz", "quantize_weights", "quantize_grads") if getattr(self, n) not in (False, None)]
        if used and self.stage != 3:
            raise bad_value(used[0], getattr(self, used[0]), f"ZeRO++ moves stage 3's gathers and reduce-scatters; with "
                                                        f"stage={self.stage} use stage 3 or leave it off")
        hierarchical = [n for n in ("hpz", "quantize_grads") if getattr(self, n) not in (False, None)]
        if hierarchical and self.replicate_size != 1:
            raise bad_value(hierarchical[0], getattr(self, hierarchical[0]),
                       f"with replicate_size={self.replicate_size!r} (hybrid sharding) the shard axis already stays "
                       f"inside a node: there is no cross-node gather or reduce-scatter to split; use one or the other")
        if self.hpz is True and self.reshard_after_forward is False:
            raise bad_value("hpz", True, "with reshard_after_forward=False backward gathers nothing (the unit stays "
                                    "gathered), so there is nothing for hpZ to keep inside the node")

    # -- derived values -------------------------------------------------------------
    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.mixed_precision]

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype] if self.reduce_dtype else self.compute_dtype

    @property
    def grad_quantization_bits(self):
        return QUANTIZED_BITS.get(self.quantize_grads)

    @property
    def uses_loss_scaling(self) -> bool:
        return self.mixed_precision == "fp16"

    # -- each component's part (policies.py) -------------------------------------------
    @property
    def precision(self) -> PrecisionPolicy:
        return PrecisionPolicy(self.mixed_precision, self.compute_dtype, self.grad_reduce_dtype, self.cast_buffers)

    @property
    def step_policy(self) -> StepPolicy:
        scaling = "none" if not self.uses_loss_scaling else "dynamic" if self.loss_scale == "dynamic" else "fixed"
        scale = {"none": 1.0, "dynamic": self.initial_loss_scale, "fixed": self.loss_scale}[scaling]
        return StepPolicy(scaling, float(scale), self.loss_scale_growth_interval, self.nonfinite_grads)

    @property
    def backward(self) -> BackwardPolicy:
        return BackwardPolicy(self.grad_accumulation_steps, self.reduce_each_micro_batch, self.overlap_comm,
                              self.bucket_bytes)

    @property
    def units(self) -> UnitPolicy:
        return UnitPolicy(self.unit_modules, self.unit_min_params, self.reshard_after_forward, self.prefetch_units,
                          self.debug)

    @property
    def offload(self) -> OffloadPolicy:
        return OffloadPolicy(self.offload_optimizer, self.offload_params, self.offload_dir, self.delayed_update_after)

    @property
    def zeropp(self) -> ZeroPPPolicy:
        return ZeroPPPolicy(self.hpz, 8 if self.quantize_weights else None, self.grad_quantization_bits,
                            self.quantize_block_size)

    @property
    def tensor_parallel(self) -> TensorParallelPolicy:
        return TensorParallelPolicy(self.tensor_parallel_size, self.partition_activations, self.activations_on_host)

    # -- loading --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Config":
        if not isinstance(values, Mapping):
            raise ConfigError(f"Config.from_dict needs a mapping of field names to values, got "
                              f"{type(values).__name__} {shown(values)}")
        known = {f.name for f in dataclasses.fields(cls)}
        # By text: a YAML mapping's keys may be numbers or null beside the names.
        unknown = sorted(set(values) - known, key=str)
        if unknown:
            raise ConfigError(f"Config has no field {shown(unknown[0])}: allowed fields are {sorted(known)}")
        return cls(**dict(values))

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike]) -> "Config":
        """Load a JSON (.json) or YAML (.yaml/.yml) file holding one mapping of fields. Every
        fault of its content is a ConfigError naming the file (and the field, where known)."""
        path = os.fspath(path)
        if not path.endswith((".json", ".yaml", ".yml")):
            raise ConfigError(f"Config file {path!r} has an unknown suffix: use .json, .yaml or .yml")
        kind = "JSON" if path.endswith(".json") else "YAML"
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is not content
        except UnicodeDecodeError as e:
            raise ConfigError(f"Config file {path!r} is not UTF-8 text ({e}): save it as UTF-8 {kind}") from None
        values = parse_config_text(text, kind, path)
        try:
            return cls.from_dict({} if values is None else values)
        except ConfigError as e:
            raise ConfigError(f"Config file {path!r}: {e}") from None

    @classmethod
    def from_deepspeed(cls, config: Union[str, os.PathLike, Mapping[str, Any]], **context):
        """A DeepSpeed JSON config (a dict or a path) as `(Config, outside)`: `outside` holds
        what the training loop applies itself (the clip norm, the optimizer and scheduler the
        file describes, the batch sizes, what each "auto" became). `context`: training_args,
        model, num_training_steps, world_size. Every key is mapped, accepted as having no
        effect (logged once) or refused by name: deepspeed_config/, docs/deepspeed.md."""
        # Imported here: the translation imports torch's optimizers, which a Config never needs.
        from .deepspeed_config import from_deepspeed

        return from_deepspeed(config, make_config=cls, **context)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["unit_modules"] = [u if isinstance(u, str) else u.__name__ for u in self.unit_modules]
        return out


# Every field's default: what _check_takes_effect never refuses.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
