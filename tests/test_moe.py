"""Expert parallelism beside ZeRO (cases: moe_cases.py): Hugging Face Mixtral and Qwen3-MoE
trained with expert_parallel_size > 1 at stages 1-3 equal one process training the unsplit
model on the global batch, per step; the ledger counts the all-to-alls."""
import pytest

import moe_cases as cases
from tolerances import U32, adamw_tol

TIMEOUT_S = 240

# Bounds, derived (tolerances.py's method). Errors are |a-b| / (1 + |b|) per element.
#
# SGD (the scale-sensitive check): both runs compute every token's contribution with the same
# ops; what differs is the order of the sums: the N ranks' gradients (and under expert
# parallelism, the k ranks' tokens inside an expert's gradient, summed by one matmul on the
# expert's rank instead of one per rank), the top-k terms of a token (a + b either way for
# top-2) and the batch's rows inside a matmul. Each gradient element moves by at most
# K u sum|terms| with K = N x ROWS x SEQ = 64 terms at N=4 and u = U32; sum|terms| <= GRAD_BOUND
# = 1.0 (the per-element gradient of these tiny models at init is below 0.3: the losses are
# ~log(64) = 4.2 with weights of std 0.02). An update moves by lr times that, momentum by at most
# 1/(1 - 0.9) more, over STEPS = 3 steps: 3 x 0.05 x 10 x 64 x 6e-8 = 5.7e-6; x16 for the
# feedback through later gradients and other CPUs (as tolerances.FP32_TOL): 9.2e-5. A gradient
# scaled wrong (1/k, k x: the expert one reduced over the wrong ranks) moves the first update by
# lr |g| / 2 ~ 1e-3 on the largest elements, 10x above.
GRAD_BOUND, K_TERMS = 1.0, 4 * cases.ROWS * cases.SEQ
SGD_TOL = 16 * cases.STEPS * cases.SGD["lr"] / (1 - cases.SGD["momentum"]) * K_TERMS * U32 * GRAD_BOUND
# AdamW: 2 lr per step (tolerances.adamw_tol): weak by design; SGD is the strict check.
TOL = {"sgd": SGD_TOL, "adamw": adamw_tol(cases.ADAMW["lr"], cases.STEPS)}
LAYERS = 2
# ||zerodp - reference|| / ||reference - initial|| over this rank's banks: rounding moves it by
# about the elementwise error over the update's size (~1e-8 / 1e-3 with SGD); an expert
# gradient scaled by c != 1 moves it by |1 - c| >= 0.5 (the 1/k or k x of a reduction over the
# wrong ranks). AdamW normalises the scale away; SGD is where this is strict.
UPDATE_REL_TOL = 1e-2


def check(results, opt, ep):
    tol = TOL[opt]
    for r in results:
        diffs = [abs(a - b) / (1 + abs(b)) for a, b in zip(r["losses"], r["ref_losses"])]
        assert max(diffs) <= tol, (r["rank"], opt, r["losses"], r["ref_losses"])
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= tol, (r["rank"], opt, worst, r["errors"][worst])
        if opt == "sgd":
            assert r["bank_update_rel"] <= UPDATE_REL_TOL, (r["rank"], r["bank_update_rel"])
        assert len(r["banks"]) == 2 * LAYERS  # gate_up_proj and down_proj of each layer
        assert r["ep_rank"] == r["rank"] % ep
        for step in r["a2a"]:
            # Per MoE layer: forward counts, tokens, outputs; backward their two reverses.
            phases = [(phase, label.rsplit(" ", 1)[1]) for _, phase, axis, label, _ in step]
            assert len(step) == 5 * LAYERS, step
            assert all(axis == "ep" for _, _, axis, _, _ in step)
            assert phases.count(("forward", "counts")) == LAYERS
            assert phases.count(("backward", "tokens")) == phases.count(("backward", "outputs")) == LAYERS


GRID = [(name, stage, opt) for name in cases.MODELS for stage in (1, 2, 3) for opt in ("sgd", "adamw")]


@pytest.mark.parametrize("name,stage,opt", GRID)
def test_two_ranks_two_expert_groups(pool, name, stage, opt):
    check(pool.run(2, cases.parity_case, name, stage, opt, 2, timeout_s=TIMEOUT_S), opt, 2)


def test_checkpoint_across_expert_parallel_layouts(pool, tmp_path):
    """Saved at N=4, EP=2 (stage 3); loaded at N=2, EP=2 (stage 1) and in one process without
    expert parallelism (stage 1), and consolidated there: every layout holds the reference's
    parameters, the banks by their global coordinates, and reaches the saver's next loss (the
    optimizer's momentum restored)."""
    path = str(tmp_path / "ckpt")
    saved = pool.run(4, cases.save_case, "mixtral", 3, 2, path, timeout_s=TIMEOUT_S)
    loads = [(2, pool.run(2, cases.load_case, "mixtral", 1, 2, path, timeout_s=TIMEOUT_S)),
             (1, [cases.load_case(0, 1, "mixtral", 1, 1, path)])]
    for world, results in loads:
        for r in results:
            worst = max(r["errors"], key=r["errors"].get)
            assert r["errors"][worst] <= SGD_TOL, (world, worst, r["errors"][worst])
            assert abs(r["next_loss"] - saved[0]["next_loss"]) / (1 + abs(saved[0]["next_loss"])) <= SGD_TOL, \
                (world, r["next_loss"], saved[0]["next_loss"])
    one = loads[1][1][0]
    assert one["consolidated_shapes"]
    assert max(one["consolidated"].values()) <= SGD_TOL
