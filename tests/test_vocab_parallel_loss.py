"""The vocabulary-parallel cross-entropy ([Note: vocabulary-parallel cross-entropy] in
tensor_parallel/loss.py) against torch's cross_entropy, and models trained through their own
loss path with the logits kept split. Cases: vocab_loss_cases.py (a world of 2, 1 x 2).

Bounds, derived (u = 2^-24, fp32): the split loss computes the same expression as torch's
with one reordered sum, s = sum_v exp(z_v - m) added as N_m partial sums; the max is exact.
Reordering a sum of V positive terms moves it by at most 2 γ_V s (Higham, Accuracy and
Stability of Numerical Algorithms, §4.2; γ_V = V u / (1 - V u)), so log s by at most 2 γ_V;
the rest is a handful of elementwise operations (subtract, exp, log, divide), each within u
of its result's magnitude, 8 u in all. A token's loss: within (2 γ_V + 8 u) (1 + |loss|).
The softmax e_v / s carries s's relative error: each gradient element within
(2 γ_V + 8 u) (|p_v| + 1) times the upstream gradient. The mean and the sum add T token
losses in another order: 2 γ_T more of the sum of their magnitudes."""
import math

import pytest
import torch

from tp_slices import CHAIN_ROUNDING, sgd_bound
from vocab_loss_cases import TOKENS, VOCAB, function_case, model_case

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


TOKEN = 2 * gamma(VOCAB) + 8 * U


@pytest.fixture(scope="module")
def function(pool):
    return pool.run(2, function_case, timeout_s=120)


def test_values_and_gradients_equal_torch_cross_entropy(function):
    for rank, r in enumerate(function):
        for reduction in ("mean", "sum", "none"):
            c = r[reduction]
            ref, mine = c["ref"], c["mine"]
            bound = (TOKEN + 2 * gamma(TOKENS)) * (1 + ref.abs()) if reduction != "none" else TOKEN * (1 + ref.abs())
            assert mine.shape == ref.shape
            assert bool(((mine - ref).abs() <= bound).all()), (rank, reduction, float((mine - ref).abs().max()))
            gbound = TOKEN * (c["ref_grad"].abs() + 1)
            assert bool(((c["mine_grad"] - c["ref_grad"]).abs() <= gbound).all()), (rank, reduction)
            # Ignored targets: no loss, no gradient (torch's too).
            if reduction == "none":
                assert bool((mine[::5] == 0).all()) and bool((c["mine_grad"][::5] == 0).all())
            # Three all-reduces of one number per token on the tp axis.
            assert c["records"] == [("all_reduce", TOKENS, "tp", "vocab-parallel loss")] * 3, c["records"]
        ref, mine = r["all_ignored"]
        assert math.isnan(ref.item()) and math.isnan(mine.item())  # torch's mean over no targets


@pytest.fixture(scope="module", params=["gpt", "llama"])
def trained(request, pool):
    return request.param, pool.run(2, model_case, request.param, timeout_s=240)


def test_models_train_through_their_own_loss_path_with_the_logits_split(trained):
    kind, results = trained
    for rank, r in enumerate(results):
        gathered, split = r["gathered"], r["split"]
        # The split run is the gathered one with the loss's sums in another order: the first
        # loss within the forward's rounding, the parameters within SGD's bound of the
        # tensor-parallel tests ([Note: rounding bounds of the tensor-parallel tests]).
        assert abs(split["losses"][0] - gathered["losses"][0]) <= CHAIN_ROUNDING * (1 + abs(gathered["losses"][0]))
        bound = sgd_bound(0.5, 0.9, gathered["grad_max"])
        for name, p in gathered["params"].items():
            diff = float(((split["params"][name] - p).abs() / (1 + p.abs())).max())
            assert diff <= bound, (kind, rank, name, diff, bound)
        # The logits each rank holds: its half of the vocabulary.
        assert r["split_logits_shape"][-1] * 2 == r["gathered_logits_shape"][-1]
        # Kept for backward: the gathered run keeps the whole vocabulary's logits (and its
        # log-softmax); the split run a half-vocabulary softmax.
        assert split["saved_bytes"] < gathered["saved_bytes"], (split["saved_bytes"], gathered["saved_bytes"])
        # The ledger's logits_peak: the LM head's output, fp32, whole vocabulary when gathered
        # and this rank's half when split (the memory the split loss saves).
        for mode in ("gathered", "split"):
            assert r[mode]["logits_peak"] == math.prod(r[f"{mode}_logits_shape"]) * 4, (kind, mode, r[mode])
        assert 2 * split["logits_peak"] == gathered["logits_peak"]
