"""Tensor parallelism with offload and hybrid sharding (docs/tensor_parallel.md, "Combinations"): DP x TP = 2 x 2
against one process on the same global batch, with SGD's bound of [Note: rounding bounds of
the tensor-parallel tests] (tests/tp_slices.py): offload moves where the step runs, and
hybrid sharding which ranks hold a shard, not the arithmetic; qwZ (ZeRO++'s quantized weight gathers over
the data-parallel ranks) against plain stage 3 at 2 x 2. hpZ and qgZ are refused, with the reason. Cases:
tp_combos_cases.py."""
import pytest

import zerodp
from tp_cases import OPTIMIZERS
from tp_combos_cases import COMBOS, QWZ_BLOCK, combo_case, meta_case, qwz_case
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


@pytest.mark.parametrize("field,value,reason", [("hpz", True, "node axes"), ("quantize_grads", "int8", "node axes")])
def test_what_tensor_parallelism_cannot_run_beside_is_refused_with_the_reason(field, value, reason):
    err = error_of(lambda: zerodp.Config(stage=3, tensor_parallel_size=2, **{field: value}))
    assert field in err and "tensor_parallel_size=2" in err and reason in err, err


def test_quantized_weight_gathers_beside_tensor_parallelism(pool):
    """qwZ at 2 x 2 stage 3: every forward gather of a unit's slice over the data-parallel
    ranks is int8 codes plus a scale per block on the wire (the tensor-parallel collectives
    untouched), and training follows plain stage 3 at 2 x 2."""
    from zerodp.distributed.quantized import payload_nbytes

    for rank, r in enumerate(pool.run(4, qwz_case, timeout_s=300)):
        plain, qwz = r["plain"], r["qwz"]
        gathers = [(rec, q) for rec, q in zip(plain["ledger"]["records"], qwz["ledger"]["records"])
                   if rec[0] == "all_gather" and rec[3] == "forward" and rec[4] == "shard"]
        assert gathers, rank
        for rec, q in gathers:  # (op, numel, nbytes, phase, axis, label): same gather, quantized payload
            assert q[:2] == rec[:2] and q[3:] == rec[3:], (rec, q)
            assert q[2] == 2 * payload_nbytes(rec[1] // 2, 8, QWZ_BLOCK) < rec[2], (rec, q)
        tp = [rec for rec in plain["ledger"]["records"] if rec[4] == "tp"]
        assert tp == [rec for rec in qwz["ledger"]["records"] if rec[4] == "tp"], rank
        # As test_zeropp.py's qwZ check: the losses within 2% of unquantized stage 3's (the weights
        # the forward uses differ by int8 rounding, <= 1/254 of each block's largest), not equal.
        gap = max(abs(a - b) / b for a, b in zip(qwz["losses"], plain["losses"]))
        assert 0 < gap <= 0.02, (rank, gap)
