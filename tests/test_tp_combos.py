"""Tensor parallelism with offload and hybrid sharding (docs/tensor_parallel.md, "Combinations"): DP x TP = 2 x 2
against one process on the same global batch, with SGD's bound of [Note: rounding bounds of
the tensor-parallel tests] (tests/tp_slices.py): offload moves where the step runs, and
hybrid sharding which ranks hold a shard, not the arithmetic. ZeRO++ is refused, with the reason. Cases: tp_combos_cases.py."""
import pytest

import zerodp
from tp_cases import OPTIMIZERS
from tp_combos_cases import COMBOS, combo_case, meta_case
from tp_slices import error_of, max_diff_to_reference, sgd_bound


@pytest.mark.parametrize("name", list(COMBOS))
def test_tensor_parallel_with_offload_or_hybrid_sharding_matches_one_process(pool, tmp_path, name):
    results = pool.run(4, combo_case, name, str(tmp_path), timeout_s=300)
    ref = results[0]["ref"]
    lr, momentum = OPTIMIZERS["sgd"][1]["lr"], OPTIMIZERS["sgd"][1]["momentum"]
    bound = sgd_bound(lr, momentum, ref["grad_max"], clipped_numel=ref["numel"])
    rows = COMBOS[name][1].get("replicate_size", 1)
    for rank, r in enumerate(results):
        assert r["mesh"] == {"tp": 2, "replicate": rows, "shard": 2 // rows}, (rank, r["mesh"])
        diff = max_diff_to_reference(r, ref, rank % 2, 2)
        assert diff <= bound, (name, rank, diff, bound)
        assert r["losses"] == results[rank - rank % 2]["losses"], rank  # the same on both tensor-parallel ranks


@pytest.mark.parametrize("stage", [1, 2])
def test_a_model_built_under_zerodp_init_is_split_at_stages_below_3(pool, stage):
    results = pool.run(4, meta_case, stage, timeout_s=300)
    ref = results[0]["ref"]
    lr, momentum = OPTIMIZERS["sgd"][1]["lr"], OPTIMIZERS["sgd"][1]["momentum"]
    bound = sgd_bound(lr, momentum, ref["grad_max"], clipped_numel=ref["numel"])
    for rank, r in enumerate(results):
        assert max_diff_to_reference(r, ref, rank % 2, 2) <= bound, rank


@pytest.mark.parametrize("field,value,reason", [("hpz", True, "node axes"), ("quantize_grads", "int8", "node axes"),
                                                ("quantize_weights", True, "not built and tested")])
def test_what_tensor_parallelism_cannot_run_beside_is_refused_with_the_reason(field, value, reason):
    err = error_of(lambda: zerodp.Config(stage=3, tensor_parallel_size=2, **{field: value}))
    assert field in err and "tensor_parallel_size=2" in err and reason in err, err
