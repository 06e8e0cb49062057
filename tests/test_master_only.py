"""Master-only work from DDP scripts (cases: master_only_cases.py), in a world of 2: a call
that is collective at its stage, made on rank 0 alone, fails on both ranks within seconds,
naming the call, what the other rank did instead and the fix; local calls stay local."""
import pickle

import pytest
import torch

from zerodp.distributed.sync_points import story

from harness import run_world
from master_only_cases import (called_late, called_too_late, every_rank, inside_gathered_parameters,
                               leaves_while_other_waits, load_on_rank0_only, local_on_rank0, rank0_only, single_process)
from parity import max_rel_diff_of

FAST_S = 5.0  # far below TIMEOUT_S: found at the sync point, not by a collective's timeout
GET_STATE_DICT = "get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))"


def both_refused(results: list, head: str) -> tuple[str, str]:
    for rank, r in enumerate(results):
        assert r["type"] == "UnmatchedCallError", (rank, r)
        assert r["seconds"] < FAST_S, (rank, r)
        assert f"rank {rank}: {head}" in r["message"], (rank, r["message"])
    return results[0]["message"], results[1]["message"]


@pytest.mark.parametrize("stage", [1, 3])
def test_optimizer_state_dict_on_rank0_only_fails_both_naming_it(pool, stage):
    """nanoGPT's `if master_process: checkpoint = {'optimizer': optimizer.state_dict(), ...}`."""
    own, other = both_refused(pool.run(2, rank0_only, stage, "optimizer.state_dict"),
                              f"optimizer.state_dict() is collective at stage {stage}")
    went = "the backward of step 1" if stage == 1 else "the forward of step 1"
    assert f"rank 1 did not call it (it went on to {went})" in own, own
    assert f"rank 0 called it and waited for every rank, but this rank did not (it went on to {went})" in other, other
    for msg in (own, other):
        assert GET_STATE_DICT in msg and "on every rank" in msg and "zerodp.save" in msg, msg


def test_model_state_dict_on_rank0_only_at_stage3_fails_both_naming_it(pool):
    own, other = both_refused(pool.run(2, rank0_only, 3, "model.state_dict"), "model.state_dict() is collective at stage 3")
    assert "rank 1 did not call it (it went on to the forward of step 1)" in own, own
    assert "zerodp.full_state_dict(model, optimizer, rank0_only=True)" in other, other


def test_eval_forward_on_rank0_only_at_stage3_fails_both_naming_it(pool):
    """nanoGPT's `if iter_num % eval_interval == 0 and master_process: losses = estimate_loss()`."""
    own, other = both_refused(pool.run(2, rank0_only, 3, "eval"),
                              "a forward under torch.no_grad() (evaluation) is collective at stage 3")
    assert "rank 1 did not run it (it went on to the forward of step 1)" in own, own
    assert "rank 0 ran it and waited for every rank, but this rank did not (it went on to the forward of step 1)" \
        in other, other
    assert "Run the evaluation on every rank" in own and "gathered_parameters" in own, own


def test_optimizer_load_state_dict_on_rank0_only_fails_both_naming_it(pool):
    own, other = both_refused(pool.run(2, load_on_rank0_only), "optimizer.load_state_dict() is collective at stage 1")
    assert "rank 1 did not call it (it went on to the backward of step 1)" in own, own


def test_gathered_parameters_around_a_master_only_eval_is_no_fix(pool):
    """Its first forward runs (the units are gathered), the second must gather on rank 0
    alone: refused like any master-only evaluation, as the advice says."""
    results = pool.run(2, inside_gathered_parameters)
    assert results[0]["first_forward_ran"]
    both_refused(results, "a forward under torch.no_grad() (evaluation) is collective at stage 3")


@pytest.mark.parametrize("stage,points", [(1, 8), (3, 13)])
def test_the_same_calls_on_every_rank_work(pool, stage, points):
    """Two sync points a step (its first collective, the step agreement) and one a call: at
    stage 1 three steps, state_dict and load_state_dict (its evaluations are local); at stage
    3 also model.state_dict() and four evaluation forwards."""
    results = pool.run(2, every_rank, stage)
    for r in results:
        assert r["points_on"] and r["points"] == points, r
        assert r["state_keys"] == [0, 1, 2, 3, 4, 5], r
        assert r["model_keys"] == [f"blocks.{i}.{k}" for i in range(3) for k in ("bias", "weight")], r
        assert all(torch.isfinite(torch.tensor(loss)) for loss in r["losses"]), r


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_local_state_dicts_on_rank0_only_work_and_equal_ddps(pool, stage):
    """model.state_dict() at stages 0-2 and optimizer.state_dict() at stage 0 need no
    collective, as under DDP: rank 0 takes them alone and both ranks train on."""
    results = pool.run(2, local_on_rank0, stage)
    assert [r["type"] for r in results] == [None, None], results
    r = results[0]
    assert max_rel_diff_of(r["model"], r["ddp_model"]) < 1e-5
    if stage == 0:
        assert max_rel_diff_of(r["optimizer"], r["ddp_optimizer"]) < 1e-5


def test_a_call_made_after_the_other_rank_went_on_names_it_on_both(pool):
    """Rank 1 waited at its reduction's sync point for less than rank 0's local evaluation
    took, and went on into the reduction: rank 0 raises at once, naming where rank 1 went;
    rank 1 stays in its reduction until the timeout, and its failure report names the call."""
    own, other = pool.run(2, called_late)
    assert own["type"] == "UnmatchedCallError" and own["seconds"] < 2.0 + FAST_S, own
    assert "rank 1 did not call it (it went on to the backward of step 1 after waiting for the others there, and " \
           "waits in that collective" in own["message"], own["message"]
    assert other["type"] == "CollectiveError", other
    assert "rank 0 was in optimizer.state_dict()/call (collective at stage 1" in other["message"], other["message"]


def test_a_call_made_too_late_fails_both(pool):
    """Rank 1 makes the call after rank 0 gave up waiting (the collective timeout, 2 s here):
    rank 1 does not go on into a collective that nobody joins."""
    own, other = pool.run(2, called_too_late)
    assert own["type"] == other["type"] == "UnmatchedCallError", (own, other)
    assert "not every rank called it within 2 s (Config.collective_timeout_s)" in own["message"], own
    assert other["seconds"] < FAST_S, other
    assert "rank 0 gave up waiting for rank 1 after Config.collective_timeout_s" in other["message"], other


def test_a_world_of_one_has_no_sync_points(pool):
    assert pool.run(1, single_process) == [{"points_on": False, "points": 0}]


def test_stories_name_every_rank_and_each_call():
    call = {"kind": "call", "name": "optimizer.state_dict()", "why": "at stage 2 (rows)", "fix": "FIX.",
            "verb": ["call", "called"]}
    other = {**call, "name": "model.state_dict()", "fix": "OTHER FIX."}
    trains = {"kind": "training", "doing": "the backward of step 7", "blocked": True}
    three = {0: call, 1: trains}
    assert story(0, three, 3) == (
        "rank 0: optimizer.state_dict() is collective at stage 2 (rows): ranks [1, 2] did not call it (rank 1: it went "
        "on to the backward of step 7 after waiting for the others there, and waits in that collective until this "
        "process ends or Config.collective_timeout_s passes; rank 2: it said nothing: it is elsewhere (computing, or "
        "in a collective of its own)). FIX.")
    assert story(1, {0: call, 1: {**trains, "blocked": False}, 2: call}, 3) == (
        "rank 1: optimizer.state_dict() is collective at stage 2 (rows): ranks [0, 2] called it and waited for every "
        "rank, but this rank did not (it went on to the backward of step 7). FIX.")
    assert story(1, {0: call, 1: other}, 2) == (
        "rank 1: the ranks made different collective calls at the same point (rank 0: optimizer.state_dict() "
        "(collective at stage 2 (rows)); rank 1: model.state_dict() (collective at stage 2 (rows))). Every rank must "
        "make the same collective calls in the same order. FIX. OTHER FIX.")


def test_a_rank_that_leaves_while_the_other_waits_in_a_call_fails_both(tmp_path):
    run_world(2, leaves_while_other_waits, str(tmp_path), timeout_s=120)
    own, other = (pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1))
    for rank, r in enumerate((own, other)):
        assert r["type"] == "UnmatchedCallError" and r["seconds"] < FAST_S, (rank, r)
    assert "rank 1 did not call it (it went on to shutdown_distributed())" in own["message"], own
    assert "this rank did not (it went on to shutdown_distributed())" in other["message"], other
