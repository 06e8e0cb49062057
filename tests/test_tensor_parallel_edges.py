"""Tensor parallelism's edges at world size 4 (DP x TP = 2 x 2) (tp_edge_cases.py,
tp_region_cases.py): clipping with the 2-, inf- and 1-norm against torch's
clip_grad_norm_ on one process; a nan/inf on one tensor-parallel rank skips the step on every
rank (fp32 with nonfinite_grads="skip", fp16); checkpointed layers with two tensor inputs,
through a model-level `_gradient_checkpointing_func`: parity, Pa and Pa+cpu bitwise, the
activation ledger by hand, dropout in the replicated region; an in-place change to a
checkpointed input; dropout in the split region (a mask per rank, recomputed alike, restored
with the random state); a rank fed another batch than its partner; the demo's job under
tensor parallelism. A case per test in the session's world of 4 (cases: tp_edge_cases.py); the
one-process references are computed once per world (kept in rank 0's process), and runs that
several tests read are run once per session (pool.cached)."""
import math

import pytest
import torch

import tp_edge_cases as cases
from tp_edge_cases import (CLIP_CASES, DP, LR, NONFINITE, PA, TP, TWO_BATCH, TWO_HIDDEN, TWO_LAYERS, TWO_SEQ,
                           max_diff_to_reference, slice_of)
from tp_slices import CHAIN_ROUNDING, rounding, sgd_bound

WORLD = DP * TP
# Tensor parallelism sums in another order than one process: the bounds are derived in [Note:
# rounding bounds of the tensor-parallel tests] (tests/tp_slices.py), from each reference's
# own gradients. A replicated parameter counted twice, or a tensor-parallel slice left out,
# moves the norm by percents, and a wrong clip coefficient moves an element by ~lr x MAX_NORM
# x that error: far beyond them. Parity is checked after every step, against the bound of a
# run of that many steps (the note's sum over steps 0..k).


def norm_rtol(ref: dict) -> float:
    """A norm of the gradient moves with its elements (steps 2-4: relative to the largest) and
    with its own sum over every element (step 3)."""
    return rounding(ref["numel"])


def sgd_tol(ref: dict, clipped: bool = True) -> float:
    return sgd_bound(LR, 0.0, ref["grad_max"], clipped_numel=ref["numel"] if clipped else 0)


def at_step(ref: dict, k: int) -> dict:
    """The reference after step k: its parameters then, and the largest gradient elements of
    steps 0..k."""
    return {**ref, "params": ref["steps"][k], "grad_max": ref["grad_max"][:k + 1]}


def tp_peer(rank: int) -> int:
    """The other rank of `rank`'s tensor-parallel group (ranks 0-1 and 2-3)."""
    return rank ^ 1


def replicated(result: dict, whole: dict) -> list:
    """Names of the parameters tensor parallelism left whole (norms, the gate, biases of
    row-parallel layers); `whole`: the unsplit model's shapes by name."""
    return [n for n, p in result["params"].items() if tuple(p.shape) == tuple(whole[n])]


def shapes(params: dict) -> dict:
    return {n: tuple(p.shape) for n, p in params.items()}


# -- clipping -------------------------------------------------------------------------------
@pytest.mark.parametrize("norm,stage", CLIP_CASES, ids=lambda v: str(v))
def test_clip_grad_norm_is_torch_s_on_the_global_batch(pool, norm, stage):
    """The norm opt.clip_grad_norm_ returns is torch.nn.utils.clip_grad_norm_'s over the whole
    model on the global batch, on every rank and step, and the clipped SGD steps land on the
    reference's weights (each rank on its slice) after every step. The 1-norm fails:
    global_grad_norm sums g.pow(p) without abs (optim/clipping.py), so an odd p sums signed
    values."""
    results = pool.run(WORLD, cases.clip_case, norm, stage)
    ref = results[0]["ref"]
    for rank, got in enumerate(results):
        assert got["dp_rank"] == rank // TP
        for step, want in enumerate(ref["norms"]):
            assert abs(got["norms"][step] - want) <= norm_rtol(ref) * want, (rank, step, got["norms"], ref["norms"])
            then = at_step(ref, step)
            diff = max_diff_to_reference({"params": got["steps"][step]}, then, rank % TP)
            assert diff <= sgd_tol(then), (rank, step, diff, sgd_tol(then))


# -- a nan/inf on one tensor-parallel rank ---------------------------------------------------
def nonfinite(pool, stage, how, clip) -> list:
    """Once per session: the inf-norm test reads the grad_inf runs."""
    return pool.cached(WORLD, cases.nonfinite_case, stage, how, clip)


@pytest.mark.parametrize("stage,how,clip", NONFINITE, ids=lambda v: str(v))
def test_nan_on_one_tensor_parallel_rank_skips_the_step_everywhere(pool, stage, how, clip):
    """fp32, nonfinite_grads="skip": rank 1's loss times nan, or a nan/inf in one element of
    rank 1's slice of a split weight's gradient; with clip_grad_norm_ (2- or inf-norm) first
    or not. Every rank skips (skipped_steps == 1, weights unchanged), none hangs."""
    results = nonfinite(pool, stage, how, clip)
    if stage == 0 and how != "loss":
        # The premise: the poisoned gradient reached rank 1 and its data-parallel peer 3 only,
        # so ranks 0 and 2 learn of it through the step agreement on the tp axis.
        assert [r["local_nonfinite"] for r in results] == [False, True, False, True]
    for rank, got in enumerate(results):
        assert got["skipped_steps"] == 1 and got["was_skipped"] and got["unchanged"], (rank, got)
        if clip is not None and how != "grad_inf":  # grad_inf: test_inf_norm_of_an_inf_gradient_is_inf
            assert math.isnan(got["norm"]), (rank, got["norm"])
        # The next, clean step runs on every rank.
        assert got["later_skipped_steps"] == 1 and not got["later_was_skipped"] and got["later_changed"], rank
    # ... and leaves the ranks in agreement: data-parallel peers hold the same slices, and
    # tensor-parallel peers the same replicated parameters.
    params = [r["params"] for r in results]
    whole = results[0]["whole"]  # the GPT's parameters' shapes, unsplit
    for rank in range(WORLD):
        other = params[(rank + TP) % WORLD]
        assert all(torch.equal(params[rank][n], other[n]) for n in other), rank
        shared = replicated(results[rank], whole)
        assert "transformer.ln_f.weight" in shared, shared
        assert all(torch.equal(params[rank][n], params[tp_peer(rank)][n]) for n in shared), rank


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_overflow_on_one_tensor_parallel_rank_skips_everywhere(pool, stage):
    """A nan in rank 1's slice of a split weight's gradient: the loss scaler's verdict spans
    the tp axis, so every rank skips and halves its scale."""
    results = pool.run(WORLD, cases.nonfinite_case, stage, "grad", None, precision="fp16")
    for rank, got in enumerate(results):
        assert got["was_skipped"] and got["unchanged"], rank
        assert got["scale"] == got["scale_before"] / 2, (rank, got["scale"], got["scale_before"])
        assert not got["later_was_skipped"] and got["later_changed"], rank
    if stage == 0:  # the premise, as in the fp32 cases
        assert [r["local_nonfinite"] for r in results] == [False, True, False, True]


@pytest.mark.parametrize("stage", [0, 3])
def test_inf_norm_of_an_inf_gradient_is_inf(pool, stage):
    """torch.nn.utils.clip_grad_norm_(norm_type=inf) of a gradient holding one inf (and no nan)
    is inf. Fails: global_grad_norm's nan detector sums `local_max * 0.0` over the axes, and
    inf * 0.0 is nan, so every rank reports nan (optim/clipping.py)."""
    for rank, r in enumerate(nonfinite(pool, stage, "grad_inf", float("inf"))):
        assert r["norm"] == float("inf"), rank


# -- layers with two tensor inputs -------------------------------------------------------------
def two_parity(pool, kind: str) -> list:
    """Once per session: the dropout test reads the nested model's losses."""
    return pool.cached(WORLD, cases.two_parity_case, kind)


def two_pa(pool, reentrant: bool) -> list:
    """Once per session: four tests read these runs."""
    return pool.cached(WORLD, cases.two_pa_case, reentrant)


@pytest.mark.parametrize("kind", ["nested", "flat"])
def test_two_input_layers_match_one_process(pool, kind):
    """SGD on the global batch without dropout, every layer checkpointed (non-reentrant),
    compared after every step.
    "nested": the column-parallel fc sits in a sub-module whose input is norm(x) * gate.
    "flat" fails: the layer itself encloses fc, and zerodp enters the tensor-parallel region at
    the enclosing module's first input (plan.py `_enter_region`), so the layer's norm and the
    gate it multiplies by receive this rank's partial gradient only: no error, and the
    replicated norm and gate drift apart on the two tensor-parallel ranks."""
    runs = two_parity(pool, kind)
    ref = runs[0]["ref"]
    for step in range(len(ref["steps"])):
        then = at_step(ref, step)
        for rank, got in enumerate(runs):
            mine = {"params": got["steps"][step]}
            worst = {n: float((p - slice_of(n, then["params"][n], p, rank % TP)).abs().max())
                     for n, p in mine["params"].items()}
            assert max_diff_to_reference(mine, then, rank % TP) <= sgd_tol(then, clipped=False), (rank, step, worst)
            for name in replicated(mine, shapes(ref["params"])):
                assert torch.equal(mine["params"][name], runs[tp_peer(rank)]["steps"][step][name]), (rank, step, name)
    # The first loss comes from the same weights: only the forward's sums differ (half the
    # chain), against magnitudes of the loss's size.
    mean, want = sum(runs[d * TP]["losses"][0] for d in range(DP)) / DP, ref["losses"][0]
    assert abs(mean - want) <= CHAIN_ROUNDING * (1 + abs(want)), (mean, want)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_two_input_pa_and_pa_cpu_are_bitwise_the_run_without(pool, reentrant):
    for r in two_pa(pool, reentrant):
        plain = r["none"]
        for name in ("pa", "pa_cpu"):
            got = r[name]
            assert got["losses"] == plain["losses"], name
            assert all(torch.equal(got["params"][n], plain["params"][n]) for n in plain["params"]), name


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_two_input_activation_ledger_by_hand(pool, reentrant):
    """After forward the store holds each layer's input x (batch x seq x hidden) and the gate
    (seq x hidden), one tensor all layers share, kept once: whole without Pa, ceil(numel / TP)
    per rank with it (the odd sizes pad), all on the host with Pa+cpu; nothing after backward."""
    x, gate = TWO_BATCH * TWO_SEQ * TWO_HIDDEN, TWO_SEQ * TWO_HIDDEN
    whole = (TWO_LAYERS * x + gate) * 4
    parted = (TWO_LAYERS * math.ceil(x / TP) + math.ceil(gate / TP)) * 4
    assert (whole, parted) == (980, 496)
    for r in two_pa(pool, reentrant):
        ledger = {name: r[name]["ledger"] for name in PA}
        assert (ledger["none"]["held"], ledger["none"]["on_host"]) == (whole, 0)
        assert (ledger["pa"]["held"], ledger["pa"]["on_host"]) == (parted, 0)
        assert (ledger["pa_cpu"]["held"], ledger["pa_cpu"]["on_host"]) == (parted, parted)
        assert all(v["after_backward"] == 0 for v in ledger.values())


def test_checkpointing_enabled_after_initialize_is_partitioned(pool):
    """gradient_checkpointing_enable() after initialize: the store wraps the new function at
    the next forward; the results are those of enabling it before."""
    x, gate = TWO_BATCH * TWO_SEQ * TWO_HIDDEN, TWO_SEQ * TWO_HIDDEN
    for late, r in zip(pool.run(WORLD, cases.late_pa_case), two_pa(pool, False)):
        early = r["pa"]
        assert late["ledger"]["held"] == (TWO_LAYERS * math.ceil(x / TP) + math.ceil(gate / TP)) * 4
        assert late["losses"] == early["losses"]
        assert all(torch.equal(late["params"][n], early["params"][n]) for n in early["params"])


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_dropout_in_the_replicated_region_draws_alike_on_tensor_parallel_ranks(pool, reentrant):
    """Every rank seeded differently, dropout 0.2 on the embedding and on each layer's
    row-parallel output: tensor-parallel peers keep the same replicated parameters, since
    initialize shares tensor-parallel rank 0's random state (without it they differ after one
    step: checked by hand with the state's broadcast disabled). The equal losses alone would
    not show it: the LM head's gathered logits are the same on both peers either way. The
    dropout does act: the losses differ from the run without it."""
    without = two_parity(pool, "nested")
    whole = shapes(without[0]["ref"]["params"])
    runs = [r["none"] for r in two_pa(pool, reentrant)]
    for rank, got in enumerate(runs):
        peer = runs[tp_peer(rank)]
        assert got["losses"] == peer["losses"], (reentrant, rank)
        names = replicated(got, whole)
        assert "gate" in names and "layers.0.norm.weight" in names
        assert all(torch.equal(got["params"][n], peer["params"][n]) for n in names), (reentrant, rank)
        assert got["losses"] != without[rank]["losses"]


# -- dropout in the split region ([Note: tensor-parallel random streams]) ----------------------
REGION_MODES = pytest.mark.parametrize("reentrant", [None, False, True], ids=["plain", "non_reentrant", "reentrant"])


def region(pool, reentrant) -> list:
    """Once per session: three tests read each mode's run."""
    return pool.cached(WORLD, cases.region_case, reentrant)


def masks(result: dict, phase: str, region: str) -> dict:
    """(step, dropout name) -> that call's mask; `region`: "split" (the MLP's inner dropout)
    or "replicated" (the embedding's and the layers' output dropouts)."""
    return {(step, name): mask for p, step, name, mask in result["calls"]
            if p == phase and ("mlp.inner" in name) == (region == "split")}


@REGION_MODES
def test_split_region_dropout_draws_its_own_mask_on_each_tensor_parallel_rank(pool, reentrant):
    """Each tensor-parallel rank drops its own positions of its own hidden units, as one
    process draws an independent mask for every unit. Independent masks of p = 0.5 agree on
    each element with probability 1/2: over the 2 steps x 2 layers x 60 elements (3 x 5 x
    4 hidden units per rank) here, 240 elements, an agreement of 3/4 or more lies 7.7
    standard deviations above the mean (probability < 1e-13). One mask drawn on every rank
    alike agrees everywhere (1.0: the failure this test was written against). The replicated
    region's masks are the same on both, element for element."""
    runs = region(pool, reentrant)
    for rank, got in enumerate(runs):
        mine, peer = masks(got, "forward", "split"), masks(runs[tp_peer(rank)], "forward", "split")
        assert len(mine) == 2 * 2 and sum(m.numel() for m in mine.values()) == 240
        agree = sum(int((mine[k] == peer[k]).sum()) for k in mine) / 240
        assert agree <= 0.75, (reentrant, rank, agree)
        same = masks(got, "forward", "replicated")
        assert len(same) == 2 * (1 + 2)
        assert all(torch.equal(m, masks(runs[tp_peer(rank)], "forward", "replicated")[k]) for k, m in same.items())


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_layers_recompute_the_split_region_s_masks(pool, reentrant):
    """Activation checkpointing recomputes each layer in backward: the split region must draw
    the masks of its forward again (else the gradient is another mask's), with either
    use_reentrant mode; and the whole run is bit for bit the one without checkpointing, whose
    masks come from the same seeds. (Non-reentrant recomputation stops once backward has what
    it needs, before a layer's output dropout; the split region's dropout is always redone.)"""
    for plain, got in zip(region(pool, None), region(pool, reentrant)):
        for where in ("split", "replicated"):
            forward, again = masks(got, "forward", where), masks(got, "backward", where)
            assert set(again) <= set(forward), (reentrant, where)
            assert all(torch.equal(m, forward[k]) for k, m in again.items()), (reentrant, where)
            assert all(torch.equal(masks(plain, "forward", where)[k], m) for k, m in forward.items())
        assert sorted(masks(got, "backward", "split")) == sorted(masks(got, "forward", "split"))
        assert got["losses"] == plain["losses"]
        assert all(torch.equal(got["params"][n], p) for n, p in plain["params"].items()), reentrant


@REGION_MODES
def test_restoring_the_random_state_restores_both_streams(pool, reentrant):
    """zerodp.save keeps every rank's random state (checkpoint/rng.py) and zerodp.load puts it
    back: the forward after it draws the same masks in the split region and in the replicated
    one, since the split region's stream is drawn from the replicated one."""
    for got in region(pool, reentrant):
        for where in ("split", "replicated"):
            first, restored = masks(got, "first", where), masks(got, "restored", where)
            assert first and sorted(first) == sorted(restored)
            assert all(torch.equal(restored[k], m) for k, m in first.items()), (reentrant, where)


# -- the input check ([Note: tensor-parallel input fingerprint]) -----------------------------
def input_check(pool) -> list:
    """Once per session: two tests read it."""
    return pool.cached(WORLD, cases.input_check_case)


def test_a_rank_fed_another_batch_than_its_partner_raises_on_every_rank(pool):
    """Rank 1 gives the model data-parallel rank 1's batch while its partner rank 0 has rank
    0's: the collectives would still match and training would go on, silently wrong. Every
    rank raises before the forward, naming the fix; the others name the group at fault."""
    for rank, r in enumerate(input_check(pool)):
        err = r["error"]
        assert err.startswith("ValueError") and "opt.comm.rank, opt.comm.world_size" in err, err
        if rank in (0, 1):
            assert "its tensor-parallel group's ranks were fed different inputs" in err, err
        else:
            assert "tensor-parallel group(s) of data-parallel rank(s) [0]" in err, err


def test_the_input_check_costs_two_small_collectives_per_forward(pool):
    """One all-gather of one int64 per rank over the tp axis, one int64 all-reduced over the
    data axis: 16 + 8 bytes at TP = 2, counted in the ledger."""
    for r in input_check(pool):
        assert r["records"] == [("all_gather", TP, 8 * TP, "forward", "tp"),
                                ("all_reduce", 1, 8, "forward", "data")]


def test_the_demo_job_reads_by_data_parallel_rank_under_tensor_parallelism(pool):
    """`zerodp train --config` with tensor_parallel_size=2 on 4 ranks: the job samples by
    data-parallel rank and size (2 groups), so with twice the per-rank batch its global batch is
    the plain run's (4 ranks); the first step's loss, from the same weights, is then the plain
    run's within the forward's rounding ([Note: rounding bounds of the tensor-parallel tests]),
    and so is the mean it reports (over the data-parallel ranks: a mean over all 4 ranks of
    2 groups' sums would halve it). Before, each rank read its own rows by global rank."""
    for rank, demo in enumerate(pool.run(WORLD, cases.demo_case)):
        plain, split = demo[1], demo[TP]
        assert plain["data"] == (rank, WORLD) and split["data"] == (rank // TP, DP)
        first, want = split["losses"][0], plain["losses"][0]
        assert abs(first - want) <= CHAIN_ROUNDING * (1 + abs(want)), (first, want)


# Last in the module, where the grid ran them: these backward passes stop part-way (on every
# rank alike).
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_in_place_change_of_a_checkpointed_input_raises_on_every_rank(pool, reentrant):
    """torch raises on its own (one process, no hooks); under tensor parallelism zerodp's
    store holds the input and must raise instead, on every rank, none left waiting."""
    for r in pool.run(WORLD, cases.in_place_case, reentrant):
        assert "modified by an inplace operation" in r["torch"]
        got = r["zerodp"]
        assert got.startswith("RuntimeError") and "modified in place" in got, got
