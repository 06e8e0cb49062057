"""Hugging Face's Trainer with zerodp: change `from transformers import Trainer` to
`from zerodp.integrations.hf import Trainer` and give it a `zerodp_config`.

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
  which `resume_from_checkpoint` loads at any world size and stage.

Mixed precision comes from `TrainingArguments(bf16=True)` / `fp16=True` (mapped to
Config.mixed_precision); DeepSpeed, FSDP and torch.compile are refused.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

import torch
import transformers

from ..api import initialize
from ..checkpoint import full_state_dict, load, save
from ..config import Config, ConfigError
from ..optim import ZeroOptimizer

__all__ = ["Trainer", "CHECKPOINT_DIR"]

CHECKPOINT_DIR = "zerodp"  # inside each checkpoint-N folder
_SCHEDULER = "scheduler.pt"  # the Trainer's own name for it


class Trainer(transformers.Trainer):
    """transformers.Trainer, training with zerodp (see the module docstring)."""

    def __init__(self, *args, zerodp_config: Union[Config, dict, None] = None, **kwargs):
        config = Config.from_dict(zerodp_config) if isinstance(zerodp_config, dict) else (zerodp_config or Config())
        if not isinstance(config, Config):
            raise TypeError(f"zerodp_config must be a zerodp.Config or a dict, got {type(config).__name__}")
        self.zerodp_config = config
        super().__init__(*args, **kwargs)

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
            self.zerodp_config = dataclasses.replace(self.zerodp_config, mixed_precision=wanted)
        # The Trainer calls accelerator.backward(loss); zerodp's optimizer does the backward
        # (the fp16 loss scale, its accumulation window).
        self.accelerator.backward = self._zerodp_backward

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if isinstance(self.optimizer, ZeroOptimizer):
            return self.optimizer
        if self.lr_scheduler is not None:
            raise ValueError("Trainer(optimizers=(optimizer, scheduler)): the scheduler drives the plain optimizer, "
                             "which zerodp wraps. Pass optimizers=(optimizer, None) and let the Trainer build the "
                             "schedule (lr_scheduler_type), or override create_scheduler")
        plain = super().create_optimizer(model)
        config = dataclasses.replace(self.zerodp_config,
                                     grad_accumulation_steps=self.args.gradient_accumulation_steps)
        self.model, self.optimizer = initialize(self.model, lambda params: plain, config)
        # accelerate.prepare returns objects marked prepared unchanged: no DDP, no wrapper.
        self.model._is_accelerate_prepared = True
        self.optimizer._is_accelerate_prepared = True
        self.model_wrapped = self.model
        return self.optimizer

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
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        if not isinstance(self.optimizer, ZeroOptimizer):  # before training: a plain model
            return super().save_model(output_dir, _internal_call)
        state = full_state_dict(self.model, self.optimizer, rank0_only=True)  # every rank gathers
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        # The Trainer rotates its checkpoint folders itself: zerodp keeps every one it is given.
        save(os.path.join(output_dir, CHECKPOINT_DIR), self.model, self.optimizer)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    # -- resuming -------------------------------------------------------------------------------
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
        load(os.path.join(self.state.best_model_checkpoint, CHECKPOINT_DIR), self.model, self.optimizer)
