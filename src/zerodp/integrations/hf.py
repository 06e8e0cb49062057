"""Hugging Face's Trainer with zerodp: change `from transformers import Trainer` to
`from zerodp.integrations.hf import Trainer` and give it a `zerodp_config`. Any other
`transformers.Trainer` subclass (TRL's SFTTrainer, DPOTrainer, ...) gets the same with
`with_zerodp(SFTTrainer)`, a subclass that takes `zerodp_config` too.

The Trainer wires DeepSpeed and FSDP through accelerate; this subclass plugs zerodp into
the same seams, and leaves everything else (the data loaders, evaluation, logging, the
trainer state, RNG states, checkpoint rotation) to the Trainer:

- `create_optimizer`: the Trainer builds its optimizer as usual (its choice, its
  weight-decay groups), then `zerodp.initialize` shards the model in place and wraps that
  optimizer. Both are marked as prepared, so accelerate neither wraps the model in DDP nor
  the optimizer in its own wrapper.
- backward: the Trainer divides the loss by the accumulation steps itself (or normalises it
  by the window's token count), so the optimizer's backward does not divide again; the
  window's length is the Trainer's, which is shorter at the end of an epoch.
- clipping and the logged gradient norm come from the sharded optimizer (a norm over the
  shards, not over each rank's own gradients).
- checkpoints: `save_steps` folders get the full model (`model.safetensors`, loadable by
  `from_pretrained`) and, in `zerodp/`, zerodp's sharded checkpoint of model and optimizer,
  which `resume_from_checkpoint` loads at any world size and stage. A folder is written
  under a staging name and renamed `checkpoint-N` once every rank has written all of it, so
  a run killed while saving leaves no `checkpoint-N` half written; `resume_from_checkpoint=
  True` also passes over any folder that lacks what a complete one holds (from before).
  With `zerodp_async_save=True` zerodp's checkpoint is written in the background
  (`zerodp.save(..., asynchronous=True)`), and rank 0 renames the folder into place (and
  rotates) once it is committed, on the save's thread; the next save, the best model's load
  and the end of `train` wait for it. Opt-in, because until then `checkpoint-N` does not
  exist: a callback's `on_save` that reads it would find nothing, and `push_to_hub`, which
  uploads the folder inside `_save_checkpoint`, is refused with it.
- tensor parallelism (`Config.tensor_parallel_size`): the ranks of a tensor-parallel group
  compute one model on one batch, so the data loaders hand out batches by data-parallel
  rank and size (each group reads what one rank of a DDP run of its size reads), the loss
  is scaled and token counts divided by the data-parallel size, and evaluation gathers one
  copy of each group's outputs. Its checkpoints are zerodp's under tensor parallelism
  (every process takes part in the staging and commit barriers).
- sequence parallelism (`Config.sequence_parallel_size`): as tensor parallelism, a group reads
  one batch (the loaders, token counts and evaluation's gathering above), so the Trainer's
  `num_items_in_batch` is the whole sequences' count of labelled tokens; a data collator that
  pads to a multiple (`pad_to_multiple_of`: transformers' and TRL's) pads to one of k, which
  leaves the loss unchanged; packed (padding-free) batches are split as
  sequence_parallel/inputs.py says, and TRL's per-token outputs come back whole; compute_metrics
  is refused (each rank's logits are its slice of the sequence).

Mixed precision comes from `TrainingArguments(bf16=True)` / `fp16=True` (mapped to
Config.mixed_precision); FSDP and torch.compile are refused.

A DeepSpeed config trains with zerodp through this module's `TrainingArguments`
(`deepspeed=` as transformers takes it: a dict or a JSON path). transformers'
TrainingArguments hands `deepspeed=` to accelerate's DeepSpeedPlugin in its `__post_init__`,
which imports DeepSpeed and has it initialise the process group; the subclass takes the
config out before that runs (keeping it as `zerodp_deepspeed`), so DeepSpeed is neither
needed nor started. The Trainer translates it with `Config.from_deepspeed` (the HF Trainer's
"auto" values from these arguments and the model's hidden size; a value that contradicts the
arguments refused, as transformers refuses it), builds the optimizer of its `optimizer` block
over every trainable parameter and the scheduler of its `scheduler` block, as DeepSpeed does
(deepspeed_config/). A plain transformers TrainingArguments with `deepspeed=` has
started DeepSpeed already and is refused, naming this class.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
import shutil
from typing import Any, Optional, Union

import torch
import transformers
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard
from accelerate.utils import gather_object, recursively_apply
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..api import initialize
from ..checkpoint import AsyncSave, full_state_dict, load, save, wait_for_saves
from ..checkpoint.files import fsync
from ..checkpoint.format import COMPLETE
from ..checkpoint.tp_pieces import ranks_of
from ..config import Config, ConfigError
from ..optim import ZeroOptimizer
from ..deepspeed_config import load_json as load_deepspeed_json
from .rl import install_trl_seams

log = logging.getLogger(__name__)

__all__ = ["Trainer", "TrainingArguments", "ZeroTrainerMixin", "CHECKPOINT_DIR", "STAGING_DIR",
           "last_complete_checkpoint", "with_zerodp"]

CHECKPOINT_DIR = "zerodp"  # inside each checkpoint-N folder
STAGING_DIR = ".zerodp-staging"  # inside the output dir: checkpoint-N while it is written
_SCHEDULER = "scheduler.pt"  # the Trainer's own name for it
_TRAINER_STATE = "trainer_state.json"  # written last of the Trainer's own files
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def last_complete_checkpoint(output_dir: str) -> Optional[str]:
    """The `checkpoint-N` folder of `output_dir` with the largest N that is complete: the
    Trainer's state written, and zerodp's checkpoint (if it has one) committed. Folders that
    are not are passed over, with a warning (a run killed while saving, before saves were
    atomic)."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        match = _CHECKPOINT_NAME.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    for _, path in sorted(found, reverse=True):
        zerodp_dir = os.path.join(path, CHECKPOINT_DIR)
        if os.path.isfile(os.path.join(path, _TRAINER_STATE)) and (
                not os.path.isdir(zerodp_dir) or os.path.isfile(os.path.join(zerodp_dir, COMPLETE))):
            return path
        log.warning("%s is incomplete (no %s, or zerodp/ without %s): not resuming from it", path, _TRAINER_STATE,
                    COMPLETE)
    return None


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' TrainingArguments whose `deepspeed=` (a DeepSpeed config: a dict or a JSON
    path) zerodp's Trainer translates instead of starting DeepSpeed (see the module docstring)."""

    zerodp_deepspeed: Union[dict, str, None] = dataclasses.field(
        default=None, metadata={"help": "The DeepSpeed config given as deepspeed=, for zerodp's Trainer."})

    def __post_init__(self):
        if self.deepspeed:
            self.zerodp_deepspeed, self.deepspeed = self.deepspeed, None
        super().__post_init__()


def _deepspeed_translation(training_args, model, zerodp_config):
    """The (Config, Outside) of `training_args`' DeepSpeed config, or None without one."""
    if getattr(training_args, "deepspeed", None):
        raise ConfigError("TrainingArguments(deepspeed=...) from transformers has started DeepSpeed already (its "
                          "__post_init__ builds accelerate's DeepSpeedPlugin): build the arguments with "
                          "zerodp.integrations.hf.TrainingArguments(deepspeed=...), which zerodp translates")
    source = getattr(training_args, "zerodp_deepspeed", None)
    if not source:
        return None
    if zerodp_config is not None:
        raise ConfigError("both zerodp_config and TrainingArguments(deepspeed=...): give one of them")
    without_scheduler = {k: v for k, v in load_deepspeed_json(source).items() if k != "scheduler"}
    return Config.from_deepspeed(without_scheduler, training_args=training_args, model=model)


class ZeroTrainerMixin:
    """What zerodp changes in a `transformers.Trainer` (see the module docstring); it comes
    before the Trainer class in the bases, as `with_zerodp` puts it."""

    def __init__(self, *args, zerodp_config: Union[Config, dict, None] = None, zerodp_async_save: bool = False,
                 **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        deepspeed = _deepspeed_translation(training_args, kwargs.get("model", args[0] if args else None),
                                           zerodp_config)
        self._deepspeed_outside = deepspeed.outside if deepspeed is not None else None
        if deepspeed is not None:
            zerodp_config = deepspeed.config
        config = Config.from_dict(zerodp_config) if isinstance(zerodp_config, dict) else (zerodp_config or Config())
        if not isinstance(config, Config):
            raise TypeError(f"zerodp_config must be a zerodp.Config or a dict, got {type(config).__name__}")
        self.zerodp_config = config
        self._staging = False  # _save_checkpoint in progress: the output dir is the staging one
        self.zerodp_async_save = bool(zerodp_async_save)
        self._in_flight: Optional[AsyncSave] = None  # zerodp's save of the last _save_checkpoint, if asynchronous
        super().__init__(*args, **kwargs)
        if self.zerodp_async_save and self.args.push_to_hub:
            raise ValueError("zerodp_async_save=True with push_to_hub: the Trainer uploads a checkpoint folder while "
                             "it is saved, before an asynchronous save is on disk; use one or the other")
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        tp, world = self._one_batch_group(), self.args.world_size
        if tp == 1:
            return
        field = "tensor_parallel_size" if self.zerodp_config.tensor_parallel_size > 1 else "sequence_parallel_size"
        if world % tp:
            raise ConfigError(f"zerodp_config.{field}={tp} does not divide the {world} processes of "
                              f"this run: launch a multiple of {tp} processes, or choose a size that divides {world}")
        if field == "sequence_parallel_size" and self.compute_metrics is not None:
            raise ConfigError(f"zerodp_config.sequence_parallel_size={tp} with compute_metrics: each rank's logits "
                              f"are its slice of the sequence, and gathering them whole is not built: evaluate the "
                              f"loss only (compute_metrics=None)")
        if field == "sequence_parallel_size":
            self._pad_to_multiple_of(tp)

    def _pad_to_multiple_of(self, k: int) -> None:
        """Every batch's length must divide by k under sequence parallelism ([Note:
        sequence-parallel inputs]): a collator that pads to a multiple pads to one of k too. Its
        padding carries labels -100 and attention_mask 0 (padding-free: positions 0, each a
        sample of its own), so the loss is the same; other collators' lengths are checked at
        the forward, which names the fix."""
        collator = self.data_collator
        if not hasattr(collator, "pad_to_multiple_of"):
            return
        wanted = math.lcm(collator.pad_to_multiple_of or 1, k)
        if wanted != collator.pad_to_multiple_of:
            log.info("sequence_parallel_size=%d: %s pads to a multiple of %d tokens", k, type(collator).__name__,
                     wanted)
            collator.pad_to_multiple_of = wanted

    # -- tensor and sequence parallelism: one batch per group --------------------------------------
    def _one_batch_group(self) -> int:
        """Consecutive ranks that read one batch: a tensor-parallel group, or a
        sequence-parallel one ([Note: sequence-parallel inputs]; the two are not combined)."""
        return self.zerodp_config.tensor_parallel_size * self.zerodp_config.sequence_parallel_size

    def get_tp_size(self) -> int:
        """The Trainer divides its token counts and scales the loss by this: the ranks of a
        tensor- or sequence-parallel group see one batch."""
        return self._one_batch_group()

    def _data_parallel_place(self) -> tuple[int, int]:
        """(rank, size) among the groups that read their own batch: tensor- or sequence-parallel
        groups are consecutive ranks (zerodp's [Note: tensor-parallel axis]), so global rank =
        dp rank x group size + place in the group."""
        tp = self._one_batch_group()
        return self.args.process_index // tp, self.args.world_size // tp

    def _get_dataloader(self, *args, **kwargs):
        loader = super()._get_dataloader(*args, **kwargs)
        if self._one_batch_group() > 1:
            self._shard_by_data_parallel_rank(loader)
        return loader

    def _shard_by_data_parallel_rank(self, loader) -> None:
        """accelerate hands each process its share of the batches by process index; under
        tensor parallelism the share is the data-parallel rank's, the same on every rank of a
        tensor-parallel group (as the Trainer does itself for a sampler already rank-aware)."""
        rank, size = self._data_parallel_place()
        if isinstance(loader, DataLoaderDispatcher):
            raise ConfigError("zerodp_config.tensor_parallel_size > 1 with accelerate's dispatch_batches (the default "
                              "for an iterable dataset): every rank of a tensor-parallel group must read the same "
                              "batch: pass TrainingArguments(accelerator_config={'dispatch_batches': False}) or a "
                              "map-style dataset")
        candidates = (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None),
                      getattr(loader, "dataset", None))
        shards = [s for s in candidates if isinstance(s, (BatchSamplerShard, IterableDatasetShard))]
        if not shards:
            raise ConfigError(f"zerodp_config.tensor_parallel_size > 1: the data loader over a "
                              f"{type(loader.dataset).__name__} is not sharded by accelerate's samplers, so zerodp "
                              f"cannot hand each tensor-parallel group one batch: use a map-style dataset or a torch "
                              f"IterableDataset (a datasets.IterableDataset is split by process before zerodp sees it)")
        for shard in shards:
            shard.num_processes, shard.process_index = size, rank
            if size == 1 and isinstance(shard, BatchSamplerShard):
                # One data-parallel rank reads as one process does, where accelerate does not
                # shard: its last batch short, not filled up from the start.
                shard.even_batches = False

    def _gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """accelerate's gather_for_metrics with one copy of each tensor-parallel group's
        outputs: every rank of a group evaluated the same batch. The last batch is then cut to
        the dataset's remainder, as accelerate does (its remainder is counted over the
        data-parallel ranks, by the samplers above)."""
        tp = self._one_batch_group()
        gathered = gather_object(input_data) if use_gather_object else self.accelerator.gather(input_data)

        def one_per_group(x):
            chunk = len(x) // self.args.world_size
            return [v for i in range(0, len(x), chunk * tp) for v in x[i:i + chunk]] if isinstance(x, list) else \
                x.reshape(self.args.world_size, chunk, *x.shape[1:])[::tp].reshape(-1, *x.shape[1:])

        data = one_per_group(gathered) if use_gather_object else recursively_apply(one_per_group, gathered)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = data[:state.remainder] if use_gather_object else recursively_apply(
                lambda x: x[:state.remainder], data)
        return data

    # -- setup -----------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        for flag, what in ((self.is_deepspeed_enabled, "DeepSpeed"), (self.is_fsdp_enabled, "FSDP"),
                           (self.args.torch_compile, "torch_compile")):
            if flag:
                raise ValueError(f"zerodp's Trainer shards the model itself: remove {what} from the "
                                 f"TrainingArguments")
        wanted = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else None
        if wanted is not None and self.zerodp_config.mixed_precision not in ("fp32", wanted):
            raise ConfigError(f"TrainingArguments asks for {wanted} and zerodp_config.mixed_precision is "
                              f"{self.zerodp_config.mixed_precision!r}: set one of them")
        if wanted is not None:
            try:
                self.zerodp_config = dataclasses.replace(self.zerodp_config, mixed_precision=wanted)
            except ConfigError as e:  # a setting of the Config has no effect at the Trainer's precision
                raise ConfigError(f"TrainingArguments({wanted}=True) sets zerodp_config.mixed_precision={wanted!r}, "
                                  f"and then {e}") from None
        # The Trainer calls accelerator.backward(loss); zerodp's optimizer does the backward
        # (the fp16 loss scale, its accumulation window).
        self.accelerator.backward = self._zerodp_backward
        if self._one_batch_group() > 1:  # evaluation resets gather_function to this
            self.accelerator.gather_for_metrics = self._gather_for_metrics
            self.gather_function = functools.partial(self._gather_for_metrics,
                                                     use_gather_object=self.args.eval_use_gather_object)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if isinstance(self.optimizer, ZeroOptimizer):
            return self.optimizer
        if self.lr_scheduler is not None:
            raise ValueError("Trainer(optimizers=(optimizer, scheduler)): the scheduler drives the plain optimizer, "
                             "which zerodp wraps. Pass optimizers=(optimizer, None) and let the Trainer build the "
                             "schedule (lr_scheduler_type), or override create_scheduler")
        described = self._deepspeed_outside.optimizer if self._deepspeed_outside is not None else None
        if described is not None:  # DeepSpeed's optimizer block: every trainable parameter, one group
            plain = described(p for p in self.model.parameters() if p.requires_grad)
        else:
            plain = super().create_optimizer(model)
        # The Trainer's no-decay group is empty when only weights train (LoRA adapters):
        # zerodp refuses an empty group, which elsewhere means a mistake.
        plain.param_groups = [g for g in plain.param_groups if g["params"]]
        config = dataclasses.replace(self.zerodp_config,
                                     grad_accumulation_steps=self.args.gradient_accumulation_steps)
        self.model, self.optimizer = initialize(self.model, lambda params: plain, config)
        # accelerate.prepare returns objects marked prepared unchanged: no DDP, no wrapper.
        self.model._is_accelerate_prepared = True
        self.optimizer._is_accelerate_prepared = True
        self.model_wrapped = self.model
        install_trl_seams(self)  # an online trainer's rollouts and weight sync: integrations/rl.py
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        source = getattr(self.args, "zerodp_deepspeed", None)
        block = load_deepspeed_json(source).get("scheduler") if source and self.lr_scheduler is None else None
        if block is None:
            return super().create_scheduler(num_training_steps, optimizer)
        # Its "auto" values need the run's length, known only now.
        outside = Config.from_deepspeed({"scheduler": block}, training_args=self.args,
                                        num_training_steps=num_training_steps).outside
        self.lr_scheduler = outside.scheduler(optimizer if optimizer is not None else self.optimizer)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    # -- one step -----------------------------------------------------------------------------
    def _zerodp_backward(self, loss: torch.Tensor, **kwargs) -> None:
        if self.optimizer.grad_sync.micro_step == 0:  # a window begins: the Trainer says how long
            self.optimizer.accumulation_steps = int(getattr(self, "current_gradient_accumulation_steps",
                                                            self.args.gradient_accumulation_steps))
        self.optimizer.backward(loss, scale_wrt_accumulation=False)

    def _clip_grad_norm(self, model):
        return self.optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.optimizer.clip_grad_norm_(float("inf"))
        return float(grad_norm)

    # -- saving ---------------------------------------------------------------------------------
    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, STAGING_DIR) if self._staging else run_dir

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, as atomic as zerodp.save: every rank writes into
        `STAGING_DIR/checkpoint-N`, which is renamed `checkpoint-N` once all of them are done;
        the Trainer's rotation then runs on the output dir."""
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final, staging = os.path.join(run_dir, name), os.path.join(run_dir, STAGING_DIR, name)
        comm = ranks_of(self.optimizer)  # every process: under tensor parallelism more than the data-parallel ranks
        wait_for_saves()  # the previous folder is in place before anything is staged again
        if self.args.should_save and os.path.exists(staging):  # left by a run killed while saving it
            shutil.rmtree(staging)
        comm.all_gather_object(None, label="Trainer checkpoint staging")  # a barrier
        self._staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = False
        best = self.state.best_model_checkpoint
        renamed = best is not None and os.path.dirname(best) == os.path.dirname(staging)  # the staging name, seen
        if renamed:
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
        comm.all_gather_object(None, label="Trainer checkpoint written")
        in_flight, self._in_flight = self._in_flight, None
        if self.args.should_save:
            if renamed:
                self.state.save_to_json(os.path.join(staging, _TRAINER_STATE))
            if in_flight is not None:  # in place once zerodp's checkpoint in it is committed
                in_flight.add_done_callback(lambda _: self._commit_checkpoint(staging, final, run_dir))
            else:
                self._commit_checkpoint(staging, final, run_dir)
        comm.all_gather_object(None, label="Trainer checkpoint committed")

    def _commit_checkpoint(self, staging: str, final: str, run_dir: str) -> None:
        """Rename the staged folder into place (a folder of the same step from an earlier run
        goes first), then rotate as the Trainer would have."""
        if os.path.exists(final):
            old = os.path.join(run_dir, STAGING_DIR, f"replaced-{os.path.basename(final)}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            shutil.rmtree(old)
        os.replace(staging, final)
        fsync(run_dir)  # the rename is durable
        shutil.rmtree(os.path.join(run_dir, STAGING_DIR), ignore_errors=True)  # saves run one at a time
        rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        if not isinstance(self.optimizer, ZeroOptimizer):  # before training: a plain model
            return super().save_model(output_dir, _internal_call)
        # Every rank gathers; a PEFT model writes its adapters only, so its frozen base is not gathered.
        state = full_state_dict(self.model, self.optimizer, rank0_only=True,
                                frozen_values="embeddings" if hasattr(self.model, "peft_config") else True)
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        # The Trainer rotates its checkpoint folders itself: zerodp keeps every one it is given.
        path = os.path.join(output_dir, CHECKPOINT_DIR)
        if self.zerodp_async_save and self._staging:
            self._in_flight = save(path, self.model, self.optimizer, asynchronous=True)
        else:
            save(path, self.model, self.optimizer)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    # -- resuming -------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: Union[str, bool, None] = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint is True:  # the last checkpoint-N that is complete, not merely the last
            found = last_complete_checkpoint(self.args.output_dir)
            if found is None:
                raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint-N folder in "
                                 f"{self.args.output_dir}: pass the path of one, or start without resuming")
            resume_from_checkpoint = found
        result = super().train(resume_from_checkpoint, *args, **kwargs)
        self._saves_in_place()  # the last checkpoint is on disk, and in place, when train returns
        return result

    def _saves_in_place(self) -> None:
        """Wait for the asynchronous save in flight and, on every rank, for rank 0's rename of
        its folder into place (a done-callback on rank 0 only)."""
        wait_for_saves()
        if self.zerodp_async_save and isinstance(self.optimizer, ZeroOptimizer):
            ranks_of(self.optimizer).all_gather_object(None, label="Trainer checkpoint in place")  # a barrier

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)):
            return  # the weights come with zerodp's checkpoint, once the model is sharded
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # a plain HF checkpoint

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{checkpoint} holds no zerodp checkpoint ({CHECKPOINT_DIR}/): it was not saved "
                                    f"by zerodp's Trainer, so its optimizer state cannot be resumed")
        load(path, self.model, self.optimizer)
        scheduler = os.path.join(checkpoint, _SCHEDULER)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        self._saves_in_place()  # the best checkpoint may be the one rank 0 is still renaming
        load(os.path.join(self.state.best_model_checkpoint, CHECKPOINT_DIR), self.model, self.optimizer)


def with_zerodp(trainer_class: type) -> type:
    """`trainer_class` (a transformers.Trainer subclass: TRL's SFTTrainer, DPOTrainer, ...)
    training with zerodp: a subclass that takes `zerodp_config` and `zerodp_async_save`."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"with_zerodp takes a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, ZeroTrainerMixin):
        return trainer_class
    return type(f"Zero{trainer_class.__name__}", (ZeroTrainerMixin, trainer_class),
                {"__module__": trainer_class.__module__, "__doc__": f"{trainer_class.__name__} training with zerodp."})


Trainer = with_zerodp(transformers.Trainer)
Trainer.__name__ = Trainer.__qualname__ = "Trainer"
Trainer.__module__ = __name__
