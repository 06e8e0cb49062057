"""Optimizers that step whole parameters (Muon, Adafactor, a user's own) at stages 0-3,
against one process stepping the same torch optimizers on the global batch (cases:
muon_cases.py; design: docs/optimizers.md)."""
import pytest

import muon_cases as cases
from tolerances import BF16_ULP, adamw_tol

# -- Tolerances, derived (muon_cases: STEPS = 4, Muon lr 0.02, AdamW lr 1e-2).
# EXACT (0): fp32 or bf16 at N <= 2, no accumulation or clipping. Each rank computes its
# batch's gradient with the same operations on the same values as the reference's forward
# and backward of that batch; zerodp divides each rank's gradient by N before summing,
# the reference sums then divides: x/2 + y/2 and (x + y)/2 round to the same number (halving
# is exact and a two-term sum has one order), and at N=1 there is no sum. So Newton-Schulz
# (and AdamW) get the same bits on both sides and return the same bits, step after step.
# MUON_TOL otherwise (N=4, micro-batches, clipping): the gradients are summed in another
# order (or the norm computed in another order), so NS's bf16 cast of its input may round an
# element the other way: one bf16 rounding of a differently summed gradient. NS is no
# contraction (its quintic's slope at 0 is a = 3.4445, a^5 = 484 over 5 steps), so the
# first-order bound on the output is vacuous; what bounds it is the output's size: NS
# normalises its input to spectral norm <= 1, and the iterated quintic maps [0, 1] into
# [0, 1.2024] (its maximum on a grid of 10^6 points), so |O_ij| <= ||O||_2 <= 1.21, 1.5 with the
# bf16 matmuls' rounding. Two runs' updates of an element then differ by at most
# 2 * 1.5 * lr * adjust per step, adjust = sqrt(max(1, rows / cols)) <= sqrt(13 / 7) (torch's
# default "original"), over STEPS: 0.33. Weak by design, as adamw_tol is; the exact cases
# above are the strict check (a misplaced or mis-shaped matrix moves an update by ~lr |O_ij|
# ~ 5e-3 per step, caught there). The AdamW part of the recipe has its own bound, and under
# bf16 the compared parameter rounds once more.
SIGMA_MAX = 1.5
MUON_TOL = 2 * SIGMA_MAX * cases.MUON_LR * (13 / 7) ** 0.5 * cases.STEPS
RECIPE_TOL = max(MUON_TOL, adamw_tol(cases.ADAMW_LR, cases.STEPS))
EXACT = 0.0

SIZES = pytest.mark.parametrize("n", [1, 2, 4], ids=lambda n: f"N{n}")
STAGES = pytest.mark.parametrize("stage", [1, 2, 3], ids=lambda s: f"stage{s}")


def _volume_ok(r, stage, n):
    # Stages 1-2: one reduce-scatter and one all-gather of the padded buffer, no other
    # collective (whole matrices reach their owner in the reduce-scatter itself); stage 3:
    # gather for forward, again for backward, reduce-scatter: 3 x padded.
    if stage in (1, 2):
        assert r["by_op"] == {"reduce_scatter/backward": r["padded"], "all_gather/step": r["padded"]}, r
    else:
        assert r["volume"] == 3 * r["padded"], r


@SIZES
@STAGES
def test_recipe_equals_one_process(pool, n, stage):
    tol = EXACT if n <= 2 else RECIPE_TOL
    shapes = set()
    for r in pool.run(n, cases.parity_case, stage, "recipe"):
        assert r["diff"] <= tol, (n, stage, r["diff"])
        _volume_ok(r, stage, n)
        shapes |= set(r["shapes"])
    # Muon was handed each matrix whole, in its shape, on some rank; AdamW 1-D pieces.
    assert {(13, 7), (9, 13)} <= shapes, shapes
    assert all(len(s) == 1 for s in shapes - {(13, 7), (9, 13)}), shapes


@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"N{n}")
def test_muon_alone_stage3_units_per_linear(pool, n):
    # Each Linear its own unit: a unit of one whole matrix next to... nothing else but padding.
    import torch.nn as nn
    tol = EXACT if n <= 2 else MUON_TOL
    for r in pool.run(n, cases.parity_case, 3, "muon", units=(nn.Linear,)):
        assert r["diff"] <= tol, (n, r["diff"])
        assert r["volume"] == 3 * r["padded"], r


@STAGES
def test_bf16(pool, stage):
    for r in pool.run(2, cases.parity_case, stage, "recipe", "bf16"):
        assert r["diff"] <= EXACT + BF16_ULP, (stage, r["diff"])


@pytest.mark.parametrize("stage", [1, 2, 3], ids=lambda s: f"stage{s}")
def test_accumulation_orthogonalizes_once_per_step(pool, stage):
    # Two micro-batches of 4 rows against the reference's same two, summed: Newton-Schulz once
    # on the step's gradient. Orthogonalizing per micro-batch (DeepSpeed #8443) moves every
    # Muon update by O(lr), above RECIPE_TOL's per-step share only over many steps, so the
    # world of one is the strict check: its sums have one order (EXACT).
    for n, tol in ((1, EXACT), (2, RECIPE_TOL)):
        for r in pool.run(n, cases.parity_case, stage, "recipe", micro=2):
            assert r["diff"] <= tol, (n, stage, r["diff"])


def test_clipping(pool):
    for r in pool.run(2, cases.parity_case, 1, "recipe", clip=0.05):
        assert r["diff"] <= RECIPE_TOL, r["diff"]


@pytest.mark.parametrize("stage,offload,params", [(2, "host", None), (2, "disk", None), (3, "disk", "disk")])
def test_offloaded_optimizer(pool, tmp_path, stage, offload, params):
    """The whole matrices' masters and momentum in host memory or in files (and at stage 3
    the parameters' shards too): the same step, exactly."""
    shapes = set()
    for r in pool.run(2, cases.parity_case, stage, "recipe", offload=offload, offload_params=params,
                      offload_dir=str(tmp_path) if "disk" in (offload, params) else None):
        assert r["diff"] <= EXACT, r["diff"]
        shapes |= set(r["shapes"])
    assert {(13, 7), (9, 13)} <= shapes


@pytest.mark.parametrize("n,stage", [(2, 1), (2, 3), (4, 2)], ids=lambda v: str(v))
def test_ledger_padding_and_imbalance_by_hand(pool, n, stage):
    # MatNet: matrices of 91 (13x7), 117 (9x13) and 45 (5x9) elements, 253 in all; one segment
    # (default buckets, one unit). Unaligned, the buffer would pad to 254 (N=2) or 256 (N=4).
    # N=2: chunks of c >= max(ceil(253/2), 117) = 127; largest first into the emptier chunk:
    # 117 -> rank 0, 91 -> rank 1, 45 -> rank 1 (91 < 117) needs 136 > 127, so c grows
    # (127, 128, 130, 132, 134, 136) until it fits: 2 x 136 = 272, 19 of padding, 18 of them
    # for alignment; rank 0 owns 117 elements, rank 1 136.
    # N=4: c >= max(ceil(253/4), 117) = 117: 117, 91, 45 on ranks 0, 1, 2; rank 3 owns none:
    # 4 x 117 = 468, 215 of padding (212 for alignment); imbalance 117 x 4 / 253 = 1.85.
    hand = {2: (272, (117, 136)), 4: (468, (117, 91, 45, 0))}[n]
    for rank, r in enumerate(pool.run(n, cases.ledger_case, stage)):
        assert (r["padded"], r["owned"]) == hand, r
        assert r["numel"] == 253
        assert r["alignment_padding"] == hand[0] - {2: 254, 4: 256}[n]
        assert r["imbalance"] == pytest.approx(max(hand[1]) * n / 253)
        # Traffic is the paper's over the padded buffer: no collective beyond it.
        if stage < 3:
            assert r["by_op"] == {"reduce_scatter/backward": hand[0], "all_gather/step": hand[0]}
        else:
            assert sum(v for k, v in r["by_op"].items()) == 3 * hand[0], r["by_op"]
        # Memory: parameters, gradients as the stage formula over the padded buffer; Muon's one
        # fp32 momentum per owned element, not per element of the padded shard.
        got, formula = r["got"], r["formula"]
        assert got["params"] == formula["params"] and got["grads"] == formula["grads"], (got, formula)
        assert got["optimizer_states"] == 4 * hand[1][rank], (rank, got)
        # A user's own optimizer declaring zerodp_whole_params is handed its matrices whole.
        owns = {2: [[(9, 13)], [(5, 9), (13, 7)]], 4: [[(9, 13)], [(13, 7)], [(5, 9)], []]}[n][rank]
        assert r["declared_shapes"] == owns, (rank, r["declared_shapes"])


def test_adafactor_steps_whole_and_refuses_to_save_factored_states(pool, tmp_path):
    for r in pool.run(2, cases.adafactor_case, str(tmp_path)):
        assert r["diff"] <= EXACT, r["diff"]
        assert r["refused"] and "row_var" in r["refused"] or "col_var" in r["refused"], r["refused"]


def test_checkpoint_reshards_and_loads_into_torch_muon(pool, tmp_path):
    # Saved at N=2 stage 2; the saver's continuation is what every load must reach.
    root = str(tmp_path)
    saved = pool.run(2, cases.save_case, root)[0]
    # N=1 (stage 1, the two ranks' batches as two micro-batches) and one process's torch Muon:
    # the same sums in the same order (EXACT, as above); N=4 stage 3: another order, MUON_TOL.
    one = pool.run(1, cases.resume_case, root, 1)[0]
    four = pool.run(4, cases.resume_case, root, 3)[0]
    plain = pool.run(1, cases.torch_resume_case, root)[0]
    assert plain["momentum_shapes"] == [(5, 9), (9, 13), (13, 7)]
    for name, value in saved.items():
        assert float((one[name] - value).abs().max()) <= EXACT, name
        assert float((plain["params"][name] - value).abs().max()) <= EXACT, name
        assert float((four[name] - value).abs().max()) <= MUON_TOL, name


def test_tensor_parallel_split_matrices_refused(pool):
    for message in pool.run(4, cases.tensor_parallel_case):
        assert message and "Muon needs whole parameters" in message and "tensor_parallel_size=1" in message, message


# -- pure logic: the aligned layout and the optimizer list (no world) ------------------------
def test_aligned_layout_puts_each_whole_parameter_in_one_chunk():
    import random

    from zerodp.memory.layout import FlatLayout

    rng = random.Random(0)
    for _ in range(200):
        n = rng.choice([1, 2, 3, 4, 8])
        shapes = [(rng.randint(1, 40), rng.randint(1, 40)) if rng.random() < 0.6 else (rng.randint(0, 50),)
                  for _ in range(rng.randint(1, 12))]
        whole = [len(s) == 2 and rng.random() < 0.8 for s in shapes]
        lay = FlatLayout(shapes, n, rng.choice([16, 64, 1 << 62]), whole)
        taken = set()
        for i, (slot, w) in enumerate(zip(lay.slots, lay.whole)):
            span = set(range(slot.offset, slot.offset + slot.numel))
            assert not span & taken, "parameters overlap"
            taken |= span
            assert slot.offset + slot.numel <= lay.padded_numel
            owners = [r for r in range(n) if lay.slot_pieces(i, r)]
            if w:  # one owner, holding it whole
                assert len(owners) == 1 and lay.slot_pieces(i, owners[0])[0][2] == slot.numel, (shapes, i)
        assert all(s.numel % n == 0 for s in lay.segments)  # equal chunks: the collectives stay the same
        assert sum(lay.owned_numel(r) for r in range(n)) == lay.numel
        assert lay.padded_numel - lay.numel == lay.alignment_padding + (lay.unaligned_padded_numel - lay.numel)


def test_layout_without_whole_parameters_is_the_plain_one():
    from zerodp.memory.layout import FlatLayout

    shapes = [(13, 7), (13,), (9, 13), (9,)]
    plain, flagged = FlatLayout(shapes, 4, 64), FlatLayout(shapes, 4, 64, [False] * 4)
    assert plain.slots == flagged.slots and plain.segments == flagged.segments
    assert [s.offset for s in plain.slots] == [0, 91, 104, 221] and plain.alignment_padding == 0


def test_optimizer_list_refusals():
    import torch

    import zerodp

    a, b = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="items 0 and 1: each parameter belongs to one optimizer"):
        zerodp.OptimizerList([torch.optim.Muon([a]), torch.optim.SGD([a, b], lr=0.1)])
    stepped = torch.optim.SGD([b], lr=0.1, momentum=0.9)
    b.grad = torch.ones(2)
    stepped.step()
    with pytest.raises(ValueError, match="item 0 \\(SGD\\) has already stepped"):
        zerodp.OptimizerList([stepped])
    with pytest.raises(TypeError, match="item 1 is str"):
        zerodp.OptimizerList([torch.optim.Muon([a]), "adamw"])
    with pytest.raises(ValueError, match="keyword arguments \\['lr'\\] are only for one optimizer class"):
        zerodp.initialize(torch.nn.Linear(2, 2), [torch.optim.SGD], lr=0.1)


def test_declaration():
    import torch

    from zerodp.optim.inner import needs_whole_params

    class Elementwise(torch.optim.Muon):
        zerodp_whole_params = False

    assert needs_whole_params(torch.optim.Muon) and needs_whole_params(torch.optim.Adafactor([torch.zeros(2, 2)]))
    assert not needs_whole_params(torch.optim.AdamW) and not needs_whole_params(Elementwise)
    assert needs_whole_params(cases.WholeSGD)


# The user's path: per step each Muon matrix's update may differ by 2 x 1.5 x lr x adjust
# (MUON_TOL's argument: micro-batches sum the gradients in another order), adjust =
# sqrt(max(1, rows / cols)) <= sqrt(2) for this Llama's projections, over HF_STEPS steps;
# AdamW's part by adamw_tol. Weak, as MUON_TOL is; the exact cases above are the strict check.
HF_TOL = max(2 * SIGMA_MAX * cases.MUON_LR * 2 ** 0.5 * cases.HF_STEPS, adamw_tol(cases.ADAMW_LR, cases.HF_STEPS))


@pytest.mark.parametrize("stage", [2, 3])
def test_recipe_on_an_hf_model_in_a_trainer_s_loop(pool, stage):
    for rank, r in enumerate(pool.run(2, cases.hf_user_loop, stage)):
        assert r["losses"][0] == r["ref_losses"][0], (rank, r)  # the same weights and batch
        assert r["params"] <= HF_TOL, (rank, r)
