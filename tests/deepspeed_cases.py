"""DeepSpeed's side and zerodp's side of test_deepspeed.py's checkpoint cases.

`deepspeed_world` runs in a world of its own (harness.run_world: DeepSpeed's engine leaves
hooks and a communication backend behind, which the session's shared worlds must not
inherit): per ZeRO stage, DeepSpeed trains the model SAVE_AT steps with torch's AdamW as the
client optimizer (two param groups), saves, and reports the state it saved, read through
DeepSpeed's own API (`safe_get_full_fp32_param` / `safe_get_full_optimizer_state`); then a
fresh engine `load_checkpoint`s the folder and trains CONTINUE more steps: the reference.

`zerodp_continue` runs in the session's worlds: a model built from another seed (so nothing
matches before the load) and an optimizer with other hyperparameters, `zerodp.load` of the
DeepSpeed folder, the loaded state by name, then the same CONTINUE steps on the same global
batches (at N=1 one rank takes both of DeepSpeed's ranks' micro-batches).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

DS_WORLD, MICRO, SAVE_AT, CONTINUE = 2, 4, 3, 3
LR = (1e-2, 3e-3)  # the two param groups' (matrices, the rest)
WEIGHT_DECAY = (0.1, 0.0)
STATE_KEYS = ("exp_avg", "exp_avg_sq")
# DeepSpeed's schedulers, as its own classes step them, against zerodp's DeepSpeedWarmupLR.
SCHEDULES = (("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 5}),
             ("WarmupLR", {"warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"}),
             ("WarmupDecayLR", {"total_num_steps": 12, "warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                "warmup_num_steps": 4}))
SCHEDULE_STEPS = 14


class Net(nn.Module):
    """Odd sizes, so DeepSpeed pads its partitions; a LayerNorm; a buffer DeepSpeed saves."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.out = nn.Linear(13, 3)
        self.register_buffer("shift", torch.randn(3))

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(self.norm(self.inp(x)))) + self.shift


def groups(model: nn.Module, lr=LR, weight_decay=WEIGHT_DECAY) -> list:
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() == 2], "lr": lr[0], "weight_decay": weight_decay[0]},
            {"params": [p for n, p in named if p.dim() < 2], "lr": lr[1], "weight_decay": weight_decay[1]}]


def batch(step: int, rank: int):
    """DeepSpeed rank `rank`'s micro-batch of step `step` (counted over the whole run)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(MICRO, 7, generator=g), torch.randn(MICRO, 3, generator=g)


def global_batch(step: int, rank: int, world: int):
    """What rank `rank` of `world` ranks takes at `step`: DeepSpeed's ranks' batches, split evenly."""
    per = DS_WORLD // world
    xs, ys = zip(*(batch(step, r) for r in range(rank * per, (rank + 1) * per)))
    return torch.cat(xs), torch.cat(ys)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "overlap_comm": False}, "steps_per_print": 10 ** 9,
            "wall_clock_breakdown": False}


def _start_deepspeed(rank: int, world: int):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    # DeepSpeed's shared-memory all-reduce for CPUs is compiled on first use (minutes on two
    # cores): gloo carries every collective without it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # over the harness's process group
    return deepspeed


def _gathered(deepspeed, engine, stage: int) -> dict:
    """name -> (fp32 master, {state: tensor}) of every parameter, whole (collective), from
    DeepSpeed's live optimizer: at stage 3 its own safe_get_full_* API; at stages 1-2 each
    parameter's fragment address in the flat partition (DeepSpeed's bookkeeping), the states
    read beside it (its optimizer-state links are made after the first param group's step only,
    so the API finds no states for a second group)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        if stage == 3:
            states = {k: safe_get_full_optimizer_state(p, k).clone() for k in STATE_KEYS}
            out[name] = (safe_get_full_fp32_param(p).clone(), states)
            continue
        out[name] = tuple([_fragment_whole(engine, p, None)] + [{k: _fragment_whole(engine, p, k) for k in STATE_KEYS}])
    return out


def _fragment_whole(engine, p, key):
    opt, mapping = engine.optimizer, p._hp_mapping
    whole = torch.zeros(p.numel(), dtype=torch.float32)
    if mapping is not None:
        flat = opt.single_partition_of_fp32_groups[mapping.param_group_index]
        source = flat if key is None else opt.optimizer.state[flat][key]
        hp, lp = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
        whole.narrow(0, lp.start, lp.numel).copy_(source.narrow(0, hp.start, hp.numel))
    dist.all_reduce(whole, group=p._dp_group)
    return whole.view(p.shape)


def _params(deepspeed, engine, stage: int) -> dict:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return {n: p.detach().clone().float() for n, p in engine.module.named_parameters()}


def _engine(deepspeed, stage: int, seed: int):
    model = Net(seed)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups(model)), config=ds_config(stage))
    return engine


def deepspeed_world(rank: int, world: int, out_dir: str, stages=(2, 3)) -> dict:
    deepspeed = _start_deepspeed(rank, world)
    result = {}
    for stage in stages:
        engine = _engine(deepspeed, stage, seed=0)
        for step in range(SAVE_AT):
            x, y = batch(step, rank)
            engine.backward(loss_of(engine, x, y))
            engine.step()
        folder = os.path.join(out_dir, f"stage{stage}")
        saved = _gathered(deepspeed, engine, stage)  # before the save, which lets go of DeepSpeed's state views
        engine.save_checkpoint(folder, client_state={"data_position": SAVE_AT})
        step_value = sorted({float(v["step"]) for v in engine.optimizer.optimizer.state.values()})
        del engine
        resumed = _engine(deepspeed, stage, seed=5)  # other weights: the load must replace them all
        resumed.load_checkpoint(folder)
        losses, params = [], []
        for step in range(SAVE_AT, SAVE_AT + CONTINUE):
            x, y = batch(step, rank)
            loss = loss_of(resumed, x, y)
            losses.append(loss.item())
            resumed.backward(loss)
            resumed.step()
            params.append(_params(deepspeed, resumed, stage))
        result[stage] = {"folder": folder, "saved": saved, "step": step_value, "losses": losses, "params": params,
                         "buffer": Net(0).shift.clone()}
        del resumed
    if rank != 0:
        return {s: {"losses": r["losses"]} for s, r in result.items()}
    from deepspeed.runtime import lr_schedules

    result["lrs"] = [schedule_lrs(getattr(lr_schedules, name), params) for name, params in SCHEDULES]
    return result


def schedule_lrs(scheduler_class, params: dict) -> list:
    """The learning rate of each of SCHEDULE_STEPS optimizer steps, the scheduler stepped after each."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = scheduler_class(optimizer, **params)
    lrs = []
    for _ in range(SCHEDULE_STEPS):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def torch_continuation(saved: dict, world: int) -> list:
    """The CONTINUE steps after the load as torch computes them in one process from the state
    DeepSpeed saved (`saved`: name -> (master, states), read through DeepSpeed's own API): torch's
    AdamW with Adam's step at SAVE_AT, the gradient formed as `world` data-parallel ranks form it
    (each rank's mean over its micro-batches, then the mean over ranks). The parameters after each
    step, by name."""
    model = Net(seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(saved[name][0])
    optimizer = torch.optim.AdamW(groups(model))
    for name, p in model.named_parameters():
        optimizer.state[p] = {"step": torch.tensor(float(SAVE_AT)),
                              **{k: saved[name][1][k].clone().view(p.shape) for k in STATE_KEYS}}
    params = []
    for step in range(SAVE_AT, SAVE_AT + CONTINUE):
        grads = []
        for rank in range(world):
            model.zero_grad()
            loss_of(model, *global_batch(step, rank, world)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = sum(per_rank) / world
        optimizer.step()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params


def zerodp_continue(rank: int, world: int, folder: str, stage: int) -> dict:
    import zerodp

    model = Net(seed=7)
    config = zerodp.Config(stage=stage)
    model, optimizer = zerodp.initialize(model, torch.optim.AdamW(groups(model, lr=(0.5, 0.5), weight_decay=(0.3, 0.3))),
                                         config)
    extra = zerodp.load(folder, model, optimizer)
    loaded = [(s.name, s.start, s.numel, s.read(s.master).clone(), {k: s.read(v).clone() for k, v in s.states.items()})
              for s in optimizer.owned_slices()]
    hyper = [{k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in g.items() if k != "params"}
             for g in optimizer.param_groups]
    scalars = optimizer.scalar_states()
    buffer = model.shift.detach().clone()
    losses, params = [], []
    for step in range(SAVE_AT, SAVE_AT + CONTINUE):
        x, y = global_batch(step, rank, world)
        loss = loss_of(model, x, y)
        losses.append(loss.item())
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        full = zerodp.full_state_dict(model, optimizer)
        params.append({k: v.float().clone() for k, v in full.items() if k != "shift"})
    dist.barrier()
    return {"loaded": loaded, "hyper": hyper, "scalars": scalars, "buffer": buffer, "losses": losses,
            "params": params, "extra": {k: v for k, v in extra.items() if k in ("data_position", "global_steps")},
            "step_count": optimizer.step_count}


def trainer_with_deepspeed(rank: int, world: int, out_dir: str, ds_config: dict) -> dict:
    """zerodp's HF Trainer given TrainingArguments(deepspeed=...): what it built, and 3 steps."""
    from hf_trainer_cases import Windows, build_model
    from zerodp.deepspeed_config.optim import DeepSpeedWarmupLR
    from zerodp.integrations.hf import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=out_dir, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                             adam_beta2=0.99, weight_decay=0.05, warmup_steps=2, max_grad_norm=1.0, logging_steps=1,
                             save_strategy="no", report_to=[], disable_tqdm=True, seed=0, use_cpu=True,
                             dataloader_num_workers=0, deepspeed=ds_config)
    model = build_model()
    trainer = Trainer(model=model, args=args, train_dataset=Windows(8, seed=1))
    config = trainer.zerodp_config.to_dict()
    trainer.train()
    scheduler = trainer.lr_scheduler
    log = trainer.state.log_history
    return {"config": config, "taken_out": (args.deepspeed, args.zerodp_deepspeed == ds_config),
            "optimizer": type(trainer.optimizer.inner).__name__,
            "groups": [(len(g["params"]), g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"])
                       for g in trainer.optimizer.param_groups],
            "trainable": sum(1 for p in model.parameters() if p.requires_grad),
            "scheduler": (type(scheduler).__name__, isinstance(scheduler, DeepSpeedWarmupLR),
                          scheduler.min_lrs, scheduler.max_lrs, scheduler.warmup_num_steps),
            "lrs": [e["learning_rate"] for e in log if "loss" in e],
            "losses": [e["loss"] for e in log if "loss" in e]}
