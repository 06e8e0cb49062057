"""Switching from DeepSpeed (docs/deepspeed.md).

- `Config.from_deepspeed`: the Hugging Face docs' ZeRO-2 and ZeRO-3 "auto" example configs
  (transformers' docs/source/en/main_classes/deepspeed.md, "ZeRO-2 Example" / "ZeRO-3
  Example", copied below as written there) mapped field by field, with TrainingArguments and
  without; a table of keys refused, each error naming the key; keys without effect logged once;
  the optimizer and scheduler blocks built as torch objects.
- `zerodp.load` of a real DeepSpeed checkpoint (deepspeed_cases.py: DeepSpeed on CPU with gloo,
  torch's AdamW in two param groups, saved at stages 2 and 3 by 2 ranks), into zerodp at the
  same world size and stage and at another (N=1, stages 3 and 1): the loaded masters and Adam
  states equal what DeepSpeed held, and the next steps follow torch's AdamW continuing from
  that state (and DeepSpeed's own continuation after its `load_checkpoint`, where it repeats).
- zerodp's HF Trainer given `TrainingArguments(deepspeed=...)`.

Tolerances of the continuation, derived as tests/tolerances.py derives its bounds, per
element, over CONTINUE = 3 steps:
- The load copies values: masters, exp_avg, exp_avg_sq, step and hyperparameters are equal bit
  for bit.
- The steps after the load against torch's AdamW continuing in one process from the state
  DeepSpeed saved (deepspeed_cases.torch_continuation), its gradient formed as zerodp's world
  forms it: the same arithmetic up to the order of a few roundings (measured: equal, or 1e-9
  apart at the third step). AdamW divides by sqrt(v), so an element whose gradient is near zero
  may move by up to lr per step of either sign under any rounding difference: 2 lr per step
  (tolerances.adamw_tol), 0.06 at lr 1e-2 over 3 steps. A misplaced shard, an unrestored
  parameter or state (O(0.1-1) apart) fails it, and a lost state or step is caught exactly above.
- DeepSpeed's own continuation after its `load_checkpoint`: at stage 2 and the same world size
  each rank runs the same forward and backward on bit-equal weights and its own micro-batch as
  DeepSpeed's rank did, the gradient average over 2 ranks is exact in any order and AdamW is
  elementwise, so zerodp's steps equal DeepSpeed's bit for bit. At stage 3 (CPU, gloo) DeepSpeed's
  own continuation is not repeatable: in about 1 run of 10 its first step landed 0.28 away from
  the run before while its loaded state and first loss were equal, and zerodp's N=1 stage-1
  continuation (one process, nothing to reorder) differed from it by the same 0.28; so only its
  first loss is compared there.
- The first loss after the load depends on the loaded weights only: at N=2 the same
  computation (equal), at N=1 a mean of 8 values rounded once more: within 8 u relative.
"""
import copy
import importlib.util
import json
import logging
import math
import shutil
import types

import pytest
import torch

from tolerances import U32, adamw_tol
from zerodp import Config, ConfigError
from zerodp.deepspeed_config.optim import DeepSpeedWarmupLR

deepspeed_cases = pytest.importorskip("deepspeed_cases")

# transformers' docs, main_classes/deepspeed.md, "ZeRO-2 Example": "a full ZeRO-2 auto-configuration file".
ZERO2_AUTO = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
# The same page, "ZeRO-3 Example": "a full ZeRO-3 auto-configuration file".
ZERO3_AUTO = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
FP16_KEYS = ["fp16.loss_scale", "fp16.loss_scale_window", "fp16.initial_scale_power", "fp16.hysteresis",
             "fp16.min_loss_scale"]


def training_args(**changes):
    """The TrainingArguments fields the translation reads (the HF Trainer's names)."""
    values = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, world_size=2, max_grad_norm=0.5,
                  learning_rate=3e-4, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.01,
                  fp16=False, bf16=False, fp16_full_eval=False, bf16_full_eval=False, warmup_steps=5)
    values.update(changes)
    args = types.SimpleNamespace(**values)
    args.get_warmup_steps = lambda n: int(args.warmup_steps) if args.warmup_steps >= 1 else math.ceil(
        n * args.warmup_steps)
    return args


HIDDEN = 64
MODEL = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=HIDDEN))


def built_optimizer(outside):
    p = torch.nn.Parameter(torch.zeros(3))
    opt = outside.optimizer([p])
    return type(opt).__name__, {k: opt.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")}


# -- the HF docs' configs, field by field -----------------------------------------------------------
def test_hf_zero2_auto_config_maps_field_by_field():
    cfg, out = Config.from_deepspeed(ZERO2_AUTO, training_args=training_args(), num_training_steps=100)
    assert cfg == Config(stage=2, offload_optimizer="host", overlap_comm=True, bucket_bytes=int(2e8) * 4,
                         grad_accumulation_steps=2)
    assert (out.grad_clip, out.micro_batch_size, out.train_batch_size) == (0.5, 4, 4 * 2 * 2)
    assert built_optimizer(out) == ("AdamW", {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.01})
    sched = out.scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0))
    assert (sched.min_lrs, sched.max_lrs, sched.warmup_num_steps, sched.total_num_steps) == ([0.0], [3e-4], 5, None)
    assert out.auto == {"fp16.enabled": False, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 4,
                        "train_batch_size": 16, "gradient_clipping": 0.5, "optimizer.params.lr": 3e-4,
                        "optimizer.params.betas": [0.9, 0.95], "optimizer.params.eps": 1e-6,
                        "optimizer.params.weight_decay": 0.01, "scheduler.params.warmup_min_lr": 0,
                        "scheduler.params.warmup_max_lr": 3e-4, "scheduler.params.warmup_num_steps": 5}
    assert sorted(out.without_effect) == sorted(FP16_KEYS + [
        "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.allgather_partitions",
        "zero_optimization.reduce_scatter", "zero_optimization.contiguous_gradients", "steps_per_print",
        "wall_clock_breakdown"])


def test_hf_zero3_auto_config_maps_field_by_field():
    cfg, out = Config.from_deepspeed(ZERO3_AUTO, training_args=training_args(bf16=True), model=MODEL,
                                     num_training_steps=100)
    # reduce_bucket_size "auto" = hidden**2 elements (the HF Trainer's), 2 bytes each in bf16.
    assert cfg == Config(stage=3, mixed_precision="bf16", offload_optimizer="host", offload_params="host",
                         overlap_comm=True, bucket_bytes=HIDDEN * HIDDEN * 2, grad_accumulation_steps=2)
    assert out.auto["zero_optimization.reduce_bucket_size"] == HIDDEN * HIDDEN
    assert out.auto["zero_optimization.stage3_prefetch_bucket_size"] == int(0.9 * HIDDEN * HIDDEN)
    assert out.auto["zero_optimization.stage3_param_persistence_threshold"] == 10 * HIDDEN
    assert (out.grad_clip, out.micro_batch_size, out.train_batch_size) == (0.5, 4, 16)
    assert built_optimizer(out)[0] == "AdamW"
    assert sorted(out.without_effect) == sorted(FP16_KEYS + [
        "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory",
        "zero_optimization.contiguous_gradients", "zero_optimization.sub_group_size",
        "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "steps_per_print", "wall_clock_breakdown"])
    assert any("prefetches by units" in n for n in out.notes)


def test_hf_configs_without_training_arguments_say_what_auto_became(tmp_path, caplog):
    path = tmp_path / "ds_config_zero3.json"
    path.write_text(json.dumps(ZERO3_AUTO))
    with caplog.at_level(logging.WARNING, logger="zerodp.deepspeed_config"):
        cfg, out = Config.from_deepspeed(path)  # a JSON path; no model: the buckets keep zerodp's default
    assert cfg == Config(stage=3, offload_optimizer="host", offload_params="host", overlap_comm=True,
                         grad_accumulation_steps=1)
    # A default TrainingArguments()'s values.
    assert (out.grad_clip, out.micro_batch_size, out.train_batch_size) == (1.0, 8, None)
    assert built_optimizer(out) == ("AdamW", {"lr": 5e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # once for the keys without effect, once for the "auto" values
    assert "wall_clock_breakdown" in warnings[0] and "steps_per_print" in warnings[0]
    assert "optimizer.params.lr=5e-05" in warnings[1]
    assert Config.from_deepspeed(ZERO3_AUTO)[0] == cfg  # the dict gives the same


def test_fp16_maps_its_loss_scale_fields():
    ds = copy.deepcopy(ZERO2_AUTO)
    ds["fp16"]["hysteresis"] = 1
    ds["fp16"]["initial_scale_power"] = 12
    cfg, out = Config.from_deepspeed(ds, training_args=training_args(fp16=True))
    assert (cfg.mixed_precision, cfg.loss_scale, cfg.initial_loss_scale, cfg.loss_scale_growth_interval) == \
        ("fp16", "dynamic", 2.0 ** 12, 1000)
    ds["fp16"]["loss_scale"] = 128
    cfg, _ = Config.from_deepspeed(ds, training_args=training_args(fp16=True))
    assert cfg.loss_scale == 128.0


# -- refusals -----------------------------------------------------------------------------------------
def zero2(**top):
    ds = copy.deepcopy(ZERO2_AUTO)
    ds.update(top)
    return ds


def zero2_with(section: str, **values):
    ds = copy.deepcopy(ZERO2_AUTO)
    ds[section] = {**ds.get(section, {}), **values}
    return ds


REFUSED = [
    # (config, TrainingArguments changes, the key the error names)
    (ZERO2_AUTO, {"fp16": True}, "fp16.hysteresis"),
    (zero2_with("fp16", enabled=True, hysteresis=1, min_loss_scale=2), {"fp16": True}, "fp16.min_loss_scale"),
    (zero2_with("fp16", enabled=True, hysteresis=1, auto_cast=True), {"fp16": True}, "fp16.auto_cast"),
    (zero2(progressive_layer_drop={"enabled": True, "theta": 0.5}), {}, "progressive_layer_drop"),
    (zero2(curriculum_learning={"enabled": True}), {}, "curriculum_learning"),
    (zero2(prescale_gradients=True), {}, "prescale_gradients"),
    (zero2(gradient_predivide_factor=2.0), {}, "gradient_predivide_factor"),
    (zero2(sparse_gradients=True), {}, "sparse_gradients"),
    (zero2(amp={"enabled": True, "opt_level": "O1"}), {}, "amp"),
    (zero2(data_types={"grad_accum_dtype": "bf16"}), {}, "data_types"),
    (zero2(gradient_clipping_typo=1.0), {}, "gradient_clipping_typo"),
    (zero2_with("zero_optimization", offload_optimizer={"device": "cpu", "ratio": 0.3}), {},
     "zero_optimization.offload_optimizer.ratio"),
    (zero2_with("zero_optimization", zero_quantized_nontrainable_weights=True), {},
     "zero_optimization.zero_quantized_nontrainable_weights"),
    (zero2_with("zero_optimization", stage=3, offload_param={"device": "cpu"}, offload_optimizer=None), {},
     "zero_optimization.offload_param.device"),  # zerodp offloads the shards only with the optimizer
    (zero2_with("zero_optimization", stage=2, zero_quantized_weights=True), {},
     "zero_optimization.zero_quantized_weights"),  # ZeRO++ moves stage 3's gathers
    (zero2_with("zero_optimization", mics_shard_size=2), {"world_size": 3}, "mics_shard_size"),
    (zero2_with("zero_optimization", unknown_knob=1), {}, "zero_optimization.unknown_knob"),
    (zero2_with("optimizer", type="Lamb"), {}, "optimizer.type"),
    (zero2_with("optimizer", type="OneBitAdam"), {}, "optimizer.type"),
    (zero2_with("scheduler", type="OneCycle", params={}), {}, "scheduler.type"),
    (zero2(gradient_clipping=2.0), {}, "gradient_clipping"),  # contradicts max_grad_norm, as the HF Trainer says
    (zero2(train_micro_batch_size_per_gpu=3), {}, "train_micro_batch_size_per_gpu"),
    (zero2_with("zero_optimization", stage3_max_live_parameters="auto"), {},
     "zero_optimization.stage3_max_live_parameters"),  # "auto" the HF Trainer does not resolve
    (zero2_with("fp16", enabled=True), {"bf16": True}, "fp16.enabled"),
]


@pytest.mark.parametrize("ds, changes, key", REFUSED, ids=[r[2] for r in REFUSED])
def test_refused_keys_are_named(ds, changes, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Config.from_deepspeed(ds, training_args=training_args(**changes), model=MODEL, num_training_steps=100)


def test_a_scheduler_whose_length_is_auto_needs_the_run_s_length():
    ds = zero2_with("scheduler", type="WarmupDecayLR",
                    params={"total_num_steps": "auto", "warmup_num_steps": 10, "warmup_max_lr": 1e-3})
    with pytest.raises(ConfigError, match="total_num_steps"):
        Config.from_deepspeed(ds)
    _, out = Config.from_deepspeed(ds, num_training_steps=50)
    assert out.auto["scheduler.params.total_num_steps"] == 50


# -- the optimizer and scheduler blocks --------------------------------------------------------------
@pytest.mark.parametrize("block, expected", [
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false; its defaults, not torch's.
    ({"type": "Adam", "params": {"lr": 0.1}}, ("AdamW", {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8,
                                                          "weight_decay": 0.0})),
    ({"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": False, "weight_decay": 0.2}},
     ("Adam", {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.2})),
    ({"type": "AdamW", "params": {"lr": 0.1, "betas": [0.8, 0.9], "torch_adam": True}},
     ("AdamW", {"lr": 0.1, "betas": (0.8, 0.9), "eps": 1e-8, "weight_decay": 0.0})),
])
def test_adam_blocks_build_torch_adam(block, expected):
    _, out = Config.from_deepspeed({"optimizer": block})
    assert built_optimizer(out) == expected


def test_other_torch_optimizers_are_built_by_name():
    _, out = Config.from_deepspeed({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})
    opt = out.optimizer([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2), requires_grad=False)])
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["momentum"] == 0.9
    assert len(opt.param_groups[0]["params"]) == 1  # every trainable parameter, one group, as DeepSpeed


# -- a real DeepSpeed checkpoint ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: only the DeepSpeed world runs it
        pytest.skip("deepspeed is not installed (pip install -e '.[test]')")
    from harness import run_world

    out = tmp_path_factory.mktemp("deepspeed")
    ranks = run_world(deepspeed_cases.DS_WORLD, deepspeed_cases.deepspeed_world, str(out), timeout_s=420)
    return ranks


def test_deepspeed_schedulers_match_deepspeed_s_own(deepspeed_run):
    for (name, params), theirs in zip(deepspeed_cases.SCHEDULES, deepspeed_run[0]["lrs"]):
        ours = deepspeed_cases.schedule_lrs(lambda opt, **kw: DeepSpeedWarmupLR(opt, **kw), params)
        assert ours == pytest.approx(theirs, rel=4 * U32, abs=0), name  # the same formula, one rounding apart


CASES = [(2, 2, 2), (2, 1, 3), (3, 2, 3), (3, 1, 1)]  # (DeepSpeed's stage, zerodp's world size, zerodp's stage)


@pytest.mark.parametrize("ds_stage, world, stage", CASES, ids=[f"ds{a}-to-N{b}-stage{c}" for a, b, c in CASES])
def test_deepspeed_checkpoint_loads_and_continues_as_deepspeed(deepspeed_run, pool, ds_stage, world, stage):
    ref = deepspeed_run[0][ds_stage]
    ranks = pool.run(world, deepspeed_cases.zerodp_continue, ref["folder"], stage, timeout_s=300)
    # The loaded state, by name, as DeepSpeed held it: bit for bit.
    pieces = {}
    for rank in ranks:
        for name, start, numel, master, states in rank["loaded"]:
            pieces.setdefault(name, []).append((start, master, states))
    for name, (master, states) in ref["saved"].items():
        runs = sorted(pieces[name], key=lambda r: r[0])
        assert torch.equal(torch.cat([m for _, m, _ in runs]), master.reshape(-1)), name
        for key in deepspeed_cases.STATE_KEYS:
            assert torch.equal(torch.cat([s[key] for _, _, s in runs]), states[key].reshape(-1)), (name, key)
    assert torch.equal(ranks[0]["buffer"], ref["buffer"])
    assert ref["step"] == [float(deepspeed_cases.SAVE_AT)]  # Adam's step, every flat group
    assert {s["step"] for r in ranks for s in r["scalars"] if s} == {float(deepspeed_cases.SAVE_AT)}
    assert [(g["lr"], g["weight_decay"]) for g in ranks[0]["hyper"]] == list(zip(deepspeed_cases.LR,
                                                                                  deepspeed_cases.WEIGHT_DECAY))
    assert ranks[0]["extra"] == {"data_position": deepspeed_cases.SAVE_AT, "global_steps": deepspeed_cases.SAVE_AT}
    assert ranks[0]["step_count"] == deepspeed_cases.SAVE_AT + deepspeed_cases.CONTINUE
    # The continuation (module docstring): the first loss depends on the loaded weights only, so it
    # is checked against DeepSpeed's own after its load_checkpoint; the steps against torch's
    # AdamW continuing from the state DeepSpeed saved, its gradient formed as this world forms it.
    ds_losses = [sum(per_rank) / deepspeed_cases.DS_WORLD
                 for per_rank in zip(*(r[ds_stage]["losses"] for r in deepspeed_run))]
    losses = [sum(per_rank) / world for per_rank in zip(*(r["losses"] for r in ranks))]
    same_world = world == deepspeed_cases.DS_WORLD
    assert losses[0] == pytest.approx(ds_losses[0], rel=0 if same_world else 8 * U32, abs=0)
    expected = deepspeed_cases.torch_continuation(ref["saved"], world)
    tol = adamw_tol(max(deepspeed_cases.LR), deepspeed_cases.CONTINUE)
    for step, (ours, theirs) in enumerate(zip(ranks[0]["params"], expected)):
        worst = max((ours[n] - theirs[n]).abs().max().item() for n in theirs)
        assert worst <= tol, f"step {step}: {worst:.3g} > {tol:.3g}"
    if ds_stage == 2 and same_world:
        # DeepSpeed's own continuation, where it is repeatable (stage 2; see the module docstring).
        for step, (ours, theirs) in enumerate(zip(ranks[0]["params"], ref["params"])):
            assert all(torch.equal(ours[n], theirs[n]) for n in theirs), step
        assert losses == ds_losses


def test_a_broken_deepspeed_checkpoint_is_refused_before_anything_changes(deepspeed_run, pool, tmp_path):
    folder = tmp_path / "ds"
    shutil.copytree(deepspeed_run[0][2]["folder"], folder)
    tag = (folder / "latest").read_text().strip()
    (folder / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(RuntimeError, match="partition_count"):
        pool.run(1, deepspeed_cases.zerodp_continue, str(folder), 2, timeout_s=120)
    (folder / "latest").write_text("../elsewhere")
    with pytest.raises(RuntimeError, match="not a checkpoint tag"):
        pool.run(1, deepspeed_cases.zerodp_continue, str(folder), 2, timeout_s=120)


# -- the HF Trainer ----------------------------------------------------------------------------------
def test_hf_trainer_takes_training_arguments_deepspeed(pool, tmp_path):
    pytest.importorskip("transformers")
    result = pool.run(1, deepspeed_cases.trainer_with_deepspeed, str(tmp_path), ZERO3_AUTO, timeout_s=300)[0]
    hidden = 32  # hf_trainer_cases.build_model's
    expected = Config(stage=3, offload_optimizer="host", offload_params="host", overlap_comm=True,
                      bucket_bytes=hidden * hidden * 4).to_dict()
    assert result["config"] == expected
    assert result["taken_out"] == (None, True)  # transformers' own handling (DeepSpeed's plugin) never saw it
    # DeepSpeed's optimizer block: AdamW over every trainable parameter in one group, from the arguments.
    assert result["optimizer"] == "AdamW"
    assert result["groups"] == [(result["trainable"], result["groups"][0][1], (0.9, 0.99), 1e-8, 0.05)]
    assert result["scheduler"] == ("DeepSpeedWarmupLR", True, [0.0], [1e-2], 2)
    # The rate each step ran at, as the Trainer logs it: DeepSpeed's log warm-up over 2 steps, which
    # runs its first two steps at warmup_min_lr (iterations -1 and 0, gamma = log(1) = 0).
    assert result["lrs"] == pytest.approx([0.0, 0.0, 1e-2], abs=1e-12)
    assert all(math.isfinite(v) for v in result["losses"])


def test_plain_training_arguments_with_deepspeed_are_refused_naming_zerodp_s():
    pytest.importorskip("transformers")
    from zerodp.integrations import hf

    with pytest.raises(ConfigError, match="zerodp.integrations.hf.TrainingArguments"):
        hf._deepspeed_translation(types.SimpleNamespace(deepspeed={"zero_optimization": {"stage": 2}}), None, None)
