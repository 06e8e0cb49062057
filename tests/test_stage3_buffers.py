"""Stage 3's pooled gather buffers: a gathered_parameters block gives back what it took
(issue 22, item 10), and a double backward never keeps a view of a pooled buffer (item 12).
A case per test in the session's world of 2 (cases: stage3_buffers_cases.py; the one-process
reference is computed once per world, kept in the ranks' processes)."""
import pytest

import stage3_buffers_cases as cases
from stage3_buffers_cases import DEPTH


def test_gathered_parameters_leaves_the_pool_as_it_found_it(pool):
    for r in pool.run(2, cases.pool_after_gather):
        assert r["shapes"]["0.fc.weight"] == (16, 16)
        # Gathering all DEPTH + 1 units at once takes a buffer each; once the block ends
        # the pool is back to what training needs (a few units, not the model).
        assert r["after"] <= r["before"], r
        assert r["after_step"] <= r["before"], r
        assert r["before"] < DEPTH * r["unit_nbytes"] / 2, r  # so the test can see the difference


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_penalty_then_another_forward_matches_one_process(pool, stage):
    # fp32 SGD, 3 steps, lr 0.05: zerodp sums the ranks' gradients in another order than the
    # single process's one backward over the global batch, so each gradient entry (O(1) here)
    # differs by a few float32 roundings, |g| * 2^-24 each; an update differs by lr times
    # that, ~1e-8, and 3 steps plus the forward's own roundings stay far below 1e-6 for
    # parameters of magnitude <= 1. A lost or doubled penalty term moves them by ~1e-3.
    # A bound on the whole run, so on each of its steps: checked after every step.
    for per_step in pool.run(2, cases.penalty_case, stage):
        assert len(per_step) == cases.STEPS
        for step, diff in enumerate(per_step):
            assert diff <= 1e-6, (stage, step, diff)
