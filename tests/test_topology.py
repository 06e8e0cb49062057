"""The data-parallel mesh (zerodp.Topology) and the collective-strategy seam, at world size 4."""
import pytest
import torch

from topology_cases import topology_world
from zerodp import Topology


@pytest.fixture(scope="module")
def results(pool):
    return pool.run(4, topology_world, timeout_s=240)


def test_the_default_mesh_shards_over_every_rank(results):
    for rank, r in enumerate(results):
        f = r["flat"]
        assert f["names"] == ("shard",) and f["shape"] == (4,)  # a replicate axis of 1 needs no group
        assert f["shard"] == (4, rank) and f["replicate"] == (1, 0) and f["rank"] == rank
        # The shard axis reuses the process group rather than opening a second one, and a
        # mesh is built once per group: initialize may run many times in one process.
        assert f["shard_group_is_world"] and f["cached"]


def test_a_two_by_two_mesh_has_row_and_column_groups(results):
    for rank, r in enumerate(results):
        g = r["grid"]
        assert g["shard"] == (2, rank % 2) and g["replicate"] == (2, rank // 2) and g["rank"] == rank
        row = [float(2 * (rank // 2)), float(2 * (rank // 2) + 1)]
        assert g["row"] == row  # an all-gather along the shard axis sees its row only
        assert g["col_sum"] == float(rank % 2 + rank % 2 + 2)  # ranks c and c+2
        assert g["all_sum"] == 6.0  # the data axis is everyone
        # Bytes by axis: the 2-element fp32 gather on shard, one fp32 scalar on each of the others.
        assert g["by_axis"] == {"shard": 8, "replicate": 4, "data": 4}


def test_a_mesh_shape_that_does_not_fit_is_refused_on_every_rank(results):
    for r in results:
        assert "replicate_size=3 does not divide the 4 data-parallel ranks" in r["not_a_divisor"]
        assert "replicate_size=3 does not divide the 4 data-parallel ranks" in r["hybrid_not_a_divisor"]


def test_a_units_collective_strategy_is_the_one_used_and_counted(results):
    for r in results:
        s = r["strategy"]
        assert s["calls"] == 6  # 2 units x (forward gather, backward gather, reduce-scatter)
        default, half = s["nbytes"]
        assert default > 0 and half * 2 == default
        assert s["same_result"]


def test_a_single_process_has_a_trivial_topology():
    t = Topology.build(None, torch.device("cpu"))
    assert t.mesh is None and t.world_size == 1 and t.rank == 0 and t.group("shard") is None
    with pytest.raises(ValueError, match="replicate_size=2 needs that many ranks"):
        Topology.build(None, torch.device("cpu"), replicate_size=2)
    assert t.size("tp") == 1 and t.group("tp") is None  # no tensor parallelism
    with pytest.raises(ValueError, match="mesh axis 'pipeline' is unknown"):
        t.size("pipeline")


def test_nodes_come_from_torchrun(monkeypatch):
    import zerodp
    from zerodp.distributed.topology import ranks_per_node

    assert zerodp.Config(replicate_size="nodes").replicate_size == "nodes"
    with pytest.raises(zerodp.ConfigError, match="replicate_size"):
        zerodp.Config(replicate_size="racks")
    for k in ("LOCAL_WORLD_SIZE", "RANK", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(zerodp.ConfigError, match="LOCAL_WORLD_SIZE, RANK, GROUP_RANK is not set: launch with torchrun"):
        ranks_per_node()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert ranks_per_node() == 2  # rank 3 is the second of node 1's two
    monkeypatch.setenv("GROUP_RANK", "0")
    with pytest.raises(zerodp.ConfigError, match="not numbered node by node"):
        ranks_per_node()
