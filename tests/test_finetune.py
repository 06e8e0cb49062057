"""PEFT/LoRA fine-tunes with zerodp (cases: finetune_cases.py): every stage against one
process on the global batch, the frozen base sharded at stage 3 and measured, the natural
save calls, and TRL's SFTTrainer against SFTTrainer under DDP."""

import pytest

pytest.importorskip("peft")

import finetune_cases as cases  # noqa: E402
from finetune_cases import ADAMW_LR, SGD_LR, STEPS  # noqa: E402
from tolerances import N_MAX, U16, U32, adamw_tol  # noqa: E402

# Errors are |a-b| / (1 + |b|) per element, worst element; bounds derived from the cases
# (STEPS = 3; SGD lr 0.1 without momentum; AdamW lr 1e-3; N <= N_MAX), never measured.
# Per-element bound on the mean of the N ranks' |gradient| terms on the adapters: the
# reference's step-0 gradients are at most ~0.3 (tiny Llama, loss ~5.5); 1.0 leaves 3x.
GRAD_BOUND = 1.0
# fp32 SGD: zerodp averages the N ranks' gradients in another order than the reference's
# autograd does (it divides each by N, sums over the ranks): per step an element moves by
# <= N u sum|terms|, an update by lr times that, over STEPS steps, x16 for the feedback through
# later gradients and for other CPUs' kernels: 1.1e-6. A gradient summed instead of averaged
# moves the update by (N-1) lr |g| ~ 1e-2 per step on the largest elements, 10^4 x above.
SGD_TOL = 16 * STEPS * SGD_LR * N_MAX * U32 * GRAD_BOUND
# The bf16 base (fp32 adapters): one step's parameter difference can flip a bf16 rounding
# of an activation (one ulp, U16 relative) and so of every gradient downstream of it: per
# step lr N U16 GRAD_BOUND, over STEPS steps: 2.3e-3. The adapters stay fp32: no final rounding.
SGD_BF16_TOL = STEPS * SGD_LR * N_MAX * U16 * GRAD_BOUND
# AdamW divides by sqrt(v): an element whose gradient is rounding noise steps ~lr either way.
ADAMW_TOL = adamw_tol(ADAMW_LR, STEPS)
# Losses, step 0 equal exactly (same weights, same batch); later steps: to first order
# dL = sum_i g_i dp_i over the <= 20k trainable elements, each |dp_i| within the parameter
# bound times (1 + |p|) <= 2: the SGD bound gives 20k x 1.0 x 2 x 1.1e-6 = 4.4e-2 (vacuous
# for steps > 0 in bf16, where the parameter check is the strict one).
TRAINABLE_MAX = 20_000

CELLS = [(3, "sgd", "plain"), (3, "adamw", "plain"), (3, "sgd", "clip_accum"), (3, "sgd", "bf16_base"),
         (3, "adamw", "bf16_base"), (3, "sgd", "ckpt_reentrant"), (3, "sgd", "ckpt_nonreentrant"),
         (1, "sgd", "plain"), (2, "sgd", "clip_accum"), (2, "adamw", "bf16_base")]


def _tol(opt_name, variant):
    if opt_name == "adamw":
        return ADAMW_TOL
    return SGD_BF16_TOL if variant == "bf16_base" else SGD_TOL


@pytest.mark.parametrize("stage,opt_name,variant", CELLS, ids=lambda c: str(c))
def test_lora_trains_equal_to_one_process(pool, stage, opt_name, variant):
    for rank, r in enumerate(pool.run(2, cases.lora_parity, stage, opt_name, variant)):
        key = (stage, opt_name, variant, rank)
        assert r["keys"], key
        assert r["losses"][0] == r["ref_losses"][0], (key, r["losses"], r["ref_losses"])
        bound = TRAINABLE_MAX * 2 * _tol(opt_name, variant)
        assert all(abs(a - b) <= bound for a, b in zip(r["losses"], r["ref_losses"])), (key, r)
        assert r["trainable"] <= _tol(opt_name, variant), (key, r["trainable"])
        assert r["frozen_equal"], key  # the frozen base is never changed, at any stage
        if opt_name == "sgd":  # the adapters did train, beyond the bound (AdamW's bound is its step size)
            assert r["moved"] > 2 * _tol(opt_name, variant), key
        if variant == "bf16_base":
            assert r["frozen_dtypes"] == ["torch.bfloat16"], key


def test_lora_trains_equal_to_one_process_at_four_ranks(pool):
    for rank, r in enumerate(pool.run(4, cases.lora_parity, 3, "sgd", "plain")):
        assert r["losses"][0] == r["ref_losses"][0] and r["trainable"] <= SGD_TOL and r["frozen_equal"], (rank, r)


@pytest.mark.parametrize("n", [2, 4])
def test_stage3_shards_the_frozen_base(pool, n):
    for r in pool.run(n, cases.ledger):
        # Exactly the hand count: per unit ceil(frozen / N) bf16 elements; the census of the
        # storages the frozen parameters point into agrees.
        assert r["frozen"] == r["frozen_by_hand"] == r["census"], r
        # 2 Psi_f / N up to one padding element per unit and rank.
        assert abs(r["frozen"] - 2 * r["frozen_total"] / n) <= 2 * r["units"], r
        # Trainable: 16 Psi_t / N in the paper's mixed precision, by hand per unit.
        assert r["trainable_state"] == r["trainable_by_hand"], r
        assert r["model_state"] == r["frozen_by_hand"] + r["trainable_by_hand"], r
        # The untied embedding is a unit of its own: frozen and fed token ids, it is gathered
        # for its forward only; the blocks are gathered again for their backward.
        embed = "base_model.model.model.embed_tokens"
        assert r["unit_names"][0] == embed, r["unit_names"]
        assert f"unit {embed}" in r["gathered"]["forward"] and f"unit {embed}" not in r["gathered"]["backward"], r
        assert "unit base_model.model.model.layers.0" in r["gathered"]["backward"], r


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_keep_the_frozen_base_replicated(pool, stage):
    for r in pool.run(2, cases.ledger_replicated, stage):
        assert r["frozen"] == r["by_hand"], r


def test_peft_save_pretrained_as_the_trainer_calls_it(pool, tmp_path):
    r = pool.run(2, cases.peft_saves, str(tmp_path))[0]
    assert r["keys"] and r["n_keys"] > 0 and not r["empty"], r  # never peft #2500's [0]-shaped adapters
    assert r["adapters"] <= SGD_TOL, r
    assert r["same_as_zerodp_save"], r
    # Logits ~ 5 in size: the adapters' bound through 2 layers of a forward, x (1 + |logit|) <= 10.
    assert r["logits"] <= 10 * SGD_TOL * 10, r


def test_hf_model_s_own_save_pretrained_at_stage_3(pool, tmp_path):
    r = pool.run(2, cases.hf_save_pretrained, str(tmp_path))[0]
    assert r["equal"] and r["tied"], r


def test_frozen_base_checkpoint_round_trips(pool, tmp_path):
    for r in pool.run(2, cases.frozen_checkpoint, str(tmp_path)):
        assert r["equal"], r


@pytest.mark.parametrize("kind", ["sft", "dpo", "dpo_ref"])
def test_trl_trainer_with_zerodp_equals_the_trainer_under_ddp(pool, tmp_path, kind):
    r = pool.run(2, cases.trl_world, str(tmp_path), kind, timeout_s=600)[0]
    assert list(r["zerodp"]) == list(r["ddp"]) == list(range(1, STEPS + 1)), r
    # Step 1: the same weights and batch, so the same loss exactly. Later steps: the runs
    # differ by the order the N gradients are summed; SGD at lr 0.5 (no momentum), to first
    # order sum_i g_i dp_i over <= TRAINABLE_MAX elements with |dp_i| <= 2 x (SGD_TOL scaled
    # to lr 0.5) and |g_i| <= 1 for SFT's mean token loss: 20k x 2 x 5.7e-6 = 0.23. DPO's loss
    # -log sigmoid(beta m) moves by <= beta |dm|, m a difference of two sums of <= T = 6 token
    # log-probabilities (the completion and its EOS) of the policy: with each token's
    # log-probability gradient element bounded by 1 as SFT's token loss is, |g_i| <= 2 T beta
    # = 1.2, which scales both the parameter differences (SGD_TOL assumes 1) and their effect
    # on the loss: x 1.2^2. "dpo_ref" trains the whole model (34,656 elements, not <= 20k).
    # Weak (N = 2 sums are order-free, so the runs are expected equal to rounding); the
    # parity grid above is the strict check of the engine.
    assert r["zerodp"][1] == r["ddp"][1], r
    grad = 1.0 if kind == "sft" else 2 * (cases.DPO_COMPLETION + 1) * cases.DPO_BETA
    trainable = 34_656 if kind == "dpo_ref" else TRAINABLE_MAX
    bound = grad ** 2 * trainable * 2 * SGD_TOL * 0.5 / SGD_LR
    assert all(abs(r["zerodp"][s] - r["ddp"][s]) <= bound for s in r["ddp"]), r
    # Resumed from checkpoint-2 (the frozen base and adapters, zerodp's sharded checkpoint),
    # step 3 is the uninterrupted run's exactly: the same world, stage and batch.
    assert r["resumed"][STEPS] == r["zerodp"][STEPS], r


def test_adapters_merge_one_unit_at_a_time(pool, tmp_path):
    results = pool.run(2, cases.merged, str(tmp_path))
    r = results[0]
    assert r["keys"] and r["loaded_keys"] and r["loaded_equal"], r
    # The merged weight is W + B A scaling of the trained adapters: their bound, times the
    # product's gain |B| |A| r scaling <= 4 x 2 on these tiny matrices: 8 SGD_TOL.
    assert r["values"] <= 8 * SGD_TOL, r
    assert results[1]["empty"], results[1]  # rank0_only: the other ranks hold nothing


def test_a_frozen_base_born_sharded_and_loaded_by_pieces(pool):
    for r in pool.run(2, cases.born_sharded_frozen):
        assert r["on_meta"] and r["frozen_sharded"] and r["loaded"], r


def test_paths_trainers_take_at_stage_3(pool, tmp_path):
    results = pool.run(2, cases.paths_trainers_take, str(tmp_path))
    r = results[0]
    assert r["generate"], r  # the PEFT model's generate runs the wrapped model's forward: gathered
    assert r["embedding_saved"], r
    assert all(x["merge_refused"] for x in results), results
    # One SGD step at lr 0.1 from the same gradients, averaged in another order: the fp32 bound.
    assert all(x["in_place"] <= SGD_TOL for x in results), results
