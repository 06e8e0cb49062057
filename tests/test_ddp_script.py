"""A DDP script switches to zerodp by changing the DDP line (issue: your DDP loop stays as it
is): nanoGPT's train.py loop (ddp_script_cases.py) under DDP and under zerodp at every stage,
per step; its checkpoint resumed and sampled in a plain process; and torch's zero_grad rule
for a parameter no backward reaches."""
import math

import pytest

import ddp_script_cases as cases
from parity import rel_diff as rel
from tolerances import U32

N = 2
STEPS = 6  # the script's max_iters: the whole run, and the resumed one ends there too
SGD_LR, MOMENTUM = 0.05, 0.9

# Why the runs differ at all (N = 2, fp32, SGD): a sum of two is order-free and halving is
# exact, so DDP's and zerodp's reduced gradients differ only where zerodp reduces each
# micro-batch (stages 2-3) and DDP sums the two micro-batches first: (a1+a2)+(b1+b2) against
# (a1+b1)+(a2+b2), <= 3u of the sum of |terms| per element. torch's clip computes each
# parameter's norm in fp32 by a cascade sum (<= (log2 n + 1)u relative, n <= 4096 elements:
# 13u; the square root halves it) and their norm (30 parameters: 6u more); zerodp pools fp64
# sums: the clip coefficients differ by <= 14u, one more for the division. Clipped to norm 1,
# every gradient element is <= 1, so an update differs by <= lr (3u + 15u) = lr 18u, momentum
# carries it on with weight 0.9^age (x 1/(1 - 0.9)), over STEPS steps; a different parameter
# changes the next gradient too, which at most doubles the error per step (lr x curvature < 1
# for this small model at lr 0.05): the factor 2^STEPS.
SGD_TOL = 2**STEPS * STEPS * SGD_LR / (1 - MOMENTUM) * 18 * U32  # 2.1e-4
# The recorded gradient norm before clipping: the same parameter difference, through a
# gradient that moves by at most the curvature (< 1/lr, see above) times it, plus the norm's
# own 20u: relative to 1 + |norm|.
NORM_TOL = SGD_TOL / SGD_LR + 20 * U32
# AdamW divides by sqrt(v): an element whose gradient is near zero may step ~lr either way
# under any rounding difference (tolerances.adamw_tol), lr <= 0.03: this only catches gross
# errors (a missing state, a wrong parameter), the SGD grid is the strict check.
ADAMW_TOL = 2 * 0.03 * STEPS


# SGD (the scale-sensitive check) at every stage; AdamW, nanoGPT's own, where its states are
# sharded differently (stage 1: the flat chunk; stage 3: per unit).
@pytest.mark.parametrize("stage,kind", [(0, "sgd"), (1, "sgd"), (2, "sgd"), (3, "sgd"), (1, "adamw"), (3, "adamw")])
def test_nanogpt_loop_changed_only_at_the_ddp_line(pool, tmp_path, stage, kind):
    tol = SGD_TOL if kind == "sgd" else ADAMW_TOL
    results = pool.run(N, cases.script_case, stage, kind, str(tmp_path), timeout_s=300)
    for rank, r in enumerate(results):
        ddp, zero = r["ddp"], r["zerodp"]
        for run in ("whole", "resumed"):
            d, z = ddp[run], zero[run]
            assert len(d["losses"]) == len(z["losses"]) > 0, (rank, run)
            # Step 0's loss is a forward of the same weights on the same batch: equal exactly.
            if run == "whole":
                assert z["losses"][0] == d["losses"][0], (rank, d["losses"], z["losses"])
            for nd, nz in zip(d["norms"], z["norms"]):
                assert math.isfinite(nz) and abs(nz - nd) / (1 + abs(nd)) <= (NORM_TOL if kind == "sgd" else 1.0), \
                    (rank, run, d["norms"], z["norms"])
            if rank == 0:
                assert d["final"].keys() == z["final"].keys()
                for name in d["final"]:
                    assert rel(z["final"][name], d["final"][name]) <= tol, (run, name, tol)
        if rank == 0:
            # sample.py in a plain process, from the file the script saved at iteration 3.
            # Logits of the same input under weights <= tol apart: 3 layers of <= 32-128-term
            # dot products of O(1) activations (x 10 covers them at these widths).
            assert rel(zero["sample"], ddp["sample"]) <= tol * 10, "sampled logits"


@pytest.mark.parametrize("stage,kind", [(0, "sgd"), (1, "sgd"), (2, "sgd"), (3, "sgd"), (2, "adamw")])
def test_zero_grad_keeps_unreached_parameters_unstepped(pool, stage, kind):
    for r in pool.run(N, cases.unreached_case, stage, kind):
        assert r["ddp"] == {"moved": 0.0, "grad_is_none": True}, r
        assert r["zerodp"] == r["ddp"], r


# The utilities read the same reduced gradients (N = 2: order-free, see SGD_TOL), so the
# only difference is the norm's arithmetic: torch's fp32 cascade sums against zerodp's pooled
# fp64 sums, <= 20u relative (see SGD_TOL); the inf-norm and clamping are exact. Under bf16
# the model computes in bf16 while DDP computes in fp32: the gradients themselves differ by
# bf16's rounding through 2 layers (a few bf16 ulps relative, 2^-8 each): 4 ulps.
# fp16 (11 significant bits) the same with its ulp, 2^-10; the views of the flat gradient
# (stage 0) hold it times the loss scale, which p.grad must not show.
UTIL_TOL = {"fp32": 20 * U32, "bf16": 4 * 2.0**-8, "fp16": 4 * 2.0**-10}


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16"),
                                             (0, "fp16"), (1, "fp16")])
def test_torch_gradient_utilities_read_the_sharded_gradients(pool, stage, precision):
    tol = UTIL_TOL[precision]
    for r in pool.run(N, cases.utilities_case, stage, precision):
        d, z = r["ddp"], r["zerodp"]
        for key in ("total_2", "total_inf", "total_3_foreach", "clip", "after_clip", "after_value_clip_inf"):
            assert abs(z[key] - d[key]) <= tol * (1 + abs(d[key])), (key, d[key], z[key])
        assert max(abs(a - b) / (1 + abs(b)) for a, b in zip(z["per_param"], d["per_param"])) <= tol
        # After both clips (a norm clip, then a value clip at 0.01), SGD at lr 1 moves each
        # parameter by the clipped gradient (<= 0.01): the step used what the utilities changed.
        # `before - after` is measured in fp32 (2u of |p|, |p| <= 5 for these inits: an
        # N(0, 1) embedding of 2048 values passes 5 with probability 6e-4), and under bf16 the
        # parameters are stored in bf16 (one bf16 ulp of |p| <= 5).
        measured = 2 * U32 * 6 if precision == "fp32" else 2.0**-8 * 6 if precision == "bf16" else 2.0**-10 * 6
        for name, moved in d["stepped_by"].items():
            assert float((z["stepped_by"][name] - moved).abs().max()) <= 0.01 * tol + measured, name
        if "read" in z:
            assert "clip_grad_norm_" in z["read"] and "no rank holds it whole" in z["read"], z["read"]
