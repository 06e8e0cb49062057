"""memory/placement.py: where long-lived buffers live, single process (no world needed)."""
from __future__ import annotations

import types

import pytest
import torch

import zerodp
from zerodp.config_world import WorldFacts, check_world
from zerodp.memory.placement import open_placement


class _CudaComm:
    """What open_placement reads of a Comm, for one rank whose parameters are on CUDA (no GPU
    needed: a disk placement never touches the device)."""

    rank, world_size = 0, 1
    device = torch.device("cuda", 0)
    topology = types.SimpleNamespace(process_rank=0)  # offload files are named by process rank

    def all_gather_object(self, obj, phase, label=None):
        return [obj]


def test_param_shards_on_disk_open_beside_cuda(tmp_path):
    # Config(stage=3, offload_optimizer="host", offload_params="disk") on CUDA is allowed
    # (docs/offload.md; scripts/gpu_check.py's "params on disk" case): the shards are staged
    # onto the device for each gather. Only the optimizer's disk step is CPU-only, and
    # check_world refuses that one.
    cfg = zerodp.Config(stage=3, unit_modules=("Linear",), offload_optimizer="host", offload_params="disk",
                        offload_dir=str(tmp_path))
    check_world(cfg, WorldFacts(device_type="cuda"))  # the Config itself is fine on CUDA
    placement = open_placement("disk", _CudaComm(), str(tmp_path), reserve=[("params", 4096), ("grads", 4096)],
                               what="placing the parameter shards (Config.offload_params='disk')")
    try:
        assert placement.kind == "disk"
    finally:
        placement.close()




@pytest.mark.parametrize("kind", ["device", "host", "disk"])
def test_buffers_round_trip_through_read_and_write(tmp_path, kind):
    """What a checkpoint reads of a buffer is what it wrote, in every placement; on disk the
    buffers are files in the offload directory (and gone once it is closed)."""
    comm = type("Cpu", (_CudaComm,), {"device": torch.device("cpu")})()
    placement = open_placement("none" if kind == "device" else kind, comm, str(tmp_path),
                               reserve=[("params", 4096)] if kind == "disk" else ())
    try:
        for arena in ((None, "params") if kind == "disk" else (None,)):
            t = placement.zeros(10, torch.float32, torch.device("cpu"), arena=arena)
            assert t.shape == (10,) and not t.any()
            placement.write(t, torch.arange(10, dtype=torch.float32))
            assert torch.equal(placement.read(t).cpu(), torch.arange(10, dtype=torch.float32))
            assert placement.owns(t) == (kind != "disk" or placement.files.owns(t))
        assert placement.offloaded == (kind != "device")
        assert placement.streams == (kind == "disk")
    finally:
        placement.close()
    if kind == "disk":
        assert not (tmp_path / "rank0").exists()  # the files went with the directory's lock


def test_open_placement_names_a_missing_directory_and_the_fix(tmp_path):
    """The rank that failed raises its own error (the others name it and the step, `what`)."""
    cpu = type("Cpu", (_CudaComm,), {"device": torch.device("cpu")})()
    with pytest.raises(FileNotFoundError, match=r"Config.offload_dir=.*missing.* does not exist.*create it"):
        open_placement("disk", cpu, str(tmp_path / "missing"), what="placing the optimizer states")
