"""Stage 3 against torch DDP and stage 2, with every hard case, a case per test (cases: stage3_cases.py)."""
import pytest

import stage3_cases as cases
from stage3_cases import big_model_world
from harness import run_world
from tolerances import BF16_ULP, adamw_tol

# Every case here trains with AdamW (stage3_cases): a parity bound is tolerances.adamw_tol
# (2 lr per step: a near-zero gradient's Adam step may take either sign under any rounding
# difference), plus one bf16 ulp (2^-8 in the 1 + |b| metric) in bf16. The scale-sensitive
# stage-3 check is plain SGD: test_trust.test_sgd_stage3_accumulation_and_fp32_reduction.
# GPT parity: stage3_cases.adamw, lr 1e-3, STEPS = 4: fp32 8e-3, bf16 1.2e-2 (measured
# bf16 2.3e-3, N=4: 5x below; fp32 within the old 1e-6). Catches a misplaced or unrestored
# shard, a tied weight not tied (elements O(0.02-1) apart), non-finite values.
GPT_TOL = {"fp32": adamw_tol(1e-3, 4), "bf16": adamw_tol(1e-3, 4) + BF16_ULP}


SIZES = pytest.mark.parametrize("n", [1, 2, 4], ids=lambda n: f"N{n}")
PRECISIONS = pytest.mark.parametrize("precision", ["fp32", "bf16"])


@SIZES
@PRECISIONS
def test_gpt_parity_with_ddp_and_stage2(pool, n, precision):
    for p in pool.cached(n, cases.gpt_case, precision):
        tol = GPT_TOL[precision]
        assert p["vs_ddp"] <= tol, (n, precision, p["vs_ddp"])
        # Every step's parameters and loss within the run's bound (parity.py).
        assert max(p["per_step"]["params"]) <= tol and max(p["per_step"]["losses"]) <= tol, p["per_step"]
        # Stage 3 reduces the same gradients in the same dtype as stage 2.
        assert p["vs_stage2"] <= tol, (n, precision, p["vs_stage2"])
        assert p["tied"] and p["stage2_tied"]
        assert p["stage2_numel"] == p["numel"] == p["distinct_numel"]
        assert p["unit_names"] == ["transformer.h.0", "transformer.h.1", "<root>"]


@SIZES
def test_model_parameters_are_owned_shards(pool, n):
    p = pool.cached(n, cases.gpt_case, "fp32")[0]
    # Outside a gather each parameter is a view of the rank's shard: Ψ/N elements in all
    # (up to per-unit padding).
    assert p["numel"] / n - n <= p["local_numel"] <= p["padded"] / n


@SIZES
@PRECISIONS
def test_memory_is_16_psi_over_n(pool, n, precision):
    for p in pool.cached(n, cases.gpt_case, precision):
        assert p["memory"] == p["expect"], (n, precision)
        assert p["padded"] - p["numel"] < 3 * n  # padding: fewer than N per unit
        if precision == "bf16":
            assert sum(p["memory"].values()) == 16 * p["padded"] // n


@SIZES
@PRECISIONS
def test_gathered_peak_bounded_by_units_in_flight(pool, n, precision):
    p = pool.cached(n, cases.gpt_case, precision)[0]
    # The root (embeddings, final norm) stays gathered while its children run; at most
    # prefetch_units + 1 = 2 other units are gathered with it.
    bound = p["root_nbytes"] + 2 * p["max_unit_nbytes"]
    assert 0 < p["peak"] <= bound
    assert p["peak"] > p["root_nbytes"]  # a block really was gathered with the root


@SIZES
def test_outer_unit_takes_gradients_into_its_parameter_buffer(pool, n):
    for o in pool.run(n, cases.outer_unit_buffers):
        assert o["vs_ddp"] <= adamw_tol(1e-3, 2), (n, o["vs_ddp"])
        assert o["outer"] == [False, False, True]  # the root encloses the blocks
        # One root-sized buffer serves the root's gathered parameters and then its
        # gradients; blocks add at most a few of their own (gather, prefetch, reduce).
        assert o["root_nbytes"] > 10 * o["max_unit_nbytes"]
        assert o["root_nbytes"] <= o["pool_nbytes"] < 2 * o["root_nbytes"], o


@SIZES
def test_comm_volume_three_psi(pool, n):
    p = pool.cached(n, cases.gpt_case, "fp32")[0]
    psi = p["padded"]
    # The per-step snapshots of parity.StepTrace gather the state dict (phase "checkpoint"),
    # outside the training step's volume.
    by_op = {k: v for k, v in p["by_op"].items() if not k.endswith("/checkpoint")}
    assert by_op == {"all_gather/forward": psi, "all_gather/backward": psi, "reduce_scatter/backward": psi}
    assert p["volume"] == 3 * psi
    nr = pool.run(n, cases.no_reshard_case)[0]
    assert nr["volume"] == 2 * nr["padded"]


# The hard cases run the batch's two halves as two forwards before one backward, DDP as
# one forward over both (DDP allows one forward per backward): in bf16 the two batchings
# of the matmuls round differently, and Adam at lr 1e-2 turns a sign flip of a near-zero
# gradient into a step of up to lr of either sign. Derived: stage3_cases.adamw_no_decay,
# lr 1e-2, STEPS = 4: 2 lr x 4 = 8e-2 (fp32), plus one bf16 ulp (3.9e-3) in bf16: 8.4e-2.
# Measured 8.2e-3 (N=1, bf16) over 4 steps: 10x below. Catches an unused or frozen parameter
# moved, a swapped shard, non-finite values (checked exactly above/beside it too).
HARD_FP32_TOL = adamw_tol(1e-2, 4)
HARD_BF16_TOL = adamw_tol(1e-2, 4) + BF16_ULP


@SIZES
@PRECISIONS
def test_hard_cases(pool, n, precision):
    for h in pool.run(n, cases.hard_case, precision):
        tol = HARD_FP32_TOL if precision == "fp32" else HARD_BF16_TOL
        assert h["vs_ddp"] <= tol, (n, precision, h["vs_ddp"])
        assert h["unused_unchanged"] and h["frozen_unchanged"] and h["tied"] and h["buffer_ok"]
        assert h["eval_rel"] <= tol
        assert h["all_freed"] and h["no_grads"]
        assert h["units"] == ["blocks.0", "blocks.0.inner", "blocks.1", "blocks.1.inner", "<root>"]
        assert h["outer"] == [True, False, True, False, True]  # nested: gradients taken at the end


ACCUM_TOL = adamw_tol(1e-3, 4)


@SIZES
def test_accumulation_equals_large_batch(pool, n):
    a = pool.run(n, cases.accumulation_case, True)[0]
    # Two 16-token means averaged are not bitwise one 32-token mean: the loss itself rounds
    # differently (~1e-7), and Adam's normalised steps carry that for 4 steps on elements
    # whose gradients are near zero, up to lr of either sign per step: the AdamW bound,
    # adamw_tol(1e-3, 4) = 8e-3 (stage3_cases.adamw). Measured: within the old 1e-5. A missed
    # or doubled micro-batch is caught by the plain-SGD stage-3 accumulation grid
    # (test_trust, FP32_TOL); this still catches a misplaced shard or non-finite values.
    assert a["vs_ddp"] <= ACCUM_TOL
    assert a["reduce_scatter"] == 2 * a["padded"]  # one reduce-scatter of Ψ per micro-batch
    b = pool.run(n, cases.accumulation_case, False)[0]
    assert b["vs_ddp"] <= ACCUM_TOL
    assert b["reduce_scatter"] == b["padded"]  # one reduce-scatter of Ψ per step, at the boundary


@SIZES
def test_branch_taken_later_still_equals_ddp(pool, n):
    for branch in pool.run(n, cases.branch_case):
        assert branch <= HARD_FP32_TOL  # adamw_no_decay, lr 1e-2, 4 steps


def test_automatic_units_by_parameter_count():
    import torch

    import zerodp
    from zerodp.demo.models import GPT
    from zerodp.sharding.units import select_units

    model = GPT("tiny")
    block = sum(p.numel() for p in model.transformer.h[0].parameters())
    names = [n for n, _ in select_units(model, (), block)]
    # Each block reaches the threshold; nothing smaller does; the rest is the root's.
    assert names == ["transformer.h.0", "transformer.h.1", ""]
    with torch.no_grad():
        _, opt = zerodp.initialize(model, torch.optim.SGD, zerodp.Config(stage=3, unit_min_params=block), lr=0.1)
    assert [u.name for u in opt.stage3.units] == ["transformer.h.0", "transformer.h.1", "<root>"]
    with pytest.raises(ValueError, match="matches no submodule"):
        select_units(GPT("tiny"), ("NoSuchBlock",), 1)


@pytest.mark.parametrize("offload", ["none", "host"])
def test_an_untied_hf_input_embedding_is_a_unit_unless_parameters_are_offloaded(offload):
    """Automatic units of an HF model: its blocks and, untied from the head, its input
    embedding; with offloaded parameters the embedding stays in the root (a model may move
    its ids to the weight's device before the embedding's forward gathers it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerodp

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, tie_word_embeddings=False))
    _, opt = zerodp.initialize(model, torch.optim.SGD, zerodp.Config(stage=3, offload_params=offload, offload_optimizer=offload), lr=0.1)
    embedding = ["model.embed_tokens"] if offload == "none" else []
    assert [u.name for u in opt.stage3.units] == embedding + ["model.layers.0", "model.layers.1", "<root>"]


@SIZES
def test_born_sharded_and_gathered_parameters(pool, n):
    for g in pool.run(n, cases.gathered_and_born):
        assert g["meta_before"] and g["born_equal"] and g["born_tied"]
        assert g["modify_full_shape"] == (128, 32)
        assert g["modify_applied"]  # rank 0's value on every rank
        assert len(g["shard_shape_after"]) == 1


@pytest.mark.parametrize("n", [2, 4], ids=lambda n: f"N{n}")  # divergence needs two ranks
def test_debug_mode_names_diverging_unit(pool, n):
    for debug in pool.run(n, cases.debug_divergence):
        assert debug is not None
        assert "ranks diverged" in debug and "blocks.1" in debug and f"rank {n - 1}" in debug


def test_born_sharded_model_larger_than_a_rank():
    # 13 x Linear(4096, 4096) = 218M parameters, 0.8 GiB of fp32 weights, at world size 4.
    # A fresh world: ru_maxrss is a process's lifetime peak, which a reused rank has already set.
    results = run_world(4, big_model_world, 4096, 13, timeout_s=500)
    for r in results:
        assert r["full_nbytes"] >= 0.75 * 2**30
        assert r["shard_nbytes"] == r["full_nbytes"] // 4
        # Building it adds the rank's quarter and a unit in flight; never the whole model.
        assert r["peak_rss"] - r["base_rss"] < 0.5 * r["full_nbytes"], r


def test_born_on_meta_below_stage_3_is_materialised_whole():
    import torch

    import zerodp
    from zerodp.demo.models import GPT

    torch.manual_seed(0)
    eager = GPT("tiny")
    torch.manual_seed(0)
    cfg = zerodp.Config(stage=2)
    with zerodp.init(cfg):
        meta = GPT("tiny")
    model, _ = zerodp.initialize(meta, torch.optim.SGD, cfg, lr=0.1)
    assert not any(p.is_meta for p in model.parameters())
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.equal(p, q), n
    assert model.lm_head.weight is model.transformer.wte.weight


def test_a_models_own_init_weights_of_another_signature_is_left_alone():
    """Only an `_init_weights(module)` (Hugging Face's per-module initialiser) initialises
    modules under zerodp.init; a model's `_init_weights(self)` is not called with one."""
    import torch
    import torch.nn as nn

    import zerodp

    class NoArg(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self._init_weights()

        def _init_weights(self):
            for p in self.parameters():
                nn.init.normal_(p, std=0.02)

        def forward(self, x):
            return self.b(self.a(x))

    cfg = zerodp.Config(stage=2)
    with zerodp.init(cfg):
        model = NoArg()
    model, _ = zerodp.initialize(model, torch.optim.SGD, cfg, lr=0.1)
    assert not any(p.is_meta for p in model.parameters())
    assert torch.isfinite(model(torch.ones(2, 8))).all()
