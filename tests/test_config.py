import dataclasses
import json
import math

import pytest
import torch

import zerodp
from zerodp import Config, ConfigError

# The set of options is pinned: adding one is a decision, not a drive-by.
FIELDS = {"stage", "mixed_precision", "reduce_dtype", "loss_scale", "initial_loss_scale",
          "loss_scale_growth_interval", "bucket_bytes", "overlap_comm", "grad_accumulation_steps",
          "reduce_each_micro_batch", "cast_buffers", "nonfinite_grads", "replicate_size", "collective_timeout_s",
          "unit_modules", "unit_min_params", "reshard_after_forward", "prefetch_units", "debug",
          "hpz", "quantize_weights", "quantize_grads", "quantize_block_size", "offload_optimizer", "offload_params",
          "offload_dir", "delayed_update_after", "tensor_parallel_size", "partition_activations",
          "activations_on_host", "expert_parallel_size", "sequence_parallel_size", "tiled_loss", "tiled_mlp",
          "compile_units"}


def test_fields_are_pinned():
    assert {f.name for f in dataclasses.fields(Config)} == FIELDS


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().stage = 1


BAD = [
    ({"stage": 4}, "stage", "0, 1, 2 or 3"),
    ({"stage": "2"}, "stage", "0, 1, 2 or 3"),
    ({"replicate_size": 0}, "replicate_size", "positive integer"),
    ({"collective_timeout_s": 0}, "collective_timeout_s", "positive number of seconds"),
    ({"mixed_precision": "fp8"}, "mixed_precision", "bf16"),
    ({"reduce_dtype": "int8"}, "reduce_dtype", "fp32"),
    ({"loss_scale": "auto"}, "loss_scale", "dynamic"),
    ({"loss_scale": -1.0}, "loss_scale", "positive"),
    ({"bucket_bytes": -5}, "bucket_bytes", "positive integer"),
    ({"bucket_bytes": 0}, "bucket_bytes", "positive integer"),
    ({"grad_accumulation_steps": 0}, "grad_accumulation_steps", "positive integer"),
    ({"overlap_comm": "yes"}, "overlap_comm", "true or false"),
    ({"prefetch_units": -1}, "prefetch_units", ">= 0"),
    ({"unit_modules": [3]}, "unit_modules", "classes or class names"),
    ({"stage": 2, "hpz": True}, "hpz", "use stage 3"),
    ({"stage": 2, "quantize_weights": True}, "quantize_weights", "use stage 3"),
    ({"quantize_grads": "int2", "stage": 3}, "quantize_grads", "int4"),
    ({"quantize_grads": "int8", "stage": 3, "replicate_size": 2}, "quantize_grads", "hybrid sharding"),
    ({"hpz": True, "stage": 3, "replicate_size": "nodes"}, "hpz", "hybrid sharding"),
    ({"hpz": True, "stage": 3, "reshard_after_forward": False}, "hpz", "backward gathers nothing"),
    ({"quantize_block_size": 0, "stage": 3, "quantize_weights": True}, "quantize_block_size", "positive integer"),
    ({"hpz": 1, "stage": 3}, "hpz", "true or false"),
    ({"compile_units": "yes"}, "compile_units", "true or false"),
    ({"compile_units": True, "tensor_parallel_size": 2}, "compile_units", "inside the forward"),
    ({"offload_optimizer": "nvme"}, "offload_optimizer", "'host'"),
    ({"offload_optimizer": "host", "stage": 0}, "offload_optimizer", "use stage 1, 2 or 3"),
    ({"offload_dir": None, "offload_optimizer": "disk"}, "offload_dir", "give a path"),
    ({"offload_params": "ssd", "stage": 3, "offload_optimizer": "host"}, "offload_params", "'disk'"),
    ({"offload_params": "host", "stage": 2, "offload_optimizer": "host"}, "offload_params", "use stage 3"),
    ({"offload_params": "host", "stage": 3}, "offload_params", "offload_optimizer to 'host' or 'disk'"),
    ({"offload_dir": None, "offload_params": "disk", "stage": 3, "offload_optimizer": "host"}, "offload_dir",
     "give a path"),
    ({"delayed_update_after": -1, "stage": 2, "offload_optimizer": "host"}, "delayed_update_after", ">= 0"),
    ({"delayed_update_after": 0, "stage": 2}, "delayed_update_after", "offload_optimizer='host'"),
    ({"delayed_update_after": 0, "stage": 3, "offload_optimizer": "host", "offload_params": "host"},
     "delayed_update_after", "offload_params='none'"),
    ({"initial_loss_scale": 0}, "initial_loss_scale", "positive"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size", "positive integer"),
    ({"partition_activations": "yes"}, "partition_activations", "true or false"),
    ({"activations_on_host": 1}, "activations_on_host", "true or false"),
    ({"partition_activations": True}, "partition_activations", "tensor_parallel_size=1 has one"),
    ({"hpz": True, "stage": 3, "tensor_parallel_size": 2}, "hpz", "tensor_parallel_size=1"),
    ({"quantize_grads": "int8", "stage": 3, "tensor_parallel_size": 2}, "quantize_grads", "tensor_parallel_size=1"),
    # Every numeric field, for finiteness and range (issue 22 item 23): inf was accepted, then
    # initialize raised an OverflowError naming nothing (the timeout), or fp16 skipped every
    # step forever (the loss scale).
    ({"collective_timeout_s": math.inf}, "collective_timeout_s", "positive number of seconds, at most"),
    ({"collective_timeout_s": math.nan}, "collective_timeout_s", "positive number of seconds"),
    ({"collective_timeout_s": -1.0}, "collective_timeout_s", "positive number of seconds"),
    ({"collective_timeout_s": 1e12}, "collective_timeout_s", "at most 31,536,000 (a year)"),
    ({"collective_timeout_s": True}, "collective_timeout_s", "positive number of seconds"),
    ({"loss_scale": math.inf, "mixed_precision": "fp16"}, "loss_scale", "positive, finite number"),
    ({"loss_scale": -math.inf, "mixed_precision": "fp16"}, "loss_scale", "positive, finite number"),
    ({"loss_scale": math.nan, "mixed_precision": "fp16"}, "loss_scale", "positive, finite number"),
    ({"loss_scale": 0, "mixed_precision": "fp16"}, "loss_scale", "positive, finite number"),
    ({"loss_scale": True}, "loss_scale", "positive, finite number"),
    ({"initial_loss_scale": math.inf, "mixed_precision": "fp16"}, "initial_loss_scale", "positive, finite"),
    ({"initial_loss_scale": math.nan}, "initial_loss_scale", "positive, finite"),
    ({"initial_loss_scale": -2.0}, "initial_loss_scale", "positive, finite"),
    ({"loss_scale_growth_interval": math.inf}, "loss_scale_growth_interval", "positive integer"),
    ({"loss_scale_growth_interval": 0}, "loss_scale_growth_interval", "positive integer"),
    ({"bucket_bytes": math.inf}, "bucket_bytes", "positive integer"),
    ({"grad_accumulation_steps": math.nan}, "grad_accumulation_steps", "positive integer"),
    ({"grad_accumulation_steps": 2.0}, "grad_accumulation_steps", "positive integer"),
    ({"replicate_size": math.inf}, "replicate_size", "positive integer"),
    ({"unit_min_params": math.inf}, "unit_min_params", "positive integer"),
    ({"unit_min_params": -1}, "unit_min_params", "positive integer"),
    ({"prefetch_units": math.inf}, "prefetch_units", ">= 0"),
    ({"quantize_block_size": math.nan, "stage": 3, "quantize_weights": True}, "quantize_block_size",
     "positive integer"),
    ({"quantize_block_size": -8}, "quantize_block_size", "positive integer"),
    ({"delayed_update_after": math.inf, "stage": 2, "offload_optimizer": "host"}, "delayed_update_after", ">= 0"),
    ({"tensor_parallel_size": math.nan}, "tensor_parallel_size", "positive integer"),
    ({"tensor_parallel_size": -2}, "tensor_parallel_size", "positive integer"),
]


@pytest.mark.parametrize("values,field,allowed", BAD, ids=[b[1] + "=" + repr(list(b[0].values())[0]) for b in BAD])
def test_bad_values_name_field_value_and_fix(values, field, allowed):
    with pytest.raises(ConfigError) as e:
        Config.from_dict(values)
    msg = str(e.value)
    assert f"Config.{field}=" in msg and repr(list(values.values())[0]) in msg and allowed in msg


def test_numeric_limits_are_accepted():
    """The bounds themselves are allowed: the checks refuse only what cannot work."""
    c = Config(collective_timeout_s=365 * 24 * 3600, mixed_precision="fp16", loss_scale=2.0**24,
               delayed_update_after=0, offload_optimizer="host")
    assert c.collective_timeout_s == 31_536_000 and c.loss_scale == 2.0**24
    assert Config(mixed_precision="fp16", initial_loss_scale=1e-3).initial_loss_scale == 1e-3
    assert Config(stage=3, prefetch_units=0).prefetch_units == 0


# A field away from its default where the other fields leave it nothing to do ([Note: no
# silent setting] in config.py): one row per rule, (the values, the field the message names).
WITHOUT_EFFECT = [
    ({"stage": 1, "unit_modules": ["Block"]}, "unit_modules"),
    ({"stage": 2, "unit_min_params": 10}, "unit_min_params"),
    ({"stage": 0, "reshard_after_forward": False}, "reshard_after_forward"),
    ({"stage": 1, "prefetch_units": 5}, "prefetch_units"),
    ({"stage": 1, "prefetch_units": 0}, "prefetch_units"),
    ({"stage": 3, "unit_modules": ["Block"], "unit_min_params": 10}, "unit_min_params"),
    ({"mixed_precision": "bf16", "loss_scale": 3.0}, "loss_scale"),
    ({"loss_scale": 1024.0}, "loss_scale"),
    ({"mixed_precision": "bf16", "initial_loss_scale": 1024.0}, "initial_loss_scale"),
    ({"loss_scale_growth_interval": 2}, "loss_scale_growth_interval"),
    ({"mixed_precision": "fp16", "loss_scale": 8.0, "initial_loss_scale": 1024.0}, "initial_loss_scale"),
    ({"mixed_precision": "fp16", "loss_scale": 8.0, "loss_scale_growth_interval": 2}, "loss_scale_growth_interval"),
    ({"mixed_precision": "fp16", "nonfinite_grads": "skip"}, "nonfinite_grads"),
    ({"mixed_precision": "fp16", "nonfinite_grads": "proceed"}, "nonfinite_grads"),
    ({"stage": 0, "grad_accumulation_steps": 2, "reduce_each_micro_batch": False}, "reduce_each_micro_batch"),
    ({"stage": 1, "reduce_each_micro_batch": False}, "reduce_each_micro_batch"),
    ({"stage": 3, "quantize_block_size": 256}, "quantize_block_size"),
    ({"stage": 3, "hpz": True, "quantize_block_size": 256}, "quantize_block_size"),
    ({"offload_dir": "/tmp"}, "offload_dir"),
    ({"offload_optimizer": "host", "offload_dir": "/tmp"}, "offload_dir"),
    ({"stage": 2, "debug": True}, "debug"),
]


@pytest.mark.parametrize("values,field", WITHOUT_EFFECT,
                         ids=[f"{f}:{','.join(f'{k}={v}' for k, v in v.items())}" for v, f in WITHOUT_EFFECT])
def test_a_setting_without_effect_is_refused_naming_what_it_needs(values, field):
    with pytest.raises(ConfigError) as e:
        Config(**values)
    msg = str(e.value)
    default = next(f.default for f in dataclasses.fields(Config) if f.name == field)
    assert msg.startswith(f"Config.{field}=") and "no effect" in msg and f"leave it at {default!r}" in msg, msg
    # The same value where it acts is accepted: the refusal is about the combination.
    fixed = dict(values)
    if field in ("unit_modules", "reshard_after_forward", "prefetch_units", "debug") or \
            (field == "unit_min_params" and "unit_modules" not in values):
        fixed["stage"] = 3
    elif field == "unit_min_params":
        del fixed["unit_modules"]
    elif field in ("loss_scale", "initial_loss_scale", "loss_scale_growth_interval"):
        fixed.update(mixed_precision="fp16", loss_scale=values.get("loss_scale", "dynamic") if field == "loss_scale"
                     else "dynamic")
    elif field == "nonfinite_grads":
        fixed["mixed_precision"] = "bf16"
    elif field == "reduce_each_micro_batch":
        fixed["stage"] = 2
    elif field == "quantize_block_size":
        fixed["quantize_weights"] = True
    elif field == "offload_dir":
        fixed.update(stage=2, offload_optimizer="disk")
    Config(**fixed)


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_every_default_is_accepted_alone(field):
    default = next(f.default for f in dataclasses.fields(Config) if f.name == field)
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16", "fp16"):
            Config(**{"stage": stage, "mixed_precision": precision, field: default})


def test_a_saved_config_loads_again():
    """A checkpoint stores `to_dict()`: every field, defaults included (a stage-1 config
    saves unit_modules=[]); it reads back as the same Config."""
    for config in (Config(stage=1), Config(stage=3, unit_modules=["Block"], prefetch_units=2),
                   Config(mixed_precision="fp16", loss_scale=128.0), Config(stage=0, mixed_precision="bf16")):
        assert Config.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# Combinations the README's Config table documents: each is accepted.
DOCUMENTED = [
    {"stage": 3, "unit_modules": ["Block"], "reshard_after_forward": False, "prefetch_units": 2},
    {"stage": 3, "unit_min_params": 4000},
    {"mixed_precision": "fp16", "loss_scale": 1024.0},
    {"mixed_precision": "fp16", "initial_loss_scale": 1024.0, "loss_scale_growth_interval": 2},
    {"mixed_precision": "bf16", "nonfinite_grads": "skip"},
    {"nonfinite_grads": "proceed"},
    {"mixed_precision": "bf16", "cast_buffers": True, "reduce_dtype": "fp32"},
    {"stage": 2, "grad_accumulation_steps": 4, "reduce_each_micro_batch": False},
    {"stage": 3, "reduce_each_micro_batch": False},  # the HF Trainer sets grad_accumulation_steps later
    {"stage": 3, "hpz": True, "quantize_weights": True, "quantize_grads": "int4", "quantize_block_size": 256},
    {"stage": 3, "quantize_grads": "int8", "quantize_block_size": 512},
    {"stage": 1, "offload_optimizer": "host", "delayed_update_after": 10},
    {"stage": 2, "offload_optimizer": "disk", "offload_dir": "/tmp"},
    {"stage": 3, "offload_optimizer": "host", "offload_params": "disk", "offload_dir": "/tmp"},
    {"replicate_size": "nodes"},
    {"stage": 3, "replicate_size": 2},
    {"tensor_parallel_size": 2, "partition_activations": True, "activations_on_host": True, "debug": True},
    {"activations_on_host": True},
    {"stage": 3, "debug": True},
]


@pytest.mark.parametrize("values", DOCUMENTED, ids=[",".join(map(str, v)) for v in DOCUMENTED])
def test_documented_combinations_are_accepted(values):
    Config(**values)


def test_unknown_key():
    with pytest.raises(ConfigError, match="no field 'stages'.*allowed fields"):
        Config.from_dict({"stages": 2})


def test_from_json_and_yaml(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"stage": 1, "mixed_precision": "bf16"}))
    (tmp_path / "c.yaml").write_text("stage: 3\nbucket_bytes: 1024\nunit_modules: [Block]\n")
    assert Config.from_file(tmp_path / "c.json") == Config(stage=1, mixed_precision="bf16")
    c = Config.from_file(tmp_path / "c.yaml")
    assert (c.stage, c.bucket_bytes, c.unit_modules) == (3, 1024, ("Block",))
    (tmp_path / "c.yaml").write_text("stage: 7\n")
    with pytest.raises(ConfigError, match="stage=7"):
        Config.from_file(tmp_path / "c.yaml")
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigError, match="suffix"):
        Config.from_file(tmp_path / "c.toml")


def test_derived_dtypes():
    c = Config(mixed_precision="bf16")
    assert c.compute_dtype == torch.bfloat16 and c.grad_reduce_dtype == torch.bfloat16
    assert Config(mixed_precision="bf16", reduce_dtype="fp32").grad_reduce_dtype == torch.float32


def test_initialize_errors():
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zerodp.initialize(frozen, torch.optim.SGD, Config(), lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        zerodp.initialize(torch.nn.Linear(2, 2), "adam", Config())
    with pytest.raises(ValueError, match="only for an optimizer class"):
        zerodp.initialize(torch.nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=1), Config(), lr=0.1)
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="in no optimizer param group"):
        zerodp.initialize(m, lambda ps: torch.optim.SGD([m.weight], lr=1), Config())
    with pytest.raises(ValueError, match="not elementwise"):
        zerodp.initialize(torch.nn.Linear(2, 2), torch.optim.LBFGS, Config())
    with pytest.raises(ConfigError):
        zerodp.initialize(torch.nn.Linear(2, 2), torch.optim.SGD, {"stage": 9}, lr=0.1)


def test_init_distributed_single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert zerodp.init_distributed() == (0, 1)


def test_a_tensor_parallel_refusal_reads_as_one_sentence():
    with pytest.raises(ConfigError) as e:
        Config(stage=3, hpz=True, tensor_parallel_size=2)
    assert str(e.value) == ("Config.hpz=True is not allowed: hpZ keeps a copy per node, and under "
                            "tensor_parallel_size=2 the data-parallel group skips the tensor-parallel ranks, over "
                            "which ZeRO++'s node axes are not built; use False, or tensor_parallel_size=1")


# -- the Config against its world (config_world.py): pure, one process ------------------------
TORCHRUN_2x2 = {"local_world_size": 2, "rank": 3, "node_rank": 1}  # rank 3, the second of node 1's two

# (Config values, WorldFacts values, a piece of the message); one row per refusal.
WORLD_REFUSED = [
    ({"tensor_parallel_size": 2}, {"world_size": 4, "default_group": False}, "pass no process_group"),
    ({"replicate_size": "nodes"}, {"world_size": 4, "default_group": False, **TORCHRUN_2x2},
     "needs the default process group"),
    ({"stage": 3, "hpz": True}, {"world_size": 4, "default_group": False, **TORCHRUN_2x2},
     "need the default process group"),
    ({"tensor_parallel_size": 2, "stage": 3}, {"world_size": 4, "model_on_meta": True}, "meta device"),
    ({"tensor_parallel_size": 3}, {"world_size": 4}, "tensor_parallel_size=3 does not divide the world size 4"),
    ({"tensor_parallel_size": 2}, {"world_size": 4, "device_type": "mps"}, "on a mps device"),
    ({"stage": 2, "offload_optimizer": "disk", "offload_dir": "/tmp"}, {"device_type": "cuda"},
     "offload_optimizer='disk' runs on CPU only"),
    ({"stage": 3, "hpz": True}, {"world_size": 4}, "hpz / quantize_grads takes the nodes from torchrun, but "
                                                   "LOCAL_WORLD_SIZE, RANK, GROUP_RANK is not set"),
    ({"stage": 3, "quantize_grads": "int8"}, {"world_size": 4, "local_world_size": 2, "rank": 3, "node_rank": 0},
     "not numbered node by node"),
    ({"stage": 3, "quantize_grads": "int8"}, {"world_size": 6, "local_world_size": 4, "rank": 5, "node_rank": 1},
     "6 ranks are not whole nodes of 4"),
    ({"replicate_size": "nodes"}, {"world_size": 4}, "or set replicate_size to the number of nodes"),
    ({"replicate_size": "nodes"}, {"world_size": 6, "local_world_size": 4, "rank": 5, "node_rank": 1},
     "replicate_size='nodes': 6 ranks are not whole nodes of 4"),
    ({"replicate_size": 3}, {"world_size": 4}, "replicate_size=3 does not divide the 4 data-parallel ranks"),
    ({"replicate_size": 2}, {}, "replicate_size=2 needs that many ranks at least"),
]


@pytest.mark.parametrize("values,facts,message", WORLD_REFUSED, ids=[m[:40] for *_, m in WORLD_REFUSED])
def test_what_the_world_cannot_run_is_refused(values, facts, message):
    from zerodp.config_world import WorldFacts, check_world

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
        check_world(Config(**values), WorldFacts(**facts))
    assert str(e.value).startswith("Config."), str(e.value)


# (Config values, WorldFacts values, the replicate_size it runs with).
WORLD_ACCEPTED = [
    ({}, {}, 1),
    ({"replicate_size": "nodes"}, {}, 1),  # one process is one node, torchrun or not
    ({"replicate_size": "nodes"}, {"world_size": 4, **TORCHRUN_2x2}, 2),
    ({"replicate_size": 2}, {"world_size": 4, "default_group": False}, 2),
    ({"stage": 3, "hpz": True, "quantize_grads": "int4"}, {"world_size": 4, **TORCHRUN_2x2}, 1),
    ({"stage": 3, "hpz": True}, {"world_size": 1, "default_group": False}, 1),
    ({"tensor_parallel_size": 2, "stage": 3}, {"world_size": 4, "device_type": "cuda"}, 1),
    ({"tensor_parallel_size": 4}, {"world_size": 4}, 1),
    ({"stage": 3}, {"world_size": 4, "model_on_meta": True, "default_group": False}, 1),
    ({"stage": 2, "offload_optimizer": "host"}, {"device_type": "cuda"}, 1),
]


@pytest.mark.parametrize("values,facts,rows", WORLD_ACCEPTED)
def test_what_the_world_can_run_is_accepted(values, facts, rows):
    from zerodp.config_world import WorldFacts, check_world

    config = check_world(Config(**values), WorldFacts(**facts))
    assert config.replicate_size == rows
    assert config == Config(**{**values, "replicate_size": rows})


def test_world_facts_read_torchrun():
    from zerodp.config_world import WorldFacts

    facts = WorldFacts.from_environ({"LOCAL_WORLD_SIZE": "2", "RANK": "3", "GROUP_RANK": "1"}, world_size=4)
    assert facts == WorldFacts(world_size=4, **TORCHRUN_2x2)
    assert WorldFacts.from_environ({}) == WorldFacts()
