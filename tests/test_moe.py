"""Expert parallelism beside ZeRO (cases: moe_cases.py): Hugging Face Mixtral and Qwen3-MoE
trained with expert_parallel_size > 1 at stages 1-3 equal one process training the unsplit
model on the global batch, per step; the ledger counts the all-to-alls."""
import pytest

import moe_cases as cases
from tolerances import U32, adamw_tol

TIMEOUT_S = 240

# Bounds, derived (tolerances.py's method). Errors are |a-b| / (1 + |b|) per element.
#
# SGD (the scale-sensitive check): both runs compute every token's contribution with the same
# ops; what differs is the order of the sums: the N ranks' gradients (and under expert
# parallelism, the k ranks' tokens inside an expert's gradient, summed by one matmul on the
# expert's rank instead of one per rank), the top-k terms of a token (a + b either way for
# top-2) and the batch's rows inside a matmul. Each gradient element moves by at most
# K u sum|terms| with K = N x ROWS x SEQ = 64 terms at N=4 and u = U32; sum|terms| <= GRAD_BOUND
# = 1.0 (the per-element gradient of these tiny models at init is below 0.3: the losses are
# ~log(64) = 4.2 with weights of std 0.02). An update moves by lr times that, momentum by at most
# 1/(1 - 0.9) more, over STEPS = 3 steps: 3 x 0.05 x 10 x 64 x 6e-8 = 5.7e-6; x16 for the
# feedback through later gradients and other CPUs (as tolerances.FP32_TOL): 9.2e-5. A gradient
# scaled wrong (1/k, k x: the expert one reduced over the wrong ranks) moves the first update by
# lr |g| / 2 ~ 1e-3 on the largest elements, 10x above.
GRAD_BOUND, K_TERMS = 1.0, 4 * cases.ROWS * cases.SEQ
SGD_TOL = 16 * cases.STEPS * cases.SGD["lr"] / (1 - cases.SGD["momentum"]) * K_TERMS * U32 * GRAD_BOUND
# AdamW: 2 lr per step (tolerances.adamw_tol): weak by design; SGD is the strict check.
TOL = {"sgd": SGD_TOL, "adamw": adamw_tol(cases.ADAMW["lr"], cases.STEPS)}
LAYERS = 2
# ||zerodp - reference|| / ||reference - initial|| over this rank's banks: rounding moves it by
# about the elementwise error over the update's size (~1e-8 / 1e-3 with SGD); an expert
# gradient scaled by c != 1 moves it by |1 - c| >= 0.5 (the 1/k or k x of a reduction over the
# wrong ranks). AdamW normalises the scale away; SGD is where this is strict.
UPDATE_REL_TOL = 1e-2


def check(results, opt, ep):
    tol = TOL[opt]
    for r in results:
        diffs = [abs(a - b) / (1 + abs(b)) for a, b in zip(r["losses"], r["ref_losses"])]
        assert max(diffs) <= tol, (r["rank"], opt, r["losses"], r["ref_losses"])
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= tol, (r["rank"], opt, worst, r["errors"][worst])
        if opt == "sgd":
            assert r["bank_update_rel"] <= UPDATE_REL_TOL, (r["rank"], r["bank_update_rel"])
        assert len(r["banks"]) == 2 * LAYERS  # gate_up_proj and down_proj of each layer
        assert r["ep_rank"] == r["rank"] % ep
        for step in r["a2a"]:
            # Per MoE layer: forward counts, tokens, outputs; backward their two reverses.
            phases = [(phase, label.rsplit(" ", 1)[1]) for _, phase, axis, label, _ in step]
            assert len(step) == 5 * LAYERS, step
            assert all(axis == "ep" for _, _, axis, _, _ in step)
            assert phases.count(("forward", "counts")) == LAYERS
            assert phases.count(("backward", "tokens")) == phases.count(("backward", "outputs")) == LAYERS


def check_memory(results, opt):
    """The ledger's expert categories against the formula with N/k (ZeRO's, over the ranks
    that hold the same experts): this rank's banks are bank_numel / k elements; fp32, so the
    parameters and gradients are 4 bytes an element, AdamW's states 8, SGD's momentum 4; at
    stage 3 the parameters are sharded over the N/k ranks, at stages 1-2 held whole; the
    states always sharded. Padding: at most N/k elements per bank storage (2 per layer)."""
    for r in results:
        m = r["memory"]
        local = m["bank_numel"] // 2
        assert m["expert_numel"] == local, m
        n = m["expert_world_size"]
        pad = 4 * LAYERS * n
        states = 8 if opt == "adamw" else 4
        held = local if m["stage"] < 3 else local / n
        assert held * 4 <= m["expert_params"] <= held * 4 + 4 * pad, m
        assert local / n * states <= m["expert_optimizer_states"] <= (local / n + pad) * states, m
        assert m["expert_params"] <= m["params"] and m["expert_optimizer_states"] <= m["optimizer_states"]


GRID = [(name, stage, opt) for name in cases.MODELS for stage in (1, 2, 3) for opt in ("sgd", "adamw")]


@pytest.mark.parametrize("name,stage,opt", GRID)
def test_two_ranks_two_expert_groups(pool, name, stage, opt):
    results = pool.run(2, cases.parity_case, name, stage, opt, 2, timeout_s=TIMEOUT_S)
    check(results, opt, 2)
    check_memory(results, opt)


@pytest.mark.parametrize("stage", [2, 3])
def test_accumulation_over_micro_batches(pool, stage):
    """grad_accumulation_steps=2: each rank's two micro-batches, against the reference's
    mean over every rank's two (the same SGD bound: the same terms, summed in another order)."""
    results = pool.run(2, cases.parity_case, "mixtral", stage, "sgd", 2, 2, timeout_s=TIMEOUT_S)
    for r in results:
        assert len(r["a2a"][0]) == 2 * 5 * LAYERS  # every micro-batch's exchanges
    check([{**r, "a2a": []} for r in results], "sgd", 2)


# bf16: the run with expert parallelism against the same run without, both zerodp in bf16.
# They round differently: the experts' outputs are weighted and summed per token in fp32 and
# rounded to bf16 once, where the unsplit module rounds each expert's weighted output to bf16
# and adds them in bf16, and a bank's gradient sums the k ranks' tokens in one matmul instead
# of k. That moves a gradient element by at most K_TERMS u16 sum|terms| (u16 = 2^-9, the 64
# terms of a bank element's sum; tolerances.BF16_TOL counts the N ranks' sums alike), an SGD
# update by lr / (1 - momentum) times that per step, over STEPS steps, and the compared bf16
# parameter by one bf16 ulp (2^-8) more: 0.19. Weak, as a bf16 bound must be (measured 6e-5
# here); the fp32 grid above is the strict check. It still catches rows run by the wrong
# expert or a lost token (the loss and the banks off by O(1)).
BF16_TOL = cases.STEPS * cases.SGD["lr"] / (1 - cases.SGD["momentum"]) * K_TERMS * 2.0**-9 * GRAD_BOUND + 2.0**-8


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_with_and_without_expert_parallelism(pool, stage):
    for r in pool.run(2, cases.bf16_case, "qwen3_moe", stage, timeout_s=TIMEOUT_S):
        diffs = [abs(a - b) / (1 + abs(b)) for a, b in zip(r["losses"], r["plain_losses"])]
        assert max(diffs) <= BF16_TOL, (r["losses"], r["plain_losses"])
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= BF16_TOL, (worst, r["errors"][worst])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_four_ranks_two_expert_groups_of_two(pool, stage):
    """N=4, EP=2: each bank's experts on 2 ranks, each expert's rows sharded over 2."""
    results = pool.run(4, cases.parity_case, "qwen3_moe", stage, "sgd", 2, timeout_s=TIMEOUT_S)
    check(results, "sgd", 2)
    check_memory(results, "sgd")
    assert all(r["memory"]["expert_world_size"] == 2 for r in results)


@pytest.mark.parametrize("stage", [1, 3])
def test_four_ranks_one_expert_each(pool, stage):
    """N=4, EP=4: one expert of each bank per rank, nothing to shard it over (N/k = 1)."""
    results = pool.run(4, cases.parity_case, "qwen3_moe", stage, "sgd", 4, timeout_s=TIMEOUT_S)
    check(results, "sgd", 4)
    assert all(r["memory"]["expert_world_size"] == 1 for r in results)


def test_refusals_name_the_reason(pool):
    results = pool.run(2, cases.refusal_case, timeout_s=TIMEOUT_S)
    for r in results:
        assert "has no expert-parallel plan" in r["no plan"], r
        assert "3 experts do not split into Config.expert_parallel_size=2" in r["indivisible"], r
        assert "matches no module" in r["unmatched"], r


@pytest.mark.parametrize("fields,name,words", [
    ({"stage": 0}, "stage", "use stage 1, 2 or 3"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size", "tensor and expert parallelism"),
    ({"replicate_size": 2}, "replicate_size", "hybrid sharding"),
    ({"offload_optimizer": "host"}, "offload_optimizer", "offloaded step"),
    ({"compile_units": True}, "compile_units", "compiled unit"),
    ({"stage": 3, "hpz": True}, "hpz", "node axes"),
    ({"expert_parallel_size": 0}, "expert_parallel_size", "positive integer"),
])
def test_what_does_not_compose_is_refused_at_construction(fields, name, words):
    import zerodp

    with pytest.raises(zerodp.ConfigError, match=f"Config.{name}=.*{words}"):
        zerodp.Config(**{"expert_parallel_size": 2, **fields})


def test_checkpoint_across_expert_parallel_layouts(pool, tmp_path):
    """Saved at N=4, EP=2 (stage 3); loaded at N=2, EP=2 (stage 1) and in one process without
    expert parallelism (stage 1), and consolidated there: every layout holds the reference's
    parameters, the banks by their global coordinates, and reaches the saver's next loss (the
    optimizer's momentum restored)."""
    path = str(tmp_path / "ckpt")
    saved = pool.run(4, cases.save_case, "mixtral", 3, 2, path, timeout_s=TIMEOUT_S)
    loads = [(2, pool.run(2, cases.load_case, "mixtral", 1, 2, path, timeout_s=TIMEOUT_S)),
             (1, [cases.load_case(0, 1, "mixtral", 1, 1, path)])]
    for world, results in loads:
        for r in results:
            worst = max(r["errors"], key=r["errors"].get)
            assert r["errors"][worst] <= SGD_TOL, (world, worst, r["errors"][worst])
            assert abs(r["next_loss"] - saved[0]["next_loss"]) / (1 + abs(saved[0]["next_loss"])) <= SGD_TOL, \
                (world, r["next_loss"], saved[0]["next_loss"])
    for r in saved:  # zerodp.full_state_dict: every bank whole, gathered over its group
        assert r["full_shapes"] and max(r["full_state"].values()) <= SGD_TOL, max(r["full_state"].values())
        assert r["own_vs_full"] == 0, r["own_vs_full"]  # model.state_dict()'s DTensors: the same values
    one = loads[1][1][0]
    assert one["consolidated_shapes"]
    assert max(one["consolidated"].values()) <= SGD_TOL
    assert max(one["from_pretrained"].values()) <= SGD_TOL  # zerodp.save_pretrained's banks whole


def test_torch_dcp_state_dicts_across_expert_parallel_layouts(pool, tmp_path):
    """`get_state_dict` at N=4, EP=2 (stage 3) saved through torch.distributed.checkpoint: each
    bank a DTensor of the whole bank on the ("ep", "shard") mesh, cut by expert, then into
    rows; loaded by DCP at N=2 EP=2 (stages 1 and 3: a ("ep",) mesh) and by a plain torch
    model and SGD in one process: every parameter the reference's, the next two losses the
    saver's (the second moved by the momentum the optimizer state dict restored)."""
    path = str(tmp_path / "dcp")
    saved = pool.run(4, cases.dcp_save_case, 3, 2, path, timeout_s=TIMEOUT_S)
    for r in saved:
        for name, (dims, placements, shape, local) in r["layout"].items():
            assert dims == ("ep", "shard") and placements == "(Shard(dim=0), Shard(dim=0))", (name, dims, placements)
            assert shape[0] == cases.EXPERTS and local[0] == cases.EXPERTS // 4, (name, shape, local)
        assert max(r["whole"].values()) == 0, r["whole"]
    loads = [("N=2 EP=2 stage 1", pool.run(2, cases.dcp_load_case, 1, 2, path, timeout_s=TIMEOUT_S)),
             ("N=2 EP=2 stage 3", pool.run(2, cases.dcp_load_case, 3, 2, path, timeout_s=TIMEOUT_S)),
             ("one process, torch only", [cases.dcp_load_case(0, 1, 1, 0, path)])]
    want = saved[0]["next"]
    for layout, results in loads:
        for r in results:
            worst = max(r["errors"], key=r["errors"].get)
            assert r["errors"][worst] <= SGD_TOL, (layout, worst, r["errors"][worst])
            diffs = [abs(a - b) / (1 + abs(b)) for a, b in zip(r["next"], want)]
            assert max(diffs) <= SGD_TOL, (layout, r["next"], want)


def test_estimate_of_an_moe_model_against_the_formula():
    """docs/moe.md's table: without EP the model's ZeRO formula; with it, the experts' fΨ/k by
    the formula over N/k ranks; at stage 3 the same total (the states are divided by N either
    way), at stage 1 the experts' parameters and gradients divided by k."""
    from zerodp.memory import estimator as est

    psi, f, n = 8_000_000, 0.75, 8
    for stage in (0, 1, 2, 3):
        plain = est.model_state_bytes(psi, n, stage)
        assert est.moe_state_bytes(psi, n, stage, f, 1)["total"] == pytest.approx(plain)
    assert est.moe_state_bytes(psi, n, 3, f, 4)["total"] == pytest.approx(est.model_state_bytes(psi, n, 3))
    one = est.moe_state_bytes(psi, n, 1, f, 4)
    assert one["experts"] == pytest.approx((2 + 2) * f * psi / 4 + 12 * f * psi / n)
    assert one["dense"] == pytest.approx((2 + 2 + 12 / n) * (1 - f) * psi)
    step = est.moe_step_numel(psi, f, 4, moe_layers=2, tokens=64, top_k=2, hidden=16)
    assert step["experts"] == pytest.approx(3 * f * psi / 4) and step["all_to_all"] == 4 * 2 * 64 * 2 * 16
    with pytest.raises(ValueError, match="ep_size=3 must divide"):
        est.moe_state_bytes(psi, n, 3, f, 3)


def test_gathered_parameters_modify_writes_a_bank_back_over_its_own_ranks(pool):
    for r in pool.run(4, cases.modify_case, 3, timeout_s=TIMEOUT_S):
        for n, v in r["values"].items():
            # The first rank holding this rank's experts is rank ep_rank (groups of 2 consecutive ranks).
            assert v == [float(r["ep_rank"] + 1) if n in r["banks"] else 1.0], (n, v)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_model_of_ones_own_with_idle_experts(pool, stage):
    """Its own expert_parallel_plan, top-1 routing, and the rank holding experts 2-3 receives
    no token: it still runs every exchange (its experts on one zero row), nothing hangs, and
    training equals the reference's."""
    for r in pool.run(2, cases.own_moe_case, stage, timeout_s=TIMEOUT_S):
        if r["ep_rank"] == 1:
            assert r["received"] == [0] * cases.STEPS, r["received"]
        else:
            assert all(n > 0 for n in r["received"]), r["received"]
        diffs = [abs(a - b) / (1 + abs(b)) for a, b in zip(r["losses"], r["ref_losses"])]
        assert max(diffs) <= SGD_TOL, (r["losses"], r["ref_losses"])
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= SGD_TOL, (worst, r["errors"][worst])


@pytest.mark.parametrize("stage", [3])
def test_the_hugging_face_trainer_with_expert_parallelism(pool, tmp_path, stage):
    """zerodp's Trainer (accumulation over 2 micro-batches, clipping computed every step) with
    EP=2 logs DDP's losses and gradient norms (the norm sums every expert element once: each
    is owned by one rank of one expert-data-parallel group). Bound: the SGD grid's, with the
    Trainer's lr 0.5 and no momentum in place of 0.05 and 0.9: the same lr / (1 - momentum)."""
    results = pool.run(2, cases.trainer_case, str(tmp_path), stage, timeout_s=TIMEOUT_S)
    for r in results:
        assert r["ep"]["loss"].keys() == r["ddp"]["loss"].keys() and len(r["ddp"]["loss"]) == 3
        for key in ("loss", "grad_norm"):
            for step, want in r["ddp"][key].items():
                got = r["ep"][key][step]
                assert abs(got - want) / (1 + abs(want)) <= SGD_TOL, (key, step, got, want)
