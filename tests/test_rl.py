"""Reinforcement-learning loops with zerodp (cases: rl_cases.py): the weight stream against
full_state_dict, one unit of memory at a time; the merged stream of a PEFT model; the stream
under tensor parallelism; the generation context's gathers per generated token; TRL's
GRPOTrainer through with_zerodp against GRPOTrainer under DDP, and its resume."""

import pytest
import torch

import rl_cases as cases
from rl_cases import NEW_TOKENS, STEPS


def test_stream_is_full_state_dict_one_unit_at_a_time(pool):
    results = pool.run(2, cases.stream_case)
    for rank, r in enumerate(results):
        s = r["stream"]
        # Every name of the state dict (tied weights under both), every value bit for bit.
        assert sorted(s["names"]) == r["full_names"] and s["equal"], (rank, s)
        assert r["tied_one_tensor"] and r["params_only"] and r["vllm"], r
        assert r["bf16"]["equal"] and r["stage1"]["equal"], r
        assert sorted(r["stage1"]["names"]) == r["full_names"], r
        # One all-gather per unit part with a name (here: each unit's trainable part).
        assert r["gathers"] == r["units"], r
        # The tensor memory the stream added (measured by a dispatch mode, [Note: added tensor
        # memory]), at its worst: below two units' bytes, as the note's bound (one unit plus its
        # smallest tensor, plus the one the reader still holds) says; nothing left after it.
        # full_state_dict adds the whole model (the measure sees it).
        assert 0 < s["peak"] < 2 * r["unit"], s
        assert s["left"] == 0, s
        assert r["full_peak"] >= r["model"] > 2 * r["unit"], r
        # In bf16 the copies are in bf16, from the fp32 unit: still below two units.
        assert r["bf16"]["peak"] < 2 * r["unit"], r["bf16"]
    assert results[0]["to_rank_1"] == 0 and results[1]["to_rank_1"] == len(results[1]["full_names"]) - 0, results


def test_stream_of_a_peft_model_is_its_merged_base(pool):
    pytest.importorskip("peft")
    for r in pool.run(2, cases.peft_stream_case):
        assert r["names"] == r["want"], r  # the base's names, as merge_and_unload's state dict
        # W + B A scaling from the same fp32 values, computed on gathered views: equal up to
        # the rounding of one rank-4 product and one add (2 u |terms|, terms <= 1 here).
        assert r["worst"] <= 4 * 2.0 ** -24 * 8, r
        assert r["peak"] < 2 * r["unit"], r


def test_stream_under_tensor_and_expert_parallelism_is_the_logical_model(pool):
    for rank, result in enumerate(pool.run(4, cases.parallel_stream_case)):
        for kind, r in result.items():
            assert r["split"] > 0 and r["names"] and r["equal"] and r["as_full_state_dict"], (rank, kind, r)
            # A unit gathers this rank's slices (`unit`); each split tensor is then joined whole
            # (2 x its slice, with one temporary as large): below two of the logical (unsplit)
            # unit's bytes, 2 x `unit`.
            assert r["peak"] < 2 * 2 * r["unit"], (rank, kind, r)


def test_generation_context_gathers_once_per_rollout_not_per_token(pool):
    for r in pool.run(2, cases.generation_case):
        units = r["units"]
        for kind in ("greedy", "sampled"):
            g = r[kind]
            # Bit for bit the stage-0 model's tokens and scores, whichever way the units come.
            assert all(v["same_tokens"] and v["same_scores"] for v in g.values()), (kind, g)
            # Today: every unit once per forward, one forward per new token.
            assert g["today"]["gathers"] == units * NEW_TOKENS, g
            # Kept: every unit once for the whole rollout, all of them on entering the block.
            assert g["kept"]["gathers"] == g["kept"]["on_entry"] == units, g
            assert r[f"{kind}_kept_units"] == units, r
            # A budget of one block's bytes: the root (smaller here) once, on entry; the others
            # per token.
            assert r[f"{kind}_budget_units"] == 1 and g["budget"]["on_entry"] == 1, r
            assert g["budget"]["gathers"] == 1 + (units - 1) * NEW_TOKENS, g
        assert r["all_sharded_after"] and r["sharded_after_refusal"] and r["trains_after"], r
        # Memory: the whole model gathered while the block is open, given back when it closes.
        assert r["kept_nbytes"] == r["model_nbytes"] and r["pool_inside"] >= r["model_nbytes"], r
        assert r["pool_after"] == r["in_use_after"] == 0, r
        # A step between two blocks: the second sees the new weights (nothing kept across).
        assert r["after_step"]["same_as_today"] and r["after_step"]["changed"], r["after_step"]
        assert "forward with gradients inside zerodp.generation_context" in r["training_forward"], r


def test_grpo_through_zerodp_equals_grpo_under_ddp(pool, tmp_path):
    pytest.importorskip("trl")
    r = pool.run(2, cases.grpo_world, str(tmp_path), timeout_s=600)[0]
    steps = list(range(1, STEPS + 1))
    ddp, ddp_peft = r["ddp"]["logs"], r["ddp_peft"]["logs"]
    assert list(ddp) == steps and list(ddp_peft) == steps, r
    # Resumed from checkpoint-2: step 3 is the uninterrupted run's, and so are the weights.
    assert r["resumed"]["logs"][STEPS] == r["z3"]["logs"][STEPS], r["resumed"]
    want, got = r["z3"]["weights"], r["resumed"]["weights"]
    assert all(torch.equal(got[k], want[k]) for k in want), "resumed"
    # N = 2: every reduction sums two terms, which is order-free, and the rollouts draw the
    # same random numbers: the loss, reward and completion length equal DDP's at every step,
    # and the trained weights are DDP's bit for bit. The logged gradient norm is summed in
    # fp32 by torch under DDP, in fp64 over the shards by zerodp: they differ by the fp32
    # sum's rounding, at most PSI u relative (PSI elements; max_grad_norm=10 is above every
    # norm here, so clipping never scales and the weights stay bitwise).
    psi, u = 40_000, 2.0 ** -24
    assert all(ddp[s]["grad_norm"] > 0 for s in steps) and all(ddp_peft[s]["grad_norm"] > 0 for s in steps), r
    for name, reference in (("z1", "ddp"), ("z2", "ddp"), ("z3", "ddp"), ("z3_today", "ddp"), ("z3_peft", "ddp_peft")):
        got_logs, want_logs = r[name]["logs"], r[reference]["logs"]
        for s in steps:
            got, want = dict(got_logs[s]), dict(want_logs[s])
            norms = got.pop("grad_norm"), want.pop("grad_norm")
            assert got == want and abs(norms[0] - norms[1]) <= psi * u * norms[1], (name, s, got_logs, want_logs)
        want, got = r[reference]["weights"], r[name]["weights"]
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name
    # The rollouts ran in the generation context (TRL's backend seam): fewer forward gathers
    # than with it off (ds3_gather_for_generation=False), where each new token gathers all.
    assert r["z3"]["backend"] == "ZeroGenerationBackend", r["z3"]
    assert r["z3"]["forward_gathers"] < r["z3_today"]["forward_gathers"], (r["z3"], r["z3_today"])
