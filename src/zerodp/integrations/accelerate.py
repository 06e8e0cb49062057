"""Hugging Face Accelerate's custom loops with zerodp: change `from accelerate import
Accelerator` to `from zerodp.integrations.accelerate import Accelerator` and give it a
`zerodp_config`. The loop stays as accelerate's examples write it (transformers'
run_clm_no_trainer.py):

    accelerator = Accelerator(gradient_accumulation_steps=2, zerodp_config=zerodp.Config(stage=3))
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate)
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, ...)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler)
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()
    accelerator.save_state(output_dir)   # later: accelerator.load_state(output_dir)

What changes under the subclass, at accelerate's own seams:

- `prepare`: each optimizer goes to `zerodp.initialize` with its model (the model is sharded
  in place, the optimizer's groups, hyperparameters and state carried over), and comes back
  as accelerate's `AcceleratedOptimizer` over zerodp's optimizer (its `step` and `zero_grad`
  act at the accumulation boundary only, as accelerate's do). The model is never wrapped in
  DDP: zerodp reduces its gradients. An LR scheduler in the same call, built on the script's
  optimizer, is re-pointed to zerodp's ([Note: a scheduler built before initialize] in schedulers.py).
- `backward`: the loss divided by the accumulation steps, as accelerate divides it, then
  zerodp's optimizer's backward (the fp16 loss scale where there is one).
- `accumulate` / `no_sync`: the model's DDP-style `no_sync()` (zerodp installs it) on every
  micro-batch before the boundary, in one process too (accelerate calls it only when
  distributed), so the boundary backward is the one that reduces.
- `clip_grad_norm_` over a zerodp model's parameters: zerodp's norm over the shards (exact at
  every stage, unscaled under fp16).
- `save_state` / `load_state`: the model and optimizer through `zerodp.save` / `zerodp.load`
  (`zerodp/` inside the folder: sharded, loadable at another world size and stage), and
  accelerate's own files for the rest (schedulers, samplers, RNG states, the step, custom
  objects); the folder is written under a staging name and renamed into place once every
  rank is done, so a crash while saving never leaves a folder that resumes half old, half new.
- `get_state_dict` (and so `save_model`): the whole model, gathered (`zerodp.full_state_dict`).

Mixed precision: `Accelerator(mixed_precision="bf16" / "fp16")` becomes
`Config.mixed_precision` (zerodp computes in bf16/fp16 with fp32 masters, no autocast).
DeepSpeed, FSDP, Megatron-LM, accelerate's tensor/context parallelism and its torch.compile
(`dynamo_backend`) are refused: zerodp shards the model itself (`Config(compile_units=True)`
compiles). The plain `accelerate.Accelerator` refuses a model zerodp.initialize returned
(`api.RefuseDDP`): it would wrap it in DDP.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from typing import Optional, Union

import accelerate
import torch
import torch.nn as nn
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from ..api import RefuseDDP, initialize
from ..checkpoint import full_state_dict, load, save
from ..checkpoint.files import fsync, fsync_dir
from ..checkpoint.format import COMPLETE
from ..config import Config, ConfigError
from ..optim import ZeroOptimizer
from .schedulers import drop_scheduler_mark, move_schedulers, scheduler_wrapped_step, schedulers_of

log = logging.getLogger(__name__)

__all__ = ["Accelerator", "ZeroAcceleratedOptimizer", "CHECKPOINT_DIR", "STAGING_DIR"]

CHECKPOINT_DIR = "zerodp"  # inside a save_state folder: the first model's; "zerodp_1" ... for the next
STAGING_DIR = ".zerodp-staging"  # beside the folders save_state writes: a folder while it is written


def _checkpoint_name(index: int) -> str:
    return CHECKPOINT_DIR if index == 0 else f"{CHECKPOINT_DIR}_{index}"


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper over zerodp's optimizer (`.optimizer`): `step()` and
    `zero_grad()` act at the accumulation boundary only, as accelerate's do; a step zerodp
    skipped (an fp16 overflow, a non-finite gradient under `nonfinite_grads="skip"`) is
    reported, so accelerate's scheduler does not advance."""

    def __init__(self, optimizer: ZeroOptimizer):
        super().__init__(optimizer, device_placement=False, scaler=None)

    @property
    def step_was_skipped(self) -> bool:
        return self.optimizer.step_was_skipped

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.optimizer.clip_grad_norm_(max_norm, norm_type)


class Accelerator(accelerate.Accelerator):
    """accelerate's Accelerator with zerodp sharding the models it prepares with their
    optimizers (see the module docstring); every other argument is accelerate's."""

    def __init__(self, *args, zerodp_config: Union[Config, dict, None] = None, **kwargs):
        config = Config.from_dict(zerodp_config) if isinstance(zerodp_config, dict) else (zerodp_config or Config())
        if not isinstance(config, Config):
            raise TypeError(f"zerodp_config must be a zerodp.Config or a dict, got {type(config).__name__}")
        super().__init__(*args, **kwargs)
        self._refuse_other_sharding(config)
        self.zerodp_config = self._with_accelerate_precision(config)
        # zerodp computes in the Config's precision (no autocast) and scales fp16 losses itself.
        self.native_amp, self.scaler = False, None
        self._zerodp: list[tuple[nn.Module, ZeroOptimizer]] = []  # (model, its optimizer), in prepare order

    def _refuse_other_sharding(self, config: Config) -> None:
        other = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.FSDP: "FSDP",
                 DistributedType.MEGATRON_LM: "Megatron-LM", DistributedType.XLA: "XLA"}.get(self.distributed_type)
        parallel = self.parallelism_config
        if other is None and parallel is not None and (parallel.tp_enabled or parallel.cp_enabled):
            other = "parallelism_config (tensor or context parallelism)"
        if other is None and self.state.dynamo_plugin.backend != accelerate.utils.DynamoBackend.NO:
            other = "dynamo_backend (torch.compile of the whole model; zerodp's is Config(compile_units=True))"
        if other is None and self.fp8_enabled:
            other = "mixed_precision='fp8'"
        if other is not None:
            raise ValueError(f"zerodp's Accelerator shards the model itself: remove {other} from the accelerate "
                             f"configuration")
        if config.tensor_parallel_size > 1:
            raise ConfigError("zerodp_config.tensor_parallel_size > 1 is not supported by zerodp's Accelerator: its "
                              "data loaders hand each process its own batches (use zerodp.integrations.hf.Trainer "
                              "or zerodp.initialize in your own loop)")
        if config.grad_accumulation_steps != 1:
            raise ConfigError(f"zerodp_config.grad_accumulation_steps={config.grad_accumulation_steps}: under "
                              f"accelerate the window is the Accelerator's; pass Accelerator("
                              f"gradient_accumulation_steps={config.grad_accumulation_steps}) and leave the "
                              f"Config's at 1")

    def _with_accelerate_precision(self, config: Config) -> Config:
        wanted = {"bf16": "bf16", "fp16": "fp16"}.get(str(self.mixed_precision))
        if wanted is None:
            return config
        if config.mixed_precision not in ("fp32", wanted):
            raise ConfigError(f"Accelerator(mixed_precision={wanted!r}) and zerodp_config.mixed_precision="
                              f"{config.mixed_precision!r}: set one of them")
        try:
            return dataclasses.replace(config, mixed_precision=wanted)
        except ConfigError as e:
            raise ConfigError(f"Accelerator(mixed_precision={wanted!r}) sets zerodp_config.mixed_precision="
                              f"{wanted!r}, and then {e}") from None

    # -- prepare ---------------------------------------------------------------------------------
    def _zerodp_optimizer(self, model: nn.Module) -> Optional[ZeroOptimizer]:
        return next((opt for m, opt in self._zerodp if m is model), None)

    def prepare(self, *args, device_placement=None):
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(f"`device_placement` should be a list with {len(args)} elements (the number of "
                             f"objects passed).")
        args = list(args)
        # Every model of the call is known before any optimizer is sharded, whatever the order.
        models = [a for a in args if isinstance(a, nn.Module)]
        models += [m for m in self._models if not any(m is a for a in models)]
        schedulers = [a for a in args if isinstance(a, torch.optim.lr_scheduler.LRScheduler)]
        for i, obj in enumerate(args):
            if isinstance(obj, torch.optim.Optimizer) and not getattr(obj, "_is_accelerate_prepared", False):
                args[i] = self._shard(obj, models, schedulers, device_placement[i])
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False):
        self._keep_out_of_ddp(model, device_placement)
        return super().prepare_model(model, device_placement, evaluation_mode)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None):
        if not getattr(optimizer, "_is_accelerate_prepared", False):  # called on its own: its model came before
            optimizer = self._shard(optimizer, list(self._models), [], device_placement)
        return super().prepare_optimizer(optimizer, device_placement)

    def _keep_out_of_ddp(self, model: nn.Module, place: Optional[bool]) -> None:
        """A model prepared without its optimizer: on the device and left as it is, never in
        DDP (its optimizer, in this call or a later one, shards it in place)."""
        if getattr(model, "_is_accelerate_prepared", False):
            return
        if isinstance(getattr(model, "_ddp_params_and_buffers_to_ignore", None), RefuseDDP):
            raise ValueError(f"this {type(model).__name__} was passed to zerodp.initialize without this Accelerator: "
                             f"pass it to prepare with the optimizer initialize returned, or pass the plain model "
                             f"with its plain optimizer and let prepare initialize it")
        if any(p.requires_grad for p in model.parameters()):
            log.info("rank %d: %s prepared without an optimizer: placed on %s, not sharded until its optimizer is "
                     "prepared", self.process_index, type(model).__name__, self.device)
        self._place(model, place)
        model._is_accelerate_prepared = True

    def _place(self, model: nn.Module, place: Optional[bool]) -> None:
        if (self.device_placement if place is None else place) and not getattr(model, "hf_device_map", None):
            model.to(self.device)

    def _shard(self, optimizer: torch.optim.Optimizer, models: list, schedulers: list,
               place: Optional[bool]) -> ZeroAcceleratedOptimizer:
        """zerodp.initialize over `optimizer` and the model whose parameters it holds."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        model = next((m for m in models if params & {id(p) for p in m.parameters()}), None)
        if model is None:
            raise ValueError(f"the {type(optimizer).__name__} passed to prepare holds parameters of no model given to "
                             f"this Accelerator: pass the model and its optimizer to prepare together")
        if isinstance(optimizer, ZeroOptimizer):  # the script ran zerodp.initialize itself
            zero = optimizer
        else:
            own = [s for sched in schedulers for s in schedulers_of(sched) if s.optimizer is optimizer]
            if scheduler_wrapped_step(optimizer) is not None and not own:
                raise ValueError(f"an LR scheduler was built on this {type(optimizer).__name__} and is not in this "
                                 f"prepare call: pass it to the same accelerator.prepare(...) call, which points it at "
                                 f"zerodp's optimizer")
            if getattr(model, "_is_accelerate_prepared", False) and not any(model is m for m in self._models):
                raise ValueError(f"this {type(model).__name__} was prepared by another Accelerator")
            if self._zerodp and self.zerodp_config.mixed_precision == "fp16":
                raise ConfigError("fp16 loss scaling with a second zerodp model under one Accelerator: backward "
                                  "scales the loss by one optimizer's scale; train both under one optimizer (its "
                                  "param groups), or use bf16")
            self._place(model, place)
            wrapped = drop_scheduler_mark(optimizer)  # [Note: a scheduler built before initialize]
            try:
                model, zero = initialize(model, optimizer, self.zerodp_config)
            except BaseException:
                if wrapped is not None:
                    optimizer.step = wrapped
                raise
            move_schedulers(own, optimizer, zero)  # zerodp's param groups are the script's, in order
        model._is_accelerate_prepared = True
        self._zerodp.append((model, zero))
        wrapper = ZeroAcceleratedOptimizer(zero)
        wrapper._is_accelerate_prepared = True
        return wrapper

    # -- one step ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if not self._zerodp:
            return super().backward(loss, **kwargs)
        kwargs.pop("learning_rate", None)  # accelerate's LOMO argument
        loss = loss / self.gradient_accumulation_steps  # as accelerate divides, at every window's length
        if len(self._zerodp) == 1:
            self._zerodp[0][1].backward(loss, scale_wrt_accumulation=False, **kwargs)
        else:  # several models: no loss scale (prepare refuses fp16 there)
            loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self, model):
        if self._zerodp_optimizer(model) is None:
            with super().no_sync(model):
                yield
            return
        with model.no_sync():
            yield

    @contextlib.contextmanager
    def accumulate(self, *models):
        zero = [m for m in models if self._zerodp_optimizer(m) is not None]
        with super().accumulate(*[m for m in models if self._zerodp_optimizer(m) is None]):
            with contextlib.ExitStack() as stack:
                if not self.sync_gradients:  # the boundary's backward reduces, whatever sync_each_batch says
                    for m in zero:
                        stack.enter_context(m.no_sync())
                yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        ids = {id(p) for p in parameters}
        for model, opt in self._zerodp:
            trained = {id(p) for g in opt.param_groups for p in g["params"]}
            if not ids & trained:
                continue
            if not trained <= ids <= {id(p) for p in model.parameters()}:
                raise ValueError(f"clip_grad_norm_ over part of a zerodp {type(model).__name__}'s parameters: zerodp "
                                 f"clips the norm of all of them, pass model.parameters()")
            if not self.sync_gradients:
                raise RuntimeError("clip_grad_norm_ inside an accumulation window: zerodp's gradients are whole "
                                   "only at its boundary; clip under `if accelerator.sync_gradients:`, as "
                                   "accelerate's examples do")
            return opt.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def get_state_dict(self, model, unwrap: bool = True):
        """The whole model, gathered, for a zerodp model (on every rank, which all take part)."""
        opt = self._zerodp_optimizer(model)
        if opt is None:
            return super().get_state_dict(model, unwrap)
        return full_state_dict(model, opt)

    def free_memory(self, *objects):
        self._zerodp = []
        return super().free_memory(*objects)

    # -- checkpoints -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _accelerate_keeps_the_rest(self):
        """accelerate's save_state/load_state over everything but zerodp's models and
        optimizers, which zerodp.save/load keep (accelerate would pickle a rank's shards)."""
        models, optimizers = self._models, self._optimizers
        zero_models = [m for m, _ in self._zerodp]
        self._models = [m for m in models if not any(m is z for z in zero_models)]
        self._optimizers = [o for o in optimizers if not isinstance(o, ZeroAcceleratedOptimizer)]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def _save_dir(self, output_dir) -> tuple[str, str]:
        """(the folder, where it is staged): accelerate's name for it, and a staging folder
        beside its parent's entries, not among them (accelerate's rotation and automatic
        naming read every name in `checkpoints/` as checkpoint_<N>)."""
        if self.project_configuration.automatic_checkpoint_naming:
            final = os.path.join(self.project_dir, "checkpoints", f"checkpoint_{self.save_iteration}")
            if os.path.exists(final):
                raise ValueError(f"Checkpoint directory {final} ({self.save_iteration}) already exists. Please "
                                 f"manually override `self.save_iteration` with what iteration to start with.")
            root = self.project_dir
        elif output_dir is None:
            raise ValueError("save_state: pass output_dir (or use ProjectConfiguration(automatic_checkpoint_naming="
                             "True))")
        else:
            final = os.path.abspath(os.fspath(output_dir))
            root = os.path.dirname(final)
        return final, os.path.join(root, STAGING_DIR, os.path.basename(final))

    def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
        """accelerate's save_state, with each zerodp model and optimizer saved by zerodp.save
        into `zerodp/` (`zerodp_1/`, ...); atomic: see the module docstring. Collective."""
        if not self._zerodp:
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        final, staging = self._save_dir(output_dir)
        automatic = self.project_configuration.automatic_checkpoint_naming
        if self.is_main_process and os.path.exists(staging):  # left by a run killed while saving
            shutil.rmtree(staging)
        self.wait_for_everyone()
        if automatic:  # accelerate's rotation, before the new folder counts
            self._rotate(os.path.dirname(final))
        self.project_configuration.automatic_checkpoint_naming = False  # accelerate writes where it is told
        try:
            with self._accelerate_keeps_the_rest():
                super().save_state(staging, safe_serialization, **save_model_func_kwargs)
        finally:
            self.project_configuration.automatic_checkpoint_naming = automatic
        for name in os.listdir(staging):  # accelerate's own files are durable before the rename
            if os.path.isfile(os.path.join(staging, name)):
                fsync(os.path.join(staging, name))
        for i, (model, opt) in enumerate(self._zerodp):
            save(os.path.join(staging, _checkpoint_name(i)), model, opt)
        self.wait_for_everyone()  # every rank's files (accelerate's RNG states too) are written
        if self.is_main_process:
            self._commit(staging, final)
        self.wait_for_everyone()
        return final

    def _rotate(self, checkpoints: str) -> None:
        """accelerate's `total_limit` under automatic naming: the oldest go first."""
        limit = self.project_configuration.total_limit
        if not self.is_main_process or limit is None or not os.path.isdir(checkpoints):
            return
        found = sorted((int(name.rsplit("_", 1)[-1]), name) for name in os.listdir(checkpoints)
                       if name.startswith("checkpoint_") and name.rsplit("_", 1)[-1].isdigit())
        for _, name in found[:max(0, len(found) + 1 - limit)]:
            shutil.rmtree(os.path.join(checkpoints, name))

    @staticmethod
    def _commit(staging: str, final: str) -> None:
        """Rename the staged folder into place; a folder already there goes aside first."""
        os.makedirs(os.path.dirname(final), exist_ok=True)
        if os.path.exists(final):
            old = os.path.join(os.path.dirname(staging), f"replaced-{os.path.basename(final)}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            shutil.rmtree(old)
        os.replace(staging, final)
        fsync_dir(os.path.dirname(final))
        shutil.rmtree(os.path.dirname(staging), ignore_errors=True)  # saves run one at a time

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        """accelerate's load_state, with each zerodp model and optimizer restored by
        zerodp.load (any world size and stage). A folder without a complete zerodp checkpoint
        for every zerodp model is refused before anything is loaded. Collective."""
        if not self._zerodp:
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            checkpoints = os.path.join(self.project_dir, "checkpoints")
            found = sorted((int(name.rsplit("_", 1)[-1]), name) for name in os.listdir(checkpoints)
                           if name.startswith("checkpoint_") and name.rsplit("_", 1)[-1].isdigit())
            if not found:
                raise ValueError(f"load_state: no checkpoint_<N> folder in {checkpoints}")
            input_dir = os.path.join(checkpoints, found[-1][1])
        elif input_dir is None:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        input_dir = os.path.expanduser(os.fspath(input_dir))
        missing = [_checkpoint_name(i) for i in range(len(self._zerodp))
                   if not os.path.isfile(os.path.join(input_dir, _checkpoint_name(i), COMPLETE))]
        if missing:
            raise FileNotFoundError(f"{input_dir} holds no complete zerodp checkpoint {missing} for the "
                                    f"{len(self._zerodp)} zerodp model(s) of this Accelerator: it was not written by "
                                    f"zerodp's Accelerator.save_state (a plain accelerate folder keeps no sharded "
                                    f"model), or not with these models")
        with self._accelerate_keeps_the_rest():
            super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        for i, (model, opt) in enumerate(self._zerodp):
            load(os.path.join(input_dir, _checkpoint_name(i)), model, opt)
