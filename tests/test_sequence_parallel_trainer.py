"""Sequence parallelism under the Hugging Face Trainer and TRL's SFTTrainer, packed samples, and
stage 2 (cases: sequence_parallel_trainer_cases.py, sequence_parallel_cases.py).

- zerodp's Trainer with sequence_parallel_size=2 at N=2 (stage 2) and N=4 (SP=2 x DP=2, stage 3)
  on padded windows, against the same Trainer without it on 2 ranks (stage 1), all on the same
  global batch: the logged losses and gradient norms per step, and the final weights.
- TRL's SFTTrainer with packing (padding-free rows, position_ids restarting at each sample) at
  N=2 SP=2 against the same without SP: its loss is computed from the fused LM head's per-token
  log-probabilities, which come back whole; the collator pads to a multiple of 2.
- Packed rows at the model (sdpa and eager) and a padded batch at stage 2, N=2 SP=2, against one
  process training the whole model.
"""
import math

import pytest

pytest.importorskip("accelerate")

import sequence_parallel_cases as spc  # noqa: E402
import sequence_parallel_trainer_cases as cases  # noqa: E402
from test_sequence_parallel import SGD_TOL, check  # noqa: E402
from tp_slices import CHAIN_ROUNDING, rounding, sgd_bound  # noqa: E402

TIMEOUT_S = 400


# Bounds: [Note: rounding bounds of the tensor-parallel tests] (tests/tp_slices.py), as
# test_hf_trainer derives them for its Trainer runs, whose model and batch these match (hidden
# 32, MLP 64, 16 tokens, a vocabulary of 256, 2 x 2 sequences x 2 micro-batches a step; heads
# of 8 here, narrower than its 16): the runs differ only in the order of their sums (a slice's
# tokens summed across ranks instead of inside one matmul, the loss as the sum of the slices').
# - step 1's loss comes from the same weights: CHAIN_ROUNDING of the loss's magnitude;
# - SGD without momentum moves the weights apart by at most W_s = sgd_bound(lr, 0, norms) after
#   s steps (the largest gradient element is at most the gradient's norm, which the Trainer
#   logs; clipping's norm sums all P elements but never acts: its threshold is above the norm);
# - a later step's loss moves by at most ||grad||_1 W <= sqrt(P) ||grad||_2 W besides its own
#   forward's rounding;
# - step 1's gradient norm, by rounding(P) of itself;
# - the final weights, by W_STEPS elementwise (relative to 1 + |w|, so absolute is stricter).
# A gradient scaled by 1/k or k (a slice's share not summed over the group, or summed twice)
# moves the first update by lr |g| / 2 ~ 0.1 on the largest elements; a label crossing a
# slice or a sample, or attention that crosses a sample, moves the loss by ~1e-2.
def loss_bound(ref: dict, step: int, numel: int) -> float:
    forward = CHAIN_ROUNDING * (1 + abs(ref["loss"][step]))
    if step == 1:
        return forward
    apart = sgd_bound(cases.LR, 0.0, [ref["grad_norm"][j] for j in range(1, step)], clipped_numel=numel)
    return forward + math.sqrt(numel) * ref["grad_norm"][step] * apart


def compare(got: dict, ref: dict, numel: int) -> list:
    """Every (what, step or name, ours, the reference's, bound) beyond its bound."""
    wrong = []
    assert sorted(got["loss"]) == sorted(ref["loss"]) == list(range(1, cases.STEPS + 1)), (got["loss"], ref["loss"])
    for step, want in ref["loss"].items():
        bound = loss_bound(ref, step, numel)
        if not abs(got["loss"][step] - want) <= bound:
            wrong.append(("loss", step, got["loss"][step], want, bound))
    norm, want = got["grad_norm"][1], ref["grad_norm"][1]
    if not abs(norm - want) <= rounding(numel) * want:
        wrong.append(("grad_norm", 1, norm, want, rounding(numel)))
    apart = sgd_bound(cases.LR, 0.0, list(ref["grad_norm"].values()), clipped_numel=numel)
    assert sorted(got["params"]) == sorted(ref["params"])
    for name, w in ref["params"].items():
        err = float(((got["params"][name] - w).abs() / (1 + w.abs())).max())
        if not err <= apart:
            wrong.append(("weights", name, err, 0.0, apart))
    return wrong


@pytest.fixture(scope="module")
def two_ranks(pool, tmp_path_factory):
    """On 2 ranks: the reference (no SP, stage 1, BATCH a rank) and SP=2 (stage 2, 2 BATCH)."""
    runs = (("plain", 1, 1, cases.BATCH), ("sp", 2, cases.SP, cases.SP * cases.BATCH))
    return pool.run(2, cases.trainer_case, str(tmp_path_factory.mktemp("sp-trainer")), runs, timeout_s=TIMEOUT_S)


def test_the_trainer_at_two_ranks_one_group(two_ranks):
    """N=2, SP=2, stage 2: the group reads the global batch; the Trainer's num_items_in_batch
    is the whole sequences' labelled-token count (the windows are padded unevenly)."""
    numel = cases.numel()
    for r in two_ranks:
        wrong = compare(r["sp"], r["plain"], numel)
        assert not wrong, wrong


def test_the_trainer_at_four_ranks_two_groups(pool, two_ranks, tmp_path):
    """N=4, SP=2 x DP=2, stage 3: each group reads what one rank of the reference reads; the
    gradients are averaged over the two groups."""
    numel = cases.numel()
    ref = two_ranks[0]["plain"]
    runs = (("sp", 3, cases.SP, cases.BATCH),)
    for r in pool.run(4, cases.trainer_case, str(tmp_path), runs, timeout_s=TIMEOUT_S):
        wrong = compare(r["sp"], ref, numel)
        assert not wrong, wrong


def test_trl_sft_trainer_with_packing(pool, tmp_path):
    """TRL's SFTTrainer, packing (bfd: padding-free rows), stage 3, SP=2 against no SP on 2
    ranks: the same losses, gradient norms and weights; a micro-batch holds twice the packed
    samples of one rank's (one row of 64 tokens against 32: the flattened rows), and the collator
    pads to a multiple of 2 under SP (one packed row holds 15 tokens)."""
    numel = cases.numel()
    for r in pool.run(2, cases.sft_case, str(tmp_path), 3, timeout_s=TIMEOUT_S):
        wrong = compare(r[2], r[1], numel)
        assert not wrong, wrong
        plain, split = r[1]["batch"], r[2]["batch"]
        assert plain["rows"] == split["rows"] == 1 and "position_ids" in split["keys"], (plain, split)
        assert (plain["length"], split["length"]) == (2 * cases.SEQ, 4 * cases.SEQ), (plain, split)
        assert split["samples"] == 2 * plain["samples"] > 2, (plain, split)
        assert (r[1]["pad_to_multiple_of"], r[2]["pad_to_multiple_of"]) == (None, 2), r


@pytest.mark.parametrize("stage,attn", [(2, "sdpa"), (3, "eager")])
def test_packed_samples_against_one_process(pool, stage, attn):
    """Packed rows (position_ids restarting inside a row) at N=2 SP=2: attention stays inside
    each sample (the whole sequence's block-diagonal causal mask), each sample keeps its own
    positions, and no label crosses a sample; one process runs transformers' own packed mask."""
    for r in pool.run(2, cases.packed_case, stage, attn, timeout_s=TIMEOUT_S):
        diffs = [abs(a - b) / (1 + abs(b)) for a, b in zip(r["losses"], r["ref_losses"])]
        assert max(diffs) <= SGD_TOL, (r["losses"], r["ref_losses"])
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= SGD_TOL, (worst, r["errors"][worst])


def test_stage_two(pool):
    """Stage 2 (sharded gradients and optimizer states over all N ranks) at N=2 SP=2, Llama with
    grouped-query attention, a padded batch, against one process: test_sequence_parallel's
    checks (losses, parameters, the all-to-alls per step, the shard axis)."""
    results = pool.run(2, spc.parity_case, "llama", 2, "sgd", 2, "sdpa", True, timeout_s=TIMEOUT_S)
    check([{**r, "name": "llama"} for r in results], "sgd", 2, 2)
