"""Hybrid sharding: shard within a row of the mesh, replicate across rows (world size 4 as
2 x 2), a case per test in the session's world of 4 (cases: hybrid_cases.py)."""
import pytest

import hybrid_cases as cases
from tolerances import ADAMW_BF16_TOL, FP32_TOL

WORLD = 4


def _within_at_every_step(per_step: dict, tol: float, key) -> None:
    """Every step's parameters and loss within the run's bound: a bound on the whole run
    bounds each of its steps (parity.py)."""
    for step, (params, loss) in enumerate(zip(per_step["params"], per_step["losses"])):
        assert params <= tol and loss <= tol, (key, step, params, loss)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_hybrid_sharding_equals_ddp_and_holds_the_stage_formula_over_a_row(pool, stage, opt):
    for rank, case in enumerate(pool.run(WORLD, cases.parity_case, stage, opt)):
        assert case["topology"] == (2, 2)
        # fp32: the row's reduce-scatter then the rows' all-reduce sum in another order than
        # DDP's all-reduce; the same tolerance as every fp32 parity test.
        _within_at_every_step(case["per_step"], FP32_TOL, (rank, stage, opt))
        assert case["diff"] <= FP32_TOL and case["loss_diff"] <= FP32_TOL, case
        memory, formula = dict(case["memory"]), dict(case["formula"])
        if stage == 3:  # a unit's optimizer states cover its owned elements, not its padding
            assert 0 <= formula.pop("optimizer_states") - memory.pop("optimizer_states") <= case["padding_state_nbytes"]
        assert memory == formula, case  # N = 2: the shard axis, not the 4 ranks
        # Bytes per step (fp32, P = padded elements of the model, S = 2 ranks per row = per node):
        # across nodes only the rows' all-reduce of each rank's gradient shard, P/S elements;
        # everything else stays inside a node (stage 3: 3P of gathers and reduce-scatters).
        padded, by_axis, by_link = case["padded_numel"], case["by_axis"], case["by_link"]
        assert by_axis["replicate"] == padded // 2 * 4, case
        assert by_link == {"inter_node": by_axis["replicate"], "intra_node": by_axis["shard"]}, case
        if stage == 3:
            assert by_axis["shard"] == 3 * padded * 4, case


def test_stage_3_over_two_nodes_sends_everything_across_them(pool):
    for case in pool.run(WORLD, cases.flat_stage3_case):
        # One axis over all 4 ranks spans both nodes: 3P, all of it counted inter-node.
        assert case["by_link"] == {"inter_node": 3 * case["padded_numel"] * 4, "intra_node": 0}, case


def test_hybrid_accumulation_and_checkpoint(pool, tmp_path):
    for rank, r in enumerate(pool.run(WORLD, cases.accumulation_and_checkpoint_case, str(tmp_path))):
        # fp32 SGD, 2 micro-batches against DDP on the whole batch: FP32_TOL at every step.
        _within_at_every_step(r["per_step"], FP32_TOL, (rank, "accumulation"))
        assert r["diff"] <= FP32_TOL
        assert r["writers"] == [0, 1]  # the first row writes; the second holds the same shards
        assert r["loaded"] == 0.0  # loads bitwise into a model sharded over all 4 ranks


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_sharding_in_16_bit_equals_ddp(pool, precision, stage):
    for rank, case in enumerate(pool.run(WORLD, cases.low_precision_case, precision, stage)):
        # AdamW on core_cases.Net (hybrid_cases): tolerances.ADAMW_BF16_TOL, 2 lr x 5 steps
        # plus one bf16 ulp (fp16's ulp is finer). The strict check is the SGD fp32 cases above.
        _within_at_every_step(case["per_step"], ADAMW_BF16_TOL, (rank, precision, stage))
        assert case["diff"] <= ADAMW_BF16_TOL and case["loss_diff"] <= ADAMW_BF16_TOL and case["skipped"] == 0, case
