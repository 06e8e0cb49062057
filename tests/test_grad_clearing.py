"""Gradient clearing: every way a loop clears gradients (or does not) gives DDP's results,
after every step, and DDP's memory at every stage (issue 22). A case per test in the session's
worlds (cases: grad_clearing_cases.py); each DDP reference is computed once per world (kept in
the ranks' processes), and each clearing's run once per session (pool.cached: two tests read it)."""
import pytest

import grad_clearing_cases as cases
from grad_clearing_cases import EPS, SGD, Case


def _case_id(case: Case) -> str:
    window = f"k{case.accumulation}" + ("-each" if case.each else "-once")
    extra = [v for v in (case.opt, case.offload) if v not in ("sgd", "none")]
    return "-".join([f"s{case.stage}", case.precision, case.clearing, window, *extra])


CONTRACT = [(n, case) for n in (2, 4) for case in cases.contract_cases(n)]
CONTRACT_CELLS = pytest.mark.parametrize("n,case", CONTRACT, ids=[f"N{n}-{_case_id(c)}" for n, c in CONTRACT])


def contract(pool, n: int, case: Case) -> list:
    return pool.cached(n, cases.contract_case, case)


@CONTRACT_CELLS
def test_every_clearing_gives_ddps_results(pool, n, case):
    for got in contract(pool, n, case):
        assert "error" not in got, (n, case, got)
        if n == 2:
            # N=2: a sum of two is order-free and the reference adds in the engine's order,
            # so everything else is the same arithmetic: equal bit for bit, at every step.
            assert got["params"] == got["masters"] == [0.0] * len(got["params"]) and got["losses"] == 0.0, \
                (n, case, got)
        else:
            for step, (params, masters) in enumerate(zip(got["params"], got["masters"])):
                bound = rounding_bound(n, got["local_max"][:step + 1], case.accumulation)
                assert params <= bound and masters <= bound, (n, case, step, got, bound)


def rounding_bound(n: int, local_max: list, k: int) -> float:
    """fp32 at N=4: gloo sums the four ranks' gradients in an order that depends on where an
    element lies in a buffer (DDP's 25 MiB buckets, zerodp's 256-byte ones), so a reduced
    element may differ by up to 2(n-1) ulps of the largest summand: |dg_t| <= 2(n-1) eps k G_t,
    G_t the largest local micro-batch gradient of step t (the reference measures it, all
    ranks). SGD's momentum buffer carries each step's error on with weight 0.9^age (weight
    decay 0.1 x lr 0.1 changes it by 1%), and every step moves the parameters by lr times the
    buffer: |dp_T| <= lr sum_t sum_(s<=t) 0.9^(t-s) |dg_s|. A different parameter changes the
    next gradient too; for this model (tanh, |x| ~ 1) lr x curvature < 1, which at most
    doubles the error per step: the factor 2^T. `local_max`: steps 0..T-1's G_t, so after
    step T-1 of a longer run the bound is that of a run of T steps."""
    lr, mu = SGD["lr"], SGD["momentum"]
    dg = [2 * (n - 1) * EPS["fp32"] * k * g for g in local_max]
    moved = sum(lr * sum(mu ** (t - s) * dg[s] for s in range(t + 1)) for t in range(len(dg)))
    return 2 ** len(local_max) * moved


@CONTRACT_CELLS
def test_the_expert_unused_after_step_0_is_left_alone_after_a_clearing(pool, n, case):
    # Within the grid above, the parameters whose semantics differ by clearing: after one that
    # leaves DDP's .grad None the expert is not stepped again (no decay, no momentum); after
    # set_to_none=False it is stepped with zeros; without clearing, with its stale gradient.
    for got in contract(pool, n, case):
        assert "error" not in got, (n, case, got)
        for step, expert in enumerate(got["expert"]):
            bound = 0.0 if n == 2 else rounding_bound(n, got["local_max"][:step + 1], case.accumulation)
            assert expert <= bound, (n, case, step, got["expert"])


# The remaining cases run at N=2.
@pytest.mark.parametrize("stage,clearing", cases.BEFORE_STEP_GRID, ids=[f"s{s}-{c}" for s, c in cases.BEFORE_STEP_GRID])
def test_a_clearing_between_backward_and_step_is_seen(pool, stage, clearing):
    for moved, decay, largest in pool.run(2, cases.before_step_case, stage, clearing):
        if clearing == "opt_zero":
            # Zeros: only the weight decay moves them, by lr*decay*|p|; p - that rounds to
            # fp32 (half an ulp of |p|, eps |p|) and the product itself by a few eps of it.
            assert 0 < moved <= decay * (1 + 4 * EPS["fp32"]) + EPS["fp32"] * largest, (stage, moved, decay)
        else:  # None: nothing is stepped
            assert moved == 0.0, (stage, clearing, moved)


@pytest.mark.parametrize("stage,offload,reduce_dtype", cases.MEMORY_PLACEMENTS,
                         ids=[f"s{s}-{o}-{r or 'bf16'}" for s, o, r in cases.MEMORY_PLACEMENTS])
def test_memory_after_model_zero_grad_is_what_optimizer_zero_grad_leaves(pool, stage, offload, reduce_dtype):
    key = (stage, offload, reduce_dtype)
    for r in pool.run(2, cases.memory_case, stage, offload, reduce_dtype):
        # No fp32 copy of a gradient outlives the step (item 11: +4 psi/N each).
        assert r["master_grads"] == 0, key
        reports = r["reports"]
        # Model state and anything else held, by category. (The pool of communication
        # buffers is left out: how many buckets are in flight at once depends on when
        # gloo completes them.)
        model, cleared, step = (_held(reports[c]) for c in ("model", "opt_none", "step"))
        assert model == cleared, (key, model, cleared)
        # Right after the step, before any clearing: the same but the gradients' handles
        # (stages 2-3: one shared bf16 element, [Note: gradient clearing]).
        assert {**step, "grads": 0} == {**cleared, "grads": 0}, key
        assert 0 <= step["grads"] - cleared["grads"] <= 2, key


def _held(report: dict) -> dict:
    return {k: report[k] for k in ("params", "grads", "master", "optimizer_states", "other", "host_offloaded")}


@pytest.mark.parametrize("stage", [0, 1, 2, 3], ids=lambda s: f"s{s}")
@pytest.mark.parametrize("clearing", ["opt_zero", "model"])
def test_reduce_dtype_fp32_steps_on_the_fp32_sum_at_every_stage(pool, stage, clearing):
    for got in pool.run(2, cases.fp32_reduce_case, stage, clearing):
        assert "error" not in got, (stage, clearing, got)
        assert got["params"] == got["masters"] == [0.0] * len(got["params"]) and got["losses"] == 0.0, \
            (stage, clearing, got)


@pytest.mark.parametrize("stage", [0, 1, 2, 3], ids=lambda s: f"s{s}")
@pytest.mark.parametrize("k,each", [(1, True), (2, False)], ids=["k1", "k2-once"])
def test_a_parameter_with_no_elements_trains(pool, stage, k, each):
    for got in pool.run(2, cases.empty_case, stage, k, each):
        assert "error" not in got, (stage, k, each, got)
        assert got["params"] == got["masters"] == [0.0] * len(got["params"]) and got["losses"] == 0.0, \
            (stage, k, each, got)


@pytest.mark.parametrize("stage,k,via_optimizer", cases.REENTRANT_GRID,
                         ids=[f"s{s}-k{k}-{'opt' if v else 'loss'}" for s, k, v in cases.REENTRANT_GRID])
def test_reentrant_checkpoint_when_the_loop_calls_submodules(pool, stage, k, via_optimizer):
    for got in pool.run(2, cases.reentrant_case, stage, k, via_optimizer):
        assert not isinstance(got, dict), (stage, k, via_optimizer, got)
        assert got == [0.0] * len(got), (stage, k, via_optimizer, got)  # every step
