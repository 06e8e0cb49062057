"""ZeRO with tensor parallelism at world size 4 (DP x TP = 2 x 2 and 1 x 4), stages 0-3, fp32,
for the bundled GPT and a Hugging Face Llama built from a config: parity with one process on
the same global batch after every step; Pa and Pa+cpu bitwise the run without; the activation
ledger against the estimator; the tp axis's collectives counted exactly. A case per test in the
session's world of 4 (cases: tp_cases.py); the one-process references are computed once per
world (tp_cases.reference keeps them in rank 0's process)."""
import math

import pytest
import torch

import tp_cases as cases
from tp_cases import BATCH, GPT_CFG, LAYOUTS, OPTIMIZERS, PA, RUNS, SEQ, USER_PATH_LR, VOCAB
from tp_slices import (CHAIN_ROUNDING, adam_ratio, adamw_bound, diffs_to_reference, expected_slice,
                       max_diff_to_reference, sgd_bound)
from zerodp.memory.estimator import checkpoint_bytes_per_rank, pa_allgather_numel

WORLD = 4
# Every bound below is derived in [Note: rounding bounds of the tensor-parallel tests]
# (tests/tp_slices.py) from the reference's own gradients; none is a measurement. Parity is
# checked after every step: the note's bound for a run of k + 1 steps (steps 0..k's gradients
# and largest elements) holds after step k, so a divergence shows at the step where it starts.


def parity(pool, kind: str, dp: int, tp: int, stage: int, opt_name: str) -> list:
    """Every rank's run of one parity cell, rank 0's with the one-process reference ("ref");
    run once per session (the collectives test reads the same run)."""
    return pool.cached(WORLD, cases.parity_case, kind, dp, tp, stage, opt_name)


def at_step(ref: dict, k: int) -> dict:
    """The reference as it was after step k: its parameters then, and the gradients and
    largest elements of steps 0..k."""
    return {**ref, "params": ref["steps"][k], "grads": ref["grads"][:k + 1], "grad_max": ref["grad_max"][:k + 1]}


def sgd_tolerance(ref: dict) -> float:
    lr, momentum = OPTIMIZERS["sgd"][1]["lr"], OPTIMIZERS["sgd"][1]["momentum"]
    return sgd_bound(lr, momentum, ref["grad_max"], clipped_numel=ref["numel"])


def within_adamw_bound(got: dict, ref: dict, tp_rank: int, tp: int, lr: float) -> list:
    """Names of the parameters with an element beyond its AdamW bound (step 6 of the note)."""
    worse = []
    for name, diff in diffs_to_reference(got, ref, tp_rank, tp).items():
        grads = [expected_slice(name, g[name], diff, tp_rank, tp) for g in ref["grads"]]
        bound = adamw_bound(lr, grads, ref["grad_max"], clipped_numel=ref["numel"])
        if (diff > bound).any():
            worse.append((name, float((diff - bound).max())))
    return worse


def loss_tolerance(loss: float) -> float:
    """The first step's loss comes from the same weights: only the forward's sums differ (the
    forward half of the chain of step 2 of the note), against magnitudes of the loss's size."""
    return CHAIN_ROUNDING * (1 + abs(loss))


def check_sgd_every_step(results: list, ref: dict, tp: int) -> None:
    for step in range(len(ref["steps"])):
        want = at_step(ref, step)
        for rank, r in enumerate(results):
            got = {"params": r["steps"][step]}
            diff, bound = max_diff_to_reference(got, want, rank % tp, tp), sgd_tolerance(want)
            assert diff <= bound, (rank, step, diff, bound)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l[0]}x{l[1]}")
@pytest.mark.parametrize("stage,opt_name", RUNS, ids=lambda v: str(v))
def test_parity_with_one_process_on_the_global_batch(pool, kind, layout, stage, opt_name):
    dp, tp = layout
    results = parity(pool, kind, dp, tp, stage, opt_name)
    ref = results[0]["ref"]
    if opt_name == "sgd":
        check_sgd_every_step(results, ref, tp)
    else:
        for step in range(len(ref["steps"])):
            want = at_step(ref, step)
            for rank, r in enumerate(results):
                worse = within_adamw_bound({"params": r["steps"][step]}, want, rank % tp, tp,
                                           OPTIMIZERS["adamw"][1]["lr"])
                assert not worse, (rank, step, worse)
    # The loss of the global batch is the mean of the data-parallel ranks' losses; every
    # tensor-parallel rank of a data-parallel rank computes the same one, bit for bit (the
    # gathered logits are the same tensor on each).
    first = sum(results[d * tp]["losses"][0] for d in range(dp)) / dp
    assert abs(first - ref["losses"][0]) <= loss_tolerance(ref["losses"][0]), (first, ref["losses"][0])
    for step in range(len(ref["losses"])):
        for rank, r in enumerate(results):
            assert r["losses"][step] == results[rank // tp * tp]["losses"][step]


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l[0]}x{l[1]}")
def test_the_bounds_leave_room_for_a_real_error(pool, kind, layout):
    """The bounds can fail: one SGD step on a gradient 1% off moves its largest elements by
    0.01 x lr x max|g|, which the SGD bound stays below; AdamW's bound holds a fifth of the
    elements or more within one step (lr) of the reference's, where 3 steps may move them
    by 3 lr."""
    dp, _ = layout
    lr = OPTIMIZERS["sgd"][1]["lr"]
    ref = pool.run(WORLD, cases.reference_case, kind, "sgd", dp)[0]
    assert sgd_tolerance(ref) < 0.01 * lr * ref["grad_max"][0], kind
    ref = pool.run(WORLD, cases.reference_case, kind, "adamw", dp)[0]
    adam_lr = OPTIMIZERS["adamw"][1]["lr"]
    strict = [adamw_bound(adam_lr, [g[n] for g in ref["grads"]], ref["grad_max"], ref["numel"])
              for n in ref["params"]]
    share = sum(int((b < adam_lr).sum()) for b in strict) / sum(b.numel() for b in strict)
    assert share > 0.2, (kind, share)


def pa_runs(pool, kind: str, reentrant: bool) -> list:
    """Every rank's runs without Pa, with Pa and with Pa+cpu (stage 3, 2 x 2), once per
    session: three tests read the non-reentrant ones."""
    return pool.cached(WORLD, cases.pa_case, kind, reentrant)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_pa_and_pa_cpu_are_bitwise_the_run_without(pool, kind, reentrant):
    for r in pa_runs(pool, kind, reentrant):
        plain = r["none"]
        for name in ("pa", "pa_cpu"):
            got = r[name]
            assert got["losses"] == plain["losses"]
            assert all(torch.equal(got["params"][n], plain["params"][n]) for n in plain["params"]), name


def checkpoint_numel(kind: str) -> int:
    """One layer's checkpoint: its input, (batch, tokens, hidden); Llama sees SEQ + 1 tokens."""
    return BATCH * (SEQ if kind == "gpt" else SEQ + 1) * 32


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_activation_ledger_with_pa_is_without_over_tp(pool, kind):
    layers, tp = 2, 2
    for r in pa_runs(pool, kind, False):
        held = {name: r[name]["ledger"] for name in PA}
        whole = checkpoint_bytes_per_rank(layers, 32, checkpoint_numel(kind) // 32, 1, dtype_bytes=4)
        parted = checkpoint_bytes_per_rank(layers, 32, checkpoint_numel(kind) // 32, 1, dtype_bytes=4, tp_size=tp,
                                           partitioned=True)
        # Measured from the tensors the store holds after forward, against the estimator.
        assert held["none"]["held"] == whole == layers * checkpoint_numel(kind) * 4
        assert held["pa"]["held"] == parted == layers * math.ceil(checkpoint_numel(kind) / tp) * 4
        assert held["pa_cpu"]["held"] == held["pa_cpu"]["on_host"] == parted
        assert held["none"]["on_host"] == held["pa"]["on_host"] == 0
    if kind == "gpt":
        # 1 x 4 (the GPT, stage 2): a quarter, exactly (the checkpoint's 1,024 elements split evenly).
        for r in pool.run(WORLD, cases.pa_1x4_case):
            assert r["pa_1x4"]["ledger"]["held"] * 4 == r["none_1x4"]["ledger"]["held"]


def tp_records(r, label):
    return [rec for rec in r["ledger"]["records"] if rec[4] == "tp" and rec[5] == label]


def test_pa_gathers_each_checkpoint_once_on_the_tp_axis(pool):
    layers, tp, numel = 2, 2, checkpoint_numel("gpt")
    for r in pa_runs(pool, "gpt", False):
        gathers = tp_records(r["pa"], "activation checkpoint")
        assert [g[0] for g in gathers] == ["all_gather"] * layers
        assert sum(g[1] for g in gathers) == pa_allgather_numel(layers, 32, SEQ, BATCH, tp)
        # The extra volume is the checkpoints' bytes per step (each gathered whole once).
        assert sum(g[2] for g in gathers) == layers * numel * 4
        assert not tp_records(r["none"], "activation checkpoint")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l[0]}x{l[1]}")
def test_tensor_parallel_collectives_counted_on_the_tp_axis(pool, layout):
    """Megatron's count for the checkpointed GPT: forward, the embedding's all-reduce and one
    per attention and MLP sub-block, and the attention's again in each block's recomputation
    (non-reentrant checkpointing stops recomputing once the last tensor backward needs is
    rebuilt, which comes before the MLP's output all-reduce); backward, one per sub-block's
    input and the LM head's; the logits gathered once. Read from the stage-0 SGD parity run."""
    layers, hidden = GPT_CFG.n_layer, GPT_CFG.n_embd
    for r in parity(pool, "gpt", *layout, 0, "sgd"):
        rec = tp_records(r, "tensor parallel")
        forward = [x for x in rec if x[3] == "forward"]
        backward = [x for x in rec if x[3] == "backward"]
        assert len(forward) == 1 + 2 * layers + layers and len(backward) == 2 * layers + 1
        assert {(x[0], x[1]) for x in rec} == {("all_reduce", BATCH * SEQ * hidden)}
        logits = tp_records(r, "tensor parallel logits")
        assert [(x[0], x[1]) for x in logits] == [("all_gather", BATCH * SEQ * VOCAB)]


BAD_INPUT = {
    "tp_3_of_4": lambda e: "tensor_parallel_size=3 does not divide the world size 4" in e,
    "no_plan": lambda e: "has no tensor-parallel plan" in e,
    "meta": lambda e: "meta device" in e,
    "heads_3_over_2": lambda e: "n_head=3 does not split into 2" in e,
    "gqa_kv_2_over_4": lambda e: "num_key_value_heads=2 does not split into 4" in e,
    "gemma_scaled_embedding": lambda e: "not a plain nn.Embedding" in e,
    "pa_without_checkpointing": lambda e: "no layer of the model is checkpointed" in e,
    # Config.debug: the GPT's unsplit parameters agree across tensor-parallel ranks; the
    # gate on split activations does not, and is named.
    "debug_gpt": lambda e: e == "no error",
    "debug_gate": lambda e: "the gradients of gate differ across the tensor-parallel ranks" in e,
}


@pytest.mark.parametrize("name", sorted(BAD_INPUT))
def test_bad_input_fails_on_every_rank(pool, name):
    assert sorted(BAD_INPUT) == sorted(cases.BAD_INPUTS)
    for rank, e in enumerate(pool.run(WORLD, cases.bad_input_case, name)):
        assert BAD_INPUT[name](e), (rank, e)


def test_grouped_query_attention_keeps_each_rank_s_heads_with_their_key_value_heads(pool):
    """Llama with 4 query heads sharing 2 key/value heads at 2 x 2: each rank's 2 query heads
    go with its 1 key/value head, as in the whole model (after every step)."""
    results = pool.run(WORLD, cases.parity_case, "llama_gqa", 2, 2, 3, "sgd")
    check_sgd_every_step(results, results[0]["ref"], 2)


def test_the_user_path_hf_checkpointing_bf16_accumulation(pool):
    """HF Llama with its default gradient checkpointing, bf16, 2 micro-batches, clipping,
    stage 3 at 2 x 2: Pa+cpu bit for bit without it, and the fp32 single-process run on the
    same global batch within bf16's rounding, after every step."""
    results = pool.run(WORLD, cases.user_path_case)
    ref = results[0]["ref"]
    steps = len(ref["losses"])

    def params_tol(steps):
        # bf16 keeps 8 significant bits: a stored weight is within 2^-9 |w| of its fp32 master;
        # and AdamW steps an element at most 2 r lr apart per step from the fp32 run's, whatever
        # the two runs' gradients (step 6 of the note), all the more for bf16's rounding.
        return 2 ** -9 + steps * 2 * adam_ratio(steps) * USER_PATH_LR

    # The first loss comes from the same weights through bf16's roundings: about 40 along the
    # forward of this 2-layer Llama (each matmul's weight and output, the norms, rotary,
    # softmax, the residual adds), 2^-9 each, relative to the magnitudes: the logits', below
    # 1 for this fresh model; the cross-entropy moves by at most twice its logits' largest
    # change.
    loss_tol = 2 * 40 * 2 ** -9
    for rank, r in enumerate(results):
        plain, pa = r["plain"], r["pa_cpu"]
        assert pa["losses"] == plain["losses"]
        assert all(torch.equal(pa["params"][n], plain["params"][n]) for n in plain["params"])
        for step in range(steps):
            diff = max_diff_to_reference({"params": plain["steps"][step]}, at_step(ref, step), rank % 2, 2)
            assert diff <= params_tol(step + 1), (rank, step, diff)
    first = sum(results[d * 2]["plain"]["losses"][0] for d in range(2)) / 2
    assert abs(first - ref["losses"][0]) <= loss_tol, (first, ref["losses"][0])
