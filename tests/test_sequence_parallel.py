"""Sequence parallelism (Ulysses) beside ZeRO (cases: sequence_parallel_cases.py): Hugging Face
Llama (grouped-query attention) and GPT-2, sdpa and eager, trained with sequence_parallel_size=2
at stages 1 and 3 equal one process training the whole model on the data-parallel global
batch, per step; the ledger counts the all-to-alls; the refusals name their fix."""
import pytest

import sequence_parallel_cases as cases
import zerodp
from tolerances import U32, adamw_tol

TIMEOUT_S = 240

# Bounds, derived (tolerances.py's method). Errors are |a-b| / (1 + |b|) per element.
#
# SGD (the scale-sensitive check): both runs compute every head's attention over the whole
# sequence with the same ops (the head shards only change how many heads one kernel call
# batches); what differs is the order of the sums: a weight's gradient sums the tokens of the
# k sequence slices in the reduction across ranks instead of inside one matmul, the groups'
# gradients likewise, and the loss is the sum of the k slices' sums. Each gradient element
# moves by at most K u sum|terms| with K = ROWS x SEQ x groups = 64 terms at N=4 and u = U32;
# sum|terms| <= GRAD_BOUND = 1.0 (the per-element gradient of these tiny models at init is
# below 0.3: losses ~log(64) = 4.2, weights of std 0.02). An update moves by lr times that,
# momentum by at most 1/(1 - 0.9) more, over STEPS = 3 steps: 3 x 0.05 x 10 x 64 x 6e-8 =
# 5.7e-6; x16 for the feedback through later gradients and other CPUs (as tolerances.FP32_TOL):
# 9.2e-5. A gradient scaled wrong (averaged over the sequence ranks instead of summed: 1/k)
# moves the first update by lr |g| / 2 ~ 1e-3 on the largest elements, 10x above; a slice's
# labels shifted wrong, or attention that misses another slice's keys, moves the loss by O(1e-2).
GRAD_BOUND, K_TERMS = 1.0, 2 * cases.ROWS * cases.SEQ
SGD_TOL = 16 * cases.STEPS * cases.SGD["lr"] / (1 - cases.SGD["momentum"]) * K_TERMS * U32 * GRAD_BOUND
# AdamW: 2 lr per step (tolerances.adamw_tol): weak by design; SGD is the strict check.
TOL = {"sgd": SGD_TOL, "adamw": adamw_tol(cases.ADAMW["lr"], cases.STEPS)}


def check(results, opt, sp, world_size, shard_size=None):
    """`shard_size`: the ranks ZeRO shards over, every rank (sequence x data) unless replicated."""
    tol = TOL[opt]
    groups = world_size // sp
    for r in results:
        diffs = [abs(a - b) / (1 + abs(b)) for a, b in zip(r["losses"], r["ref_losses"])]
        assert max(diffs) <= tol, (r["rank"], opt, r["losses"], r["ref_losses"])
        if groups == 1:  # the loss each rank returned is the whole sequence's
            assert max(abs(a - b) / (1 + abs(b)) for a, b in zip(r["group_losses"], r["ref_losses"])) <= tol
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= tol, (r["rank"], opt, worst, r["errors"][worst])
        assert r["sp_rank"] == r["rank"] % sp
        assert r["shard_size"] == (shard_size or world_size)  # ZeRO shards over every rank: sequence x data
        again = 2 if r["checkpointing"] else 1  # a checkpointed layer's forward runs again in backward
        for step in r["a2a"]:
            # Per layer: q, k, v to head shards in one exchange and the output back in forward;
            # the reverses in backward.
            assert len(step) == (2 * again + 2) * cases.LAYERS, step
            assert all(axis == "sp" and label == "ulysses attention" for _, axis, label, _ in step), step
            assert sum(phase == "forward" for phase, _, _, _ in step) == 2 * again * cases.LAYERS
            # Each forward exchange sends this rank's whole slice of q, k and v together, or of
            # the output: [ROWS, heads, SEQ/k, head_dim]; 32 = heads x head_dim of both models,
            # 16 that of Llama's two kv heads.
            kv = 16 if r["name"] == "llama" else 32
            per_layer = [32 + 2 * kv, 32]
            want = sorted(cases.ROWS * cases.SEQ // sp * n for n in per_layer * cases.LAYERS * again)
            assert sorted(numel for phase, _, _, numel in step if phase == "forward") == want, step


GRID = [("llama", 1, "sgd", "sdpa"), ("llama", 3, "adamw", "eager"), ("llama", 3, "sgd", "sdpa"),
        ("gpt2", 1, "adamw", "sdpa"), ("gpt2", 3, "sgd", "eager")]


@pytest.mark.parametrize("name,stage,opt,attn", GRID)
def test_two_ranks_one_sequence_parallel_group(pool, name, stage, opt, attn):
    results = pool.run(2, cases.parity_case, name, stage, opt, 2, attn, timeout_s=TIMEOUT_S)
    check([{**r, "name": name} for r in results], opt, 2, 2)


@pytest.mark.parametrize("stage,attn", [(1, "eager")])
def test_a_padded_batch(pool, stage, attn):
    """The second row's last 5 tokens are padding (attention_mask 0, labels -100): the whole
    sequence's mask reaches every head shard and the token counts make the same loss."""
    results = pool.run(2, cases.parity_case, "llama", stage, "sgd", 2, attn, True, timeout_s=TIMEOUT_S)
    check([{**r, "name": "llama"} for r in results], "sgd", 2, 2)


@pytest.mark.parametrize("stage", [3])
def test_checkpointed_layers(pool, stage):
    """Hugging Face's gradient checkpointing: each layer's forward, its all-to-alls and the
    whole sequence's mask included, runs again in backward; the same results."""
    results = pool.run(2, cases.parity_case, "llama", stage, "sgd", 2, "sdpa", True, True, timeout_s=TIMEOUT_S)
    check([{**r, "name": "llama"} for r in results], "sgd", 2, 2)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_two_checkpointed_forwards_before_one_backward(pool, attn):
    """Each recomputed layer gets the mask of its own forward (the model hands it in), not the
    last forward's: two differently padded batches, then one backward."""
    for r in pool.run(2, cases.two_forwards_case, 1, attn, timeout_s=TIMEOUT_S):
        assert abs(r["loss"] - r["ref_loss"]) / (1 + abs(r["ref_loss"])) <= SGD_TOL, r
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= SGD_TOL, (worst, r["errors"][worst])


@pytest.mark.parametrize("stage,checkpointing", [(1, False), (3, True)])
def test_the_bundled_gpt(pool, stage, checkpointing):
    """zerodp.demo's GPT (its attention called through `attend`, targets shifted by the
    caller), a padded batch (targets -100), with and without its gradient checkpointing."""
    results = pool.run(2, cases.parity_case, "gpt", stage, "sgd", 2, "sdpa", True, checkpointing,
                       timeout_s=TIMEOUT_S)
    check([{**r, "name": "gpt"} for r in results], "sgd", 2, 2)


def test_checkpoints_on_the_host(pool):
    """activations_on_host beside sequence parallelism (stage 3, Hugging Face checkpointing): the
    same results, and what the host keeps is each layer's input of this rank's slice,
    [ROWS, SEQ/k, hidden] in fp32 for each of the 2 layers (half the whole sequence's)."""
    results = pool.run(2, cases.parity_case, "llama", 3, "sgd", 2, "sdpa", True, True, False, True,
                       timeout_s=TIMEOUT_S)
    check([{**r, "name": "llama"} for r in results], "sgd", 2, 2)
    for r in results:
        assert r["host_peak"] == cases.LAYERS * cases.ROWS * (cases.SEQ // 2) * 32 * 4, r["host_peak"]
        assert r["host_checkpoints"] == {"device": 0, "host": 0}  # all used and freed by the backward


def test_four_ranks_two_groups_of_two(pool):
    """N=4: SP=2 x DP=2 at stage 3, sdpa, a padded batch; each group reads its own batch, the
    gradients are averaged over the two groups."""
    results = pool.run(4, cases.parity_case, "llama", 3, "sgd", 2, "sdpa", True, timeout_s=TIMEOUT_S)
    check([{**r, "name": "llama"} for r in results], "sgd", 2, 4)


@pytest.mark.parametrize("world,fields", [(2, {"offload_optimizer": "host", "offload_params": "host"}),
                                          (4, {"replicate_size": 2})], ids=["offload", "hybrid"])
def test_offload_and_hybrid_sharding_beside_sequence_parallelism(pool, world, fields):
    """Stage 3 with SP=2 and ZeRO-Offload's host optimizer and parameters (N=2), and with hybrid
    sharding (N=4: SP=2 x DP=2, the model sharded over 2 ranks and replicated twice): the same
    results as one process, the same all-to-alls."""
    results = pool.run(world, cases.parity_case, "llama", 3, "sgd", 2, "sdpa", timeout_s=TIMEOUT_S, fields=fields)
    check([{**r, "name": "llama"} for r in results], "sgd", 2, world,
          shard_size=world // fields.get("replicate_size", 1))


def test_one_exchange_carries_q_k_v_of_different_heads_and_sizes(pool):
    """Data movement only: every value equal, bit for bit, to the whole sequence's heads."""
    for r in pool.run(2, cases.exchange_case, timeout_s=TIMEOUT_S):
        assert r["forward"] == r["backward"] == r["separate"] == r["round_trip"] == r["dtypes"] == 0.0, r
        assert r["mixed_dtype"] == "torch.float64", r


def test_refusals_name_the_fix(pool):
    for r in pool.run(2, cases.refusal_case, timeout_s=TIMEOUT_S):
        assert "3 attention heads do not split over 2" in r["heads"], r
        assert "1 key/value heads do not split over 2" in r["kv_heads"], r
        assert "transformers' attention registry" in r["not_hf"], r
        assert "pad the batch to a multiple of 2" in r["length"], r
        assert "sliding window of 8 tokens" in r["window"], r
        assert "sequence-parallel group's ranks were fed different inputs" in r["different"], r
        assert "sample the data by the group (opt.comm.rank // 2)" in r["different"], r


@pytest.mark.parametrize("fields,name,words", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size", "tensor and sequence parallelism"),
    ({"expert_parallel_size": 2}, "expert_parallel_size", "expert and sequence parallelism"),
    ({"compile_units": True}, "compile_units", "compiled unit"),
    ({"sequence_parallel_size": 0}, "sequence_parallel_size", "positive integer"),
])
def test_what_does_not_compose_is_refused_at_construction(fields, name, words):
    with pytest.raises(zerodp.ConfigError, match=words) as e:
        zerodp.Config(**{"sequence_parallel_size": 2, **fields})
    assert name in str(e.value)


@pytest.mark.parametrize("name,stage", [("llama", 3), ("gpt2", 1)])
def test_tiled_loss_under_sequence_parallelism(pool, name, stage):
    """tiled_loss=True at N=2 SP=2 (GPT-2's head tied to its embedding): the same losses and
    parameters as one process with the untiled loss; the outputs carry no logits."""
    results = pool.run(2, cases.parity_case, name, stage, "sgd", 2, "sdpa", True, False, True, timeout_s=TIMEOUT_S)
    check([{**r, "name": name} for r in results], "sgd", 2, 2)


# Peak memory of one step's forward and backward (one rank, a Llama whose vocabulary is 128x
# its hidden size, 256 tokens): untiled, the fp32 logits [T, V] (logits_nbytes), their
# log-softmax saved for backward and, in backward, the gradients of both exist at once, so its
# peak holds at least 3 logits_nbytes; tiled, one tile of T / ceil(V / H) = 2 tokens' logits at
# a time (1/128 of them) beside the model's own tensors, which both runs hold. Measured here:
# 18.5 MB untiled, 3.3 MB tiled, logits_nbytes 4.2 MB.
def test_tiled_loss_never_holds_the_whole_logits(pool):
    plain, tiled = (pool.run(1, cases.tiled_memory_case, 3, t, timeout_s=TIMEOUT_S)[0] for t in (False, True))
    logits = plain["logits_nbytes"]
    assert tiled["peak"] < logits, (tiled["peak"], logits)
    assert tiled["peak"] + 2 * logits <= plain["peak"], (tiled["peak"], plain["peak"], logits)
    # The same loss and SGD step: only the order of the sums differs (the tiles' partial sums,
    # and the head's gradient summed over the tiles): well inside tolerances.FP32_TOL's terms.
    assert abs(tiled["loss"] - plain["loss"]) / (1 + abs(plain["loss"])) <= SGD_TOL
    worst = max(cases.rel(tiled["params"][n], p) for n, p in plain["params"].items())
    assert worst <= SGD_TOL, worst


@pytest.mark.parametrize("fields,name", [({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                                         ({"compile_units": True}, "compile_units")])
def test_tiled_loss_refusals(fields, name):
    with pytest.raises(zerodp.ConfigError, match="with tiled_loss") as e:
        zerodp.Config(tiled_loss=True, **fields)
    assert name in str(e.value)


# bf16: the run with sequence parallelism against the same run without, both zerodp in bf16.
# They round differently: a weight's gradient sums the k slices' tokens in bf16 across ranks
# instead of inside one matmul, and the loss sums the slices' sums. That moves a gradient
# element by at most K_TERMS u16 sum|terms| (u16 = 2^-9), an SGD update by lr / (1 - momentum)
# times that per step, over STEPS steps, and the compared bf16 parameter by one bf16 ulp
# (2^-8) more: 0.19 (test_moe.BF16_TOL's derivation). Weak, as a bf16 bound must be; the fp32
# grid is the strict check. It still catches a lost slice or a wrong mask (O(1) on the loss).
BF16_TOL = cases.STEPS * cases.SGD["lr"] / (1 - cases.SGD["momentum"]) * K_TERMS * 2.0**-9 * GRAD_BOUND + 2.0**-8


@pytest.mark.parametrize("stage,precision,micro_batches", [(3, "bf16", 1), (1, "fp32", 2)])
def test_with_and_without_sequence_parallelism(pool, stage, precision, micro_batches):
    """bf16, and accumulation over two micro-batches (fp32: the strict bound), against the
    same zerodp run without sequence parallelism on the same batch."""
    tol = BF16_TOL if precision == "bf16" else SGD_TOL
    for r in pool.run(2, cases.with_and_without_case, "llama", stage, precision, micro_batches,
                      timeout_s=TIMEOUT_S):
        diffs = [abs(a - b) / (1 + abs(b)) for a, b in zip(r["losses"], r["plain_losses"])]
        assert max(diffs) <= tol, (r["losses"], r["plain_losses"])
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= tol, (worst, r["errors"][worst])


def test_a_checkpoint_saved_with_sequence_parallelism_loads_without(pool, tmp_path):
    """zerodp.save at SP=2 (stage 3, AdamW), zerodp.load at SP=1 on the same ranks: the same
    parameters bit for bit (the ranks of a group hold the same states: nothing of the split is
    saved), and the next step the same within the AdamW bound of one step."""
    for r in pool.run(2, cases.checkpoint_case, str(tmp_path / "ckpt"), 3, timeout_s=TIMEOUT_S):
        assert r["load_errors"] == 0.0, r
        assert abs(r["loss"] - r["plain_loss"]) / (1 + abs(r["plain_loss"])) <= SGD_TOL, r
        assert r["errors"] <= adamw_tol(cases.ADAMW["lr"], 1), r


def test_the_hugging_face_trainer_matches_ddp(pool, tmp_path):
    """zerodp's Trainer with sequence_parallel_size=2: its loaders hand the group one batch
    (twice the per-device batch, what DDP's two ranks read together), its token counts and
    loss scale count the group once; the logged losses, gradient norms and the eval loss are
    the plain Trainer's under DDP within test_hf_trainer's bounds. compute_metrics is refused."""
    from test_hf_trainer import CHAIN_ROUNDING, check_against_ddp

    for r in pool.run(2, cases.trainer_case, str(tmp_path), timeout_s=TIMEOUT_S):
        wrong = check_against_ddp(r["sp"], r["ddp"], "fp32", r["numel"])
        assert not wrong, wrong
        want = r["ddp"]["eval_loss"][0]
        assert abs(r["sp"]["eval_loss"][0] - want) <= CHAIN_ROUNDING * (1 + abs(want)), (r["sp"]["eval_loss"], want)
        assert "compute_metrics" in r["metrics"] and "sequence_parallel_size=2" in r["metrics"], r["metrics"]


# The tiled MLP against the untiled reference: a token's MLP output is computed by the same
# ops on a tile's rows as on the whole sequence's; only each MLP weight's gradient is summed
# in another order (one partial sum per tile, accumulated), and it is still a sum of the same
# ROWS x SEQ token terms that SGD_TOL's K_TERMS counts: SGD_TOL holds as derived above.
@pytest.mark.parametrize("name,stage,checkpointing,units", [
    ("llama", 3, True, ("LlamaMLP", "LlamaDecoderLayer")),  # each MLP a stage-3 unit of its own
    ("gpt", 2, False, ()),
    ("llama", 1, False, ()),
])
def test_tiled_mlp_under_sequence_parallelism(pool, name, stage, checkpointing, units):
    """tiled_mlp=True at N=2 SP=2: per step the untiled reference's losses, and its parameters.
    With each MLP a unit of its own under Hugging Face checkpointing, the tiles' recomputation
    (inside the layer's, inside backward) runs while the MLP's unit is gathered again: a
    sharded weight would raise stage 3's guard or change the result."""
    results = pool.run(2, cases.parity_case, name, stage, "sgd", 2, "sdpa", name == "gpt", checkpointing,
                       tiled_mlp=True, units=units, timeout_s=TIMEOUT_S)
    check([{**r, "name": name} for r in results], "sgd", 2, 2)
    # Tiles per MLP forward: ceil(intermediate / hidden) = 2 (Llama's 64 / 32) and 4 (the GPT's
    # 4 x 32 / 32) for ROWS x SEQ/2 = 16 tokens (recomputations in backward not counted).
    tiles = (2 if name == "llama" else 4) * cases.STEPS
    for r in results:
        assert r["mlp_tiles"] == [tiles] * cases.LAYERS, r["mlp_tiles"]
        if units:
            assert sum(".mlp" in u for u in r["units"]) == cases.LAYERS, r["units"]


# One process: the tiled MLP against the untiled one on the same weights and batch. The same
# ops per token; each MLP weight's gradient summed as 32 tiles' partial sums instead of one
# matmul: each element moves by at most SEQ_TOKENS u32 sum|terms| (sum|terms| <= GRAD_BOUND),
# the SGD step (lr 0.1, no momentum) by lr times that: 0.1 x 256 x 6e-8 = 1.5e-6; x16 as above.
MLP_TOKENS, MLP_LR = 256, 0.1
MLP_TOL = 16 * MLP_LR * MLP_TOKENS * U32 * GRAD_BOUND


# Peak memory of one step's forward and backward (a Llama layer whose MLP is 32x its hidden size
# wide, 256 tokens, stage 3 at N=1): untiled, the MLP keeps gate, up, their activation and
# product for backward, four [T, I] fp32 tensors (intermediate_nbytes each), and its backward
# adds their gradients; tiled (32 tiles of 8 tokens), 1/32 of that at a time.
def test_tiled_mlp_never_holds_the_whole_intermediate(pool):
    r = pool.run(1, cases.tiled_mlp_case, 3, intermediate=1024, seq=MLP_TOKENS, timeout_s=TIMEOUT_S)[0]
    plain, tiled, inter = r["plain"], r["tiled"], r["intermediate_nbytes"]
    assert tiled["tiles"] == [32] and plain["tiles"] == [], (tiled["tiles"], plain["tiles"])
    assert tiled["peak"] + 3 * inter <= plain["peak"], (tiled["peak"], plain["peak"], inter)
    assert tiled["peak"] < 2 * inter, (tiled["peak"], inter)
    assert abs(tiled["loss"] - plain["loss"]) / (1 + abs(plain["loss"])) <= MLP_TOL
    worst = max(cases.rel(tiled["params"][n], p) for n, p in plain["params"].items())
    assert worst <= MLP_TOL, worst


@pytest.mark.parametrize("fields,name", [({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                                         ({"expert_parallel_size": 2}, "expert_parallel_size"),
                                         ({"compile_units": True}, "compile_units")])
def test_tiled_mlp_refusals(fields, name):
    with pytest.raises(zerodp.ConfigError, match="with tiled_mlp") as e:
        zerodp.Config(tiled_mlp=True, **fields)
    assert name in str(e.value)


def test_tiled_mlp_refuses_models_it_cannot_tile():
    import torch.nn as nn
    from transformers import MixtralConfig, MixtralForCausalLM

    from zerodp.sequence_parallel import apply_tiled_mlp

    with pytest.raises(zerodp.ConfigError, match="no layer whose MLP.*use tiled_mlp=False"):
        apply_tiled_mlp(nn.Sequential(nn.Linear(4, 4)))
    moe = MixtralForCausalLM(MixtralConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2, num_local_experts=2))
    with pytest.raises(zerodp.ConfigError, match="routes tokens to experts.*use tiled_mlp=False"):
        apply_tiled_mlp(moe)
