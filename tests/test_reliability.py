"""No silent hang, no silent divergence (cases: reliability_cases.py), in one world of 2."""
import pytest

from harness import run_world
from reliability_cases import TIMEOUT_S, reliability_world

# A failing rank waits for the others' reports for up to 5 s after its own timeout.
BOUND_S = TIMEOUT_S + 5 + 3


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(2, reliability_world, str(tmp_path_factory.mktemp("rel")), timeout_s=300)


@pytest.mark.parametrize("stage", [2, 3])
def test_an_error_on_one_rank_fails_the_other_promptly_naming_it(results, stage):
    own, other = results[1][("raises", stage)], results[0][("raises", stage)]
    assert own["type"] == "ValueError"
    assert other["type"] == "CollectiveError", other
    assert other["seconds"] < BOUND_S, other
    msg = other["message"]
    assert f"within {TIMEOUT_S:g} s (Config.collective_timeout_s)" in msg, msg
    assert "ranks [1] did not arrive" in msg and "rank 1 reported nothing" in msg, msg
    assert ("unit blocks.0" if stage == 3 else "reduce_scatter/backward (bucket") in msg, msg


def test_save_on_one_rank_raises_on_both_saying_every_rank_must_call_it(results):
    for rank, r in enumerate(results):
        e = r["save_one_rank"]
        assert e["type"] == "CollectiveError" and e["seconds"] < BOUND_S, (rank, e)
        assert "must be called on every rank" in e["message"], (rank, e["message"])
        assert f"rank {1 - rank} was in" in e["message"], (rank, e["message"])
        assert r["save_one_rank_latest"] is None  # nothing trusted was left behind


def test_collectives_that_pair_up_but_differ_are_caught_at_the_step(results):
    for r in results:
        e = r["fingerprint"]
        assert e["type"] == "CollectiveError", e
        assert "ran different collectives in step 0" in e["message"], e["message"]
        assert "rank 0: all_reduce/forward (user's own) of 4 elements" in e["message"], e["message"]
        assert "rank 1: all_reduce/backward (user's own)" in e["message"], e["message"]
        assert r["fingerprint_untouched"]  # raised before the master weights changed


def test_a_gather_on_one_rank_at_stage_3_fails_both_instead_of_training_wrong(results):
    for rank, r in enumerate(results):
        e = r["gather_one_rank"]
        assert e["type"] == "CollectiveError" and e["seconds"] < BOUND_S, (rank, e)


def test_ranks_loading_different_checkpoints_are_refused_before_anything_changes(results):
    for r in results:
        e = r["load_differs"]
        assert e["type"] == "CheckpointError", e
        assert "ranks disagree on the checkpoint (sha256 of its metadata)" in e["message"], e["message"]
        assert r["load_differs_untouched"]


def test_an_extra_micro_batch_on_one_rank_fails_both(results):
    own, other = results[1]["extra_micro_batch"], results[0]["extra_micro_batch"]
    assert "backward ran again after the accumulation boundary" in own["message"], own
    assert other["type"] == "CollectiveError" and other["seconds"] < BOUND_S, other
    assert "rank 1 reported nothing" in other["message"], other["message"]


def test_healthy_steps_pay_one_agreement(results):
    assert all(r["agreements_per_step"] == 1 for r in results)
