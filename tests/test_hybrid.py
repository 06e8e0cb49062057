"""Hybrid sharding: shard within a row of the mesh, replicate across rows (world size 4 as 2 x 2)."""
import pytest

from harness import run_world
from hybrid_cases import hybrid_world
from test_core import FP32_TOL


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(4, hybrid_world, str(tmp_path_factory.mktemp("hybrid")), timeout_s=300)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_hybrid_sharding_equals_ddp_and_holds_the_stage_formula_over_a_row(results, stage, opt):
    for r in results:
        case = r[(stage, opt)]
        assert case["topology"] == (2, 2)
        # fp32: the row's reduce-scatter then the rows' all-reduce sum in another order than
        # DDP's all-reduce; the same tolerance as every fp32 parity test.
        assert case["diff"] <= FP32_TOL and case["loss_diff"] <= FP32_TOL, case
        memory, formula = dict(case["memory"]), dict(case["formula"])
        if stage == 3:  # a unit's optimizer states cover its owned elements, not its padding
            assert 0 <= formula.pop("optimizer_states") - memory.pop("optimizer_states") <= case["padding_state_nbytes"]
        assert memory == formula, case  # N = 2: the shard axis, not the 4 ranks
        assert case["by_axis"].get("replicate", 0) > 0 and case["by_axis"].get("shard", 0) > 0, case


def test_hybrid_accumulation_and_checkpoint(results):
    for r in results:
        assert r["accumulation"] <= FP32_TOL
        assert r["writers"] == [0, 1]  # the first row writes; the second holds the same shards
        assert r["loaded"] == 0.0  # loads bitwise into a model sharded over all 4 ranks
