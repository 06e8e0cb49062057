"""The `optimizer` and `scheduler` blocks of a DeepSpeed config as torch objects (docs/deepspeed.md).

DeepSpeed builds its optimizer from the block over every trainable parameter in one param
group (no weight-decay exclusions), and steps its scheduler once per optimizer step. The
builders here do the same with torch's classes:

- "Adam" / "AdamW": `torch.optim.AdamW`, or `torch.optim.Adam` where `adam_w_mode` is false.
  DeepSpeed's "Adam" decouples weight decay unless told otherwise (`adam_w_mode` defaults to
  true), and its FusedAdam / CPU Adam compute the same update as torch's AdamW. Missing
  hyperparameters take DeepSpeed's defaults (weight_decay 0, not torch AdamW's 0.01).
- "Adagrad", and any other name torch.optim has: that class with the block's params, as
  DeepSpeed builds an untested optimizer.
- DeepSpeed's own (Lamb, OneBitAdam, ZeroOneAdam, OneBitLamb, Lion, MuAdam(W), MuSGD, Muon):
  refused, naming the fix.
- Schedulers "WarmupLR" and "WarmupDecayLR": `DeepSpeedWarmupLR`, DeepSpeed's formulas (log or
  linear warm-up from warmup_min_lr to warmup_max_lr, then constant or linear decay to 0 at
  total_num_steps), stepping as DeepSpeed's do; other DeepSpeed schedulers are refused.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..config_values import ConfigError

__all__ = ["DeepSpeedWarmupLR", "build_optimizer", "build_scheduler"]

_DEEPSPEED_ONLY = {
    "lamb": "DeepSpeed's FusedLamb", "onebitadam": "1-bit Adam's compressed communication",
    "zerooneadam": "0/1 Adam's compressed communication", "onebitlamb": "1-bit LAMB's compressed communication",
    "lion": "DeepSpeed's Lion", "muadam": "mup's MuAdam", "muadamw": "mup's MuAdamW", "musgd": "mup's MuSGD",
    "muon": "DeepSpeed's Muon (split by param.use_muon)"}
_ADAM_PARAMS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}  # DeepSpeed's FusedAdam defaults


def build_optimizer(block, resolve: Callable) -> Callable:
    """`params -> optimizer` for the `optimizer` block; `resolve(key, value)` turns an
    optimizer.params value ("auto" included) into the one to use."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ConfigError(f"DeepSpeed optimizer={block!r}: give {{\"type\": ..., \"params\": {{...}}}}")
    name, raw = block["type"], dict(block.get("params") or {})
    extra = set(block) - {"type", "params", "legacy_fusion"}
    if extra:
        raise ConfigError(f"DeepSpeed optimizer.{sorted(extra)[0]} has no zerodp equivalent: remove it")
    params = {k: resolve(k, v) for k, v in raw.items()}
    if "max_grad_norm" in params:
        raise ConfigError("DeepSpeed optimizer.params.max_grad_norm: DeepSpeed refuses it too; use gradient_clipping")
    low = name.lower()
    if low in _DEEPSPEED_ONLY:
        raise ConfigError(f"DeepSpeed optimizer.type={name!r} ({_DEEPSPEED_ONLY[low]}) has no torch equivalent "
                          f"zerodp can build: remove the optimizer block and pass your own optimizer to "
                          f"zerodp.initialize (for Muon: zerodp.split_hidden_matrices, docs/optimizers.md)")
    if low in ("adam", "adamw"):
        if params.pop("bias_correction", True) is not True:
            raise ConfigError("DeepSpeed optimizer.params.bias_correction=false: torch's Adam always corrects the "
                              "bias; remove it")
        if params.get("amsgrad"):
            raise ConfigError("DeepSpeed optimizer.params.amsgrad=true: DeepSpeed's FusedAdam refuses it; remove it")
        for k in ("torch_adam", "set_grad_none"):  # which implementation, and how it clears: the same update
            params.pop(k, None)
        decoupled = bool(params.pop("adam_w_mode", True)) or low == "adamw"
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        kwargs = {**_ADAM_PARAMS, **params}
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
    else:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"DeepSpeed optimizer.type={name!r} is neither DeepSpeed's nor a torch.optim class: "
                              f"remove the block and pass your optimizer to zerodp.initialize")
        kwargs = params
    try:
        probe = torch.nn.Parameter(torch.zeros(1))
        cls([probe], **kwargs)  # refuse a bad hyperparameter here, naming the block, not at initialize
    except (TypeError, ValueError) as e:
        raise ConfigError(f"DeepSpeed optimizer {name} with params {kwargs}: {cls.__name__} refuses them: {e}") from None

    def make(model_params):
        trainable = [p for p in model_params if not isinstance(p, torch.Tensor) or p.requires_grad]
        return cls(trainable, **kwargs)

    make.__name__ = make.__qualname__ = f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    return make


def build_scheduler(block, resolve: Callable) -> Callable:
    """`optimizer -> LR scheduler` for the `scheduler` block (resolve: as build_optimizer's)."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise ConfigError(f"DeepSpeed scheduler={block!r}: give {{\"type\": ..., \"params\": {{...}}}}")
    name = block["type"]
    if name not in ("WarmupLR", "WarmupDecayLR"):
        raise ConfigError(f"DeepSpeed scheduler.type={name!r}: zerodp builds WarmupLR and WarmupDecayLR; remove the "
                          f"block and step a torch.optim.lr_scheduler of your own (or the HF Trainer's "
                          f"lr_scheduler_type)")
    allowed = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}
    if name == "WarmupDecayLR":
        allowed.add("total_num_steps")
    raw = dict(block.get("params") or {})
    extra = (set(raw) - allowed) | (set(block) - {"type", "params"})
    if extra:
        raise ConfigError(f"DeepSpeed scheduler.params.{sorted(extra)[0]} is not one of {name}'s: remove it")
    params = {k: resolve(k, v) for k, v in raw.items()}
    if params.pop("last_batch_iteration", -1) != -1:
        raise ConfigError("DeepSpeed scheduler.params.last_batch_iteration: a resumed position comes from the "
                          "checkpoint (load_state_dict), not the config; remove it")
    if name == "WarmupDecayLR" and "total_num_steps" not in params:
        raise ConfigError("DeepSpeed scheduler WarmupDecayLR needs params.total_num_steps")
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise ConfigError(f"DeepSpeed scheduler.params.warmup_type={params['warmup_type']!r}: use \"log\" or "
                          f"\"linear\"")
    defaults = {"warmup_min_lr": 0.0, "warmup_num_steps": 1000,
                "warmup_max_lr": 0.001 if name == "WarmupDecayLR" else None}

    def make(optimizer):
        return DeepSpeedWarmupLR(optimizer, **{**defaults, **params})

    make.__name__ = make.__qualname__ = f"{name}({', '.join(f'{k}={v!r}' for k, v in params.items())})"
    return make


class DeepSpeedWarmupLR(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR (and, with `total_num_steps`, WarmupDecayLR) on torch's scheduler
    base. DeepSpeed counts `last_batch_iteration` from -1 (before the first step: warmup_min_lr)
    and sets absolute learning rates; torch counts `last_epoch` from 0 after its initial step,
    so iteration = last_epoch - 1 and the rates are the same at every step."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", total_num_steps=None):
        groups = optimizer.param_groups
        if warmup_max_lr is None:
            warmup_max_lr = groups[0]["lr"]
        self.min_lrs = _per_group(warmup_min_lr, len(groups), "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, len(groups), "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))  # DeepSpeed's floor (log(1) would divide by 0)
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        super().__init__(optimizer)

    def iteration(self) -> int:
        return self.last_epoch - 1

    def gamma(self) -> float:
        it = self.iteration()
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(it + 1) / math.log(self.warmup_num_steps)
            return it / self.warmup_num_steps
        if self.total_num_steps is None:
            return 1.0
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))

    def get_lr(self) -> list:
        if self.iteration() < 0:
            return list(self.min_lrs)
        g = self.gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's state dict, or DeepSpeed's own ({'last_batch_iteration': k}, as a DeepSpeed
        checkpoint's `lr_scheduler` holds it)."""
        if set(state_dict) == {"last_batch_iteration"}:
            self.last_epoch = int(state_dict["last_batch_iteration"]) + 1
            for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
                group["lr"] = lr
            self._last_lr = [g["lr"] for g in self.optimizer.param_groups]
            return
        super().load_state_dict(state_dict)


def _per_group(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"DeepSpeed scheduler.params.{name} has {len(value)} values for {n} param groups")
        return [float(v) for v in value]
    return [float(value)] * n
