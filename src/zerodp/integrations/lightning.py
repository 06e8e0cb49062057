"""Lightning with zerodp: `Trainer(strategy=ZeroStrategy(zerodp.Config(stage=3)))` and
`Fabric(strategy=ZeroFabricStrategy(zerodp.Config(stage=3)))`. Lightning keeps the Trainer's and
Fabric's strategies apart (each takes only its own kind), so there are two classes over one
Config. Importing this module registers "zerodp" (Config()) and "zerodp_stage_1" .. "_3" with
both, as Lightning registers "deepspeed_stage_3". Processes come from torchrun, or Lightning's
own launcher, as for its "ddp".

[Note: Lightning's seams]
Both are Lightning's DDP strategies that never build DistributedDataParallel: zerodp.initialize
shards the model in place and gives it DDP's `no_sync()` and `require_backward_grad_sync`.
- The optimizer: the one `configure_optimizers` builds goes to initialize (groups, hyperparameters,
  state) and its LR schedulers are moved onto the optimizer initialize returns. Fabric's
  `setup(model, optimizer)` does the same; schedulers are built on the optimizer it returns.
- Accumulation: the Trainer's `block_backward_sync` and Fabric's `no_backward_sync` enter the
  model's `no_sync()`. zerodp reads the flag in the model's forward, as DDP does, so every step
  method runs through the model's call (Lightning's forward redirection), as through DDP's.
- Clipping: torch's clip over the optimizer's parameters, as Lightning calls it, which zerodp
  answers from the shards (DDP's global norm).
- Precision: `PRECISIONS`. Checkpoints: [Note: Lightning checkpoint layout].
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from ..api import initialize
from ..checkpoint import consolidate, load, load_pretrained, save
from ..checkpoint.files import fsync, fsync_dir
from ..config import Config
from ..optim import ZeroOptimizer
from .schedulers import drop_scheduler_mark, move_schedulers

__all__ = ["ZeroStrategy", "ZeroFabricStrategy", "PRECISIONS", "LIGHTNING_FILE", "ZERODP_DIR",
           "is_zerodp_checkpoint"]

# Lightning's precision flag -> the Config.mixed_precision it allows (the first unless the Config
# names another). Lightning's plugin still does its part (autocast; the module and inputs cast).
# - "bf16-mixed": torch AMP as under Lightning's DDP: fp32 weights, gradients and optimizer,
#   autocast running the matmuls in bf16. Config(mixed_precision="bf16") asks for zerodp's bf16
#   instead (DeepSpeed's bf16): bf16 weights and gradients over an fp32 master shard, half their
#   bytes, autocast kept for the ops it runs in fp32.
# - "bf16-true": Lightning casts the module and inputs to bf16; zerodp steps an fp32 master shard
#   of the bf16 weights (Lightning's DDP steps the bf16 weights themselves).
PRECISIONS = {"32-true": ("fp32",), "bf16-mixed": ("fp32", "bf16"), "bf16-true": ("bf16",)}
_REFUSED = {
    "16-mixed": "its GradScaler unscales every parameter's whole gradient on each rank and lets each rank "
                "decide alone to skip a step, where zerodp's ranks hold gradient shards (the rank that skips "
                "and the one that steps then diverge); zerodp's own fp16 (fp16 weights, fp32 master, a loss "
                "scale the ranks agree on) is another algorithm, not substituted silently",
    "16-true": "fp16 without a loss scale underflows its gradients; zerodp scales fp16 losses itself, "
               "which Lightning's backward does not call",
}

LIGHTNING_FILE = "lightning.pt"  # Lightning's checkpoint dict, less the model and optimizer
ZERODP_DIR = "zerodp"  # zerodp.save of the model and optimizer
# What lightning.pt holds under the Fabric state keys whose objects zerodp saved in zerodp/.
_SAVED = {"model": f"the model, in {ZERODP_DIR}/", "optimizer": f"the optimizer, in {ZERODP_DIR}/"}


def resolve_config(config: Config, precision: str, scaler: Any = None) -> Config:
    """`config` for a run at Lightning's `precision` (PRECISIONS), or ValueError naming why not."""
    if precision in _REFUSED or scaler is not None:
        why = _REFUSED.get(precision, _REFUSED["16-mixed"])
        raise ValueError(f"zerodp's Lightning strategy does not train at precision={precision!r}: {why}. Use "
                         f"precision='bf16-mixed' or 'bf16-true' (or '32-true')")
    if precision not in PRECISIONS:
        raise ValueError(f"zerodp's Lightning strategy does not train at precision={precision!r}: zerodp keeps "
                         f"fp32 masters of fp32 or bf16 weights; use one of {sorted(PRECISIONS)}")
    allowed = PRECISIONS[precision]
    if config.mixed_precision not in allowed and config.mixed_precision != "fp32":
        raise ValueError(f"precision={precision!r} and zerodp.Config(mixed_precision={config.mixed_precision!r}) "
                         f"disagree: set one of them (with {precision!r} the Config may say {list(allowed)})")
    wanted = config.mixed_precision if config.mixed_precision in allowed else allowed[0]
    return config if wanted == config.mixed_precision else dataclasses.replace(config, mixed_precision=wanted)


def _as_config(config: Union[Config, dict, None]) -> Config:
    config = Config.from_dict(config) if isinstance(config, dict) else (config if config is not None else Config())
    if not isinstance(config, Config):
        raise TypeError(f"config must be a zerodp.Config or a dict, got {type(config).__name__}")
    why = {"grad_accumulation_steps": "Lightning decides the accumulation (Trainer(accumulate_grad_batches=...), "
                                      "fabric.no_backward_sync) and divides the loss",
           "tensor_parallel_size": "Lightning's samplers give every rank its own batches, where a tensor-parallel "
                                   "group must read one"}
    for name, reason in why.items():
        if getattr(config, name) != 1:
            raise ValueError(f"zerodp.Config({name}={getattr(config, name)!r}) under Lightning: {reason}; leave it at 1")
    return config


# Lightning's own keyword arguments of its DDP strategies; the rest go to DistributedDataParallel.
_STRATEGY_OPTIONS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                     "precision", "process_group_backend", "timeout", "start_method"}


def _refuse_ddp_options(kwargs: dict) -> None:
    ddp = sorted(set(kwargs) - _STRATEGY_OPTIONS)
    if ddp:
        raise ValueError(f"{ddp} configure DistributedDataParallel, which zerodp's strategy never builds: "
                         f"remove them (zerodp.Config holds zerodp's options)")


class _NoSync(_BackwardSyncControl):
    """Fabric's no_backward_sync: the model's DDP-style no_sync()."""

    def no_backward_sync(self, module: nn.Module, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        if not hasattr(module, "no_sync"):
            raise TypeError(f"fabric.no_backward_sync: {type(module).__name__} was set up without an optimizer")
        return module.no_sync()


# -- checkpoints ----------------------------------------------------------------------------------
# [Note: Lightning checkpoint layout]
# The path Lightning names (`epoch=0-step=2.ckpt`, `fabric.save(path)`) is a directory:
#   lightning.pt   Lightning's own dict (loops, callbacks, LR schedulers, hyperparameters, Fabric's
#                  other state), as its TorchCheckpointIO writes it, without the model and optimizer
#   zerodp/        zerodp.save of the model and optimizer: sharded, loadable at any world size/stage
# It is written under `.<name>.zerodp-staging` beside it and renamed into place once both parts are
# complete, so a run killed while saving leaves the previous checkpoint at `path` whole (as
# zerodp.save does for its own directory). A path that holds anything else is never replaced.

def is_zerodp_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether `path` is a checkpoint these strategies wrote."""
    return os.path.isfile(os.path.join(path, LIGHTNING_FILE)) and os.path.isdir(os.path.join(path, ZERODP_DIR))


def save_checkpoint_dir(strategy, path, model: nn.Module, optimizer: ZeroOptimizer, rest: dict) -> str:
    """Write [Note: Lightning checkpoint layout] at `path` (rank 0's choice of it) from every rank."""
    path = os.path.abspath(os.fspath(strategy.broadcast(os.fspath(path))))
    parent, name = os.path.split(path)
    staging = os.path.join(parent, f".{name}.zerodp-staging")
    _agree(strategy, path, "prepare", lambda: _prepare_staging(path, staging))
    save(os.path.join(staging, ZERODP_DIR), model, optimizer)
    _agree(strategy, path, "commit", lambda: _commit(staging, path, rest))
    return path


def _prepare_staging(path: str, staging: str) -> None:
    if os.path.lexists(path) and not is_zerodp_checkpoint(path):
        raise FileExistsError(f"{path} exists and is not a checkpoint of zerodp's Lightning strategy (no "
                              f"{LIGHTNING_FILE} beside {ZERODP_DIR}/): it is not replaced; choose another path")
    shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
    os.makedirs(staging)


def _commit(staging: str, path: str, rest: dict) -> None:
    file = os.path.join(staging, LIGHTNING_FILE)
    TorchCheckpointIO().save_checkpoint(rest, file)
    fsync(file)
    replaced = staging[: -len("staging")] + "replaced"
    if os.path.lexists(path):
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(path, replaced)
    os.replace(staging, path)
    fsync_dir(os.path.dirname(path))
    shutil.rmtree(replaced, ignore_errors=True)


def _agree(strategy, path: str, what: str, work) -> None:
    """Run `work` on rank 0 and raise its failure on every rank (the others would wait for it)."""
    failure = None
    if strategy.is_global_zero:
        try:
            work()
        except Exception as e:  # noqa: BLE001  (re-raised below, on every rank)
            failure = f"{type(e).__name__}: {e}"
    failure = strategy.broadcast(failure)
    if failure is not None:
        raise RuntimeError(f"rank {strategy.global_rank}: saving checkpoint {path} failed ({what}, rank 0): {failure}")


def read_lightning_file(strategy, path) -> dict:
    """Lightning's part of the checkpoint at `path`, read on every rank; raises on every rank if
    any rank could not read it."""
    file, rest, failure = os.path.join(path, LIGHTNING_FILE), None, None
    try:
        rest = TorchCheckpointIO().load_checkpoint(file)
    except Exception as e:  # noqa: BLE001  (raised below, on every rank)
        failure = e
    if not strategy.reduce_boolean_decision(failure is None, all=True):
        raise RuntimeError(f"rank {strategy.global_rank}: reading {file} failed on some rank (here: {failure!r})")
    return rest


def load_weights(path, model: Optional[nn.Module], optimizer: Optional[ZeroOptimizer]) -> Optional[dict]:
    """The model's weights alone from the checkpoint at `path`: into a sharded `model` (its
    optimizer's states left alone), or (no optimizer) returned whole, for a plain one."""
    weights = consolidate(os.path.join(path, ZERODP_DIR), dtype="compute")
    return weights if optimizer is None else load_pretrained(model, weights, optimizer)


# -- the Trainer ---------------------------------------------------------------------------------
def _through_model(method: str, context: str):
    """The strategy's `method` (training_step, ...): the LightningModule's, run through the
    model's call once zerodp shards it ([Note: Lightning's seams]), in the precision's context."""
    def step(self, *args: Any, **kwargs: Any):
        with getattr(self.precision_plugin, context)():
            if self.zerodp_optimizer is None:
                return getattr(self.lightning_module, method)(*args, **kwargs)
            return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)
    step.__name__ = step.__qualname__ = method
    return step


class ZeroStrategy(DDPStrategy):
    """The Trainer's strategy: `Trainer(strategy=ZeroStrategy(zerodp.Config(stage=3)))`; keyword
    arguments as Lightning's DDPStrategy takes them, less DDP's own (`_refuse_ddp_options`)."""

    def __init__(self, config: Union[Config, dict, None] = None, **kwargs: Any):
        self.zerodp_config = _as_config(config)
        self.zerodp_optimizer: Optional[ZeroOptimizer] = None  # set once fit shards the model
        _refuse_ddp_options(kwargs)
        super().__init__(**kwargs)
        self._forward_redirection = _ForwardRedirection()

    @property
    def precision_plugin(self):
        return DDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if plugin is not None:  # refused when the Trainer is built, not at fit
            resolve_config(self.zerodp_config, plugin.precision, getattr(plugin, "scaler", None))
        DDPStrategy.precision_plugin.fset(self, plugin)

    # -- setup: initialize instead of DistributedDataParallel -------------------------------------
    def setup(self, trainer) -> None:
        if self._layer_sync is not None:
            raise ValueError("Trainer(sync_batchnorm=True) with zerodp's strategy is not supported: convert the "
                             "model's BatchNorm layers yourself (nn.SyncBatchNorm.convert_sync_batchnorm) first")
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)  # bf16-true: the module in bf16
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING and self.zerodp_optimizer is None:
            self.setup_optimizers(trainer)
        elif self.zerodp_optimizer is None:
            _sync_module_states(self.model)  # an evaluation of a plain model: rank 0's weights, as DDP's
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)  # configure_optimizers, as Lightning reads it
        if len(self.optimizers) != 1:
            raise ValueError(f"zerodp's strategy shards one optimizer; configure_optimizers returned "
                             f"{len(self.optimizers)}: use one optimizer with several param groups")
        plain = self.optimizers[0]
        config = resolve_config(self.zerodp_config, self.precision_plugin.precision)
        drop_scheduler_mark(plain)  # [Note: a scheduler built before initialize] in schedulers.py
        self.model, zero = initialize(self.model, plain, config)
        move_schedulers([c.scheduler for c in self.lr_scheduler_configs], plain, zero)
        self.zerodp_optimizer = zero
        self.optimizers = [zero]

    def model_to_device(self) -> None:
        if self.zerodp_optimizer is None:  # a sharded model stays where zerodp placed its shards
            super().model_to_device()

    # -- one step ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def block_backward_sync(self):
        """The Trainer accumulates inside this: the model's no_sync()."""
        with self.model.no_sync() if self.zerodp_optimizer is not None else contextlib.nullcontext():
            yield None

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        # Manual optimization may toggle the flag after the forward read it (toggle_model inside
        # the step): the backward goes by it as it is now, as Lightning's DDP strategy has DDP's.
        if self.zerodp_optimizer is not None and not self.lightning_module.automatic_optimization:
            self.zerodp_optimizer.grad_sync.note_forward(self.model.require_backward_grad_sync)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        """Lightning's precision plugins give `optimizer.step` the training step and backward as a
        closure; zerodp's step takes none (the backward reduces before it), so it runs here: the
        closure, Lightning's on_before_optimizer_step hooks and clipping, the step (their order)."""
        if self.zerodp_optimizer is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        result = closure()
        self.precision_plugin._after_closure(model, optimizer)
        optimizer.step(**kwargs)
        return result

    training_step = _through_model("training_step", "train_step_context")
    validation_step = _through_model("validation_step", "val_step_context")
    test_step = _through_model("test_step", "test_step_context")
    predict_step = _through_model("predict_step", "predict_step_context")

    # -- checkpoints: [Note: Lightning checkpoint layout] -------------------------------------------
    def lightning_module_state_dict(self) -> dict:
        return {} if self.zerodp_optimizer is not None else super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict:
        return {} if self.zerodp_optimizer is not None else super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        if self.zerodp_optimizer is None:  # nothing sharded yet: Lightning's file
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("Trainer.save_checkpoint(storage_options=...): zerodp writes the checkpoint itself")
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_checkpoint_dir(self, filepath, self.model, self.zerodp_optimizer, rest)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # zerodp.load needs the sharded model and optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self.zerodp_optimizer is None

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:  # 2.6 passes it
        if not is_zerodp_checkpoint(checkpoint_path):
            if self.zerodp_optimizer is not None:
                raise ValueError(f"{checkpoint_path} is not a checkpoint of zerodp's strategy (a directory with "
                                 f"{LIGHTNING_FILE} and {ZERODP_DIR}/): resume from one it saved, or load plain "
                                 f"weights into the model before fit")
            return super().load_checkpoint(checkpoint_path, **({} if weights_only is None else {"weights_only": weights_only}))
        rest = read_lightning_file(self, checkpoint_path)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if self.zerodp_optimizer is not None and fitting:
            load(os.path.join(checkpoint_path, ZERODP_DIR), self.model, self.zerodp_optimizer)
        else:  # validate/test/predict: the weights only, as Lightning restores them
            rest["state_dict"] = load_weights(checkpoint_path, self.model, self.zerodp_optimizer)
        return rest

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if checkpoint.get("state_dict") is not None:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if self.zerodp_optimizer is None:
            super().load_optimizer_state_dict(checkpoint)

    def teardown(self) -> None:
        if self.zerodp_optimizer is None:
            return super().teardown()
        # Lightning moves the module and optimizer to the CPU here; zerodp's buffers stay put.
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        _register(cls, strategy_registry)


# -- Fabric ---------------------------------------------------------------------------------------
class ZeroFabricStrategy(FabricDDPStrategy):
    """Fabric's strategy: `Fabric(strategy=ZeroFabricStrategy(zerodp.Config(stage=3)))`;
    `fabric.setup(model, optimizer)` shards them together."""

    def __init__(self, config: Union[Config, dict, None] = None, **kwargs: Any):
        self.zerodp_config = _as_config(config)
        self.zerodp_model: Optional[nn.Module] = None
        self.zerodp_optimizer: Optional[ZeroOptimizer] = None
        _refuse_ddp_options(kwargs)
        super().__init__(**kwargs)
        self._backward_sync_control = _NoSync()

    @property
    def precision(self):
        return FabricDDPStrategy.precision.fget(self)

    @precision.setter
    def precision(self, plugin) -> None:
        if plugin is not None:  # refused when Fabric is built
            resolve_config(self.zerodp_config, plugin.precision, getattr(plugin, "scaler", None))
        FabricDDPStrategy.precision.fset(self, plugin)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list) -> tuple:
        if len(optimizers) != 1 or self.zerodp_optimizer is not None:
            raise ValueError(f"zerodp's Fabric strategy trains one model with one optimizer (of any param groups): "
                             f"fabric.setup got {len(optimizers)} optimizers, after {int(bool(self.zerodp_model))} "
                             f"model(s) set up with one")
        config = resolve_config(self.zerodp_config, self.precision.precision)
        self.zerodp_model, self.zerodp_optimizer = initialize(module, optimizers[0], config)
        return self.zerodp_model, [self.zerodp_optimizer]

    def setup_module(self, module: nn.Module) -> nn.Module:  # no optimizer (evaluation): not sharded
        return module

    def setup_optimizer(self, optimizer):
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def save_checkpoint(self, path, state: dict, storage_options: Optional[Any] = None, filter=None) -> None:
        keys = self._zerodp_keys(state)
        if not keys:
            return super().save_checkpoint(path, state, storage_options, filter)
        if storage_options is not None or set(keys) & set(filter or {}):
            raise ValueError("fabric.save(storage_options=..., or a filter= on the model or optimizer): zerodp "
                             "writes the whole sharded model and optimizer itself; filter the other entries only")
        others = {k: v for k, v in state.items() if k not in keys}
        rest = {**self._convert_stateful_objects_in_state(others, filter=filter or {}),
                **{k: _SAVED[role] for k, role in keys.items()}}
        save_checkpoint_dir(self, path, self.zerodp_model, self.zerodp_optimizer, rest)

    def load_checkpoint(self, path, state=None, strict: bool = True, **kwargs) -> dict:
        keys = self._zerodp_keys(state) if isinstance(state, dict) else {}
        if not is_zerodp_checkpoint(path):
            if keys:
                raise ValueError(f"{path} is not a checkpoint of zerodp's strategy (a directory with {LIGHTNING_FILE} "
                                 f"and {ZERODP_DIR}/): load plain weights into the model before fabric.setup")
            return super().load_checkpoint(path, state, strict, **kwargs)
        if isinstance(state, (nn.Module, torch.optim.Optimizer)):
            raise ValueError("fabric.load_raw of zerodp's checkpoint: use fabric.load(path, {'model': model, ...})")
        rest = read_lightning_file(self, path)
        saved = {k: role for k, v in rest.items() for role, marker in _SAVED.items()
                 if isinstance(v, str) and v == marker}
        if not state:  # everything: the model's weights whole, the optimizer's shards left out
            weights = {k: load_weights(path, None, None) for k, role in saved.items() if role == "model"}
            return {**{k: v for k, v in rest.items() if k not in saved}, **weights}
        missing = [k for k in state if k not in rest]
        if strict and missing:
            raise KeyError(f"fabric.load: {missing} not in the checkpoint at {path} (strict=False ignores them)")
        roles = set(keys.values())
        if roles == {"model", "optimizer"}:
            load(os.path.join(path, ZERODP_DIR), self.zerodp_model, self.zerodp_optimizer)
        elif roles == {"model"}:
            load_weights(path, self.zerodp_model, self.zerodp_optimizer)
        elif roles:
            raise ValueError("fabric.load of the optimizer without its model: pass both, as fabric.save got them")
        for name, obj in state.items():
            if name in keys or name not in rest:
                continue
            if name in saved:
                raise ValueError(f"fabric.load: {name!r} was saved sharded by zerodp ({rest[name]}): load it into "
                                 f"the {saved[name]} fabric.setup returned, or read zerodp.consolidate(path)")
            value = rest.pop(name)
            if isinstance(obj, nn.Module):
                obj.load_state_dict(value, strict=strict)
            elif hasattr(obj, "load_state_dict") and hasattr(obj, "state_dict"):
                obj.load_state_dict(value)
            else:
                state[name] = value
        return {k: v for k, v in rest.items() if k not in saved}

    def _zerodp_keys(self, state: Optional[dict]) -> dict:
        """{state key: "model" or "optimizer"} for the entries that are what zerodp shards."""
        mine = {"model": self.zerodp_model, "optimizer": self.zerodp_optimizer}
        return {key: role for key, obj in (state or {}).items() for role, it in mine.items()
                if it is not None and obj is it}

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        _register(cls, strategy_registry)


def _register(cls, registry) -> None:
    registry.register("zerodp", cls, description="zerodp's ZeRO, zerodp.Config() (stage 2)", override=True)
    for stage in (1, 2, 3):
        registry.register(f"zerodp_stage_{stage}", cls, description=f"zerodp's ZeRO at stage {stage}",
                          override=True, config=Config(stage=stage))


ZeroStrategy.register_strategies(StrategyRegistry)
ZeroFabricStrategy.register_strategies(FABRIC_REGISTRY)
