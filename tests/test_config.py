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
          "activations_on_host"}


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
    ({"replicate_size": 2, "tensor_parallel_size": 2}, "replicate_size", "tensor_parallel_size=1"),
    ({"offload_optimizer": "host", "stage": 2, "tensor_parallel_size": 2}, "offload_optimizer",
     "tensor_parallel_size=1"),
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
               initial_loss_scale=1e-3, prefetch_units=0, delayed_update_after=0, offload_optimizer="host")
    assert c.collective_timeout_s == 31_536_000 and c.loss_scale == 2.0**24


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
