"""The state_dict protocol: DTensor state dicts that torch.distributed.checkpoint saves and
reshards, full state dicts equal to DDP's, in-memory round trips, save_pretrained, bad input.

Two worlds run once, N=2 then N=4, over one shared directory; the cases are in
state_dict_cases.py.
"""
import pytest
import torch
from checkpoint_cases import max_abs
from tolerances import CKPT_ADAMW_TOL as ADAMW_TOL
from tolerances import CKPT_SGD_TOL as SGD_TOL
from tolerances import BF16_ULP

# Bounds are derived, absolute per element (checkpoint_cases.max_abs); see tolerances.py
# for the derivations of ADAMW_TOL (AdamW, lr <= 3e-3, 3 steps: 2 lr steps = 0.018, weak) and
# SGD_TOL (plain SGD with momentum, the strict check: 1.8e-5). Same model, data and steps here.
# Where the resumed run is the identical computation (same world size, same stage, same
# order) the comparison is exact.
# bf16 at another stage: the AdamW bound plus one bf16 ulp of the compared parameter
# (tolerances.BF16_ULP), since the master is restored exactly but the bf16 weights round.
ADAMW_BF16_TOL = ADAMW_TOL + BF16_ULP


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, pool):
    root = str(tmp_path_factory.mktemp("sd"))
    import state_dict_cases as cases

    return {"w2": pool.run(2, cases.world_two, root, timeout_s=300),
            "w4": pool.run(4, cases.world_four, root, timeout_s=200)}


def test_state_dicts_are_dtensors_where_sharded(worlds):
    d = worlds["w2"][0]["describe"]
    # Stages 0-2 hold the parameters whole: torch's plain tensors; stage 3 DTensors.
    assert set(d[0]["model"].values()) == {"Tensor"} and set(d[1]["model"].values()) == {"Tensor"}
    # Stage 3 shards every parameter, the frozen out_bias too; the buffer stays whole.
    parameters = [k for k in d[3]["model"] if k != "temperature"]
    assert {d[3]["model"][k] for k in parameters} == {"DTensor"}
    assert d[3]["model"]["temperature"] == "Tensor"
    # Each rank holds its rows: wte is 256 x 32, so 128 rows each.
    assert d[3]["rows"]["gpt.transformer.wte.weight"] == (128, 32)
    # Optimizer states: replicated at stage 0, DTensors once sharded; step stays a plain scalar.
    assert d[0]["optim"] == {"exp_avg": "Tensor", "exp_avg_sq": "Tensor", "step": "Tensor"}
    assert d[1]["optim"] == {"exp_avg": "DTensor", "exp_avg_sq": "DTensor", "step": "Tensor"}
    # Keys number the model's parameters in param-group order, as torch's optimizers do.
    for stage in (0, 1, 3):
        groups = d[stage]["groups"]
        assert sum(groups, []) == list(range(sum(map(len, groups))))
        assert d[stage]["optim_keys"] == sum(groups, [])


@pytest.mark.parametrize("tag", ["s3_to_s2", "s1_to_s3", "s2_to_s3_sgd"])
def test_dcp_save_at_two_loads_at_four_at_another_stage(worlds, tag):
    saver = worlds["w2"][0]["dcp"][tag]
    for loader in (w["dcp"][tag] for w in worlds["w4"]):
        # The checkpoint's values exactly ...
        for k, v in saver["at_save"].items():
            assert torch.equal(loader["after_load"][k], v), k
        # ... and training on continues the uninterrupted run (each rank's loss is of its own
        # slice of the global batch, which differs between N=2 and N=4: the parameters compare).
        # N=2 -> N=4 and another stage: a reshard. The SGD case's own continuation carries the
        # momentum buffers through DCP, so SGD_TOL there also catches momentum lost or restored
        # as zeros (lr momentum |m| ~ 1e-3 on the largest element, 50x above); AdamW's gets its
        # weak bound plus the strict SGD continuation from the loaded weights.
        end = max_abs(loader["end"], saver["end"])
        if saver["sgd_end"] is None:
            assert end <= SGD_TOL
        else:
            assert end <= ADAMW_TOL
            assert max_abs(loader["sgd_end"], saver["sgd_end"]) <= SGD_TOL


@pytest.mark.parametrize("tag", ["s3_to_s1", "s2_to_s3_bf16", "s3_to_s3_bf16"])
def test_in_memory_round_trip_equals_uninterrupted(worlds, tag):
    for w in worlds["w2"]:
        case = w["memory"][tag]
        # The first loss comes from the exactly restored weights through the same forward: equal
        # bit for bit. Same stage (s3_to_s3_bf16): the identical computation, so exact to the end.
        assert case["fresh_losses"][0] == case["losses"][0]
        if tag == "s3_to_s3_bf16":
            assert case["fresh_losses"] == case["losses"]
            assert max_abs(case["fresh_end"], case["end"]) == 0.0
        else:  # another stage: AdamW's weak bound (a lost state is caught by masters/steps checks)
            assert max_abs(case["fresh_end"], case["end"]) <= (ADAMW_BF16_TOL if "bf16" in tag else ADAMW_TOL)
    if "bf16" in tag:  # the fp32 master travels in the optimizer's state dict
        assert worlds["w2"][0]["memory"][tag]["master_keys"] == ["master"]
    if tag == "s3_to_s3_bf16":  # same layout: every master element restored bit for bit
        assert all(w["memory"][tag]["masters_equal"] for w in worlds["w2"])
    if tag == "s3_to_s1":
        assert worlds["w2"][0]["memory"][tag]["master_keys"] == []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_full_state_dict_equals_ddp(worlds, stage):
    ref = worlds["w2"][0]["full"]["ref"]
    for source in ("ours", "torch"):
        full = worlds["w2"][0]["full"][stage][source]
        assert list(full) == list(ref)  # the model's own names, in its order, tied ones included
        assert all(full[k].shape == v.shape for k, v in ref.items())
        # AdamW, N=2, against DDP's kernels: the weak AdamW bound (measured 0.0 here); the names,
        # order and shapes above are this test's point, test_core.test_parity_with_ddp's SGD case
        # the strict numeric check.
        assert max_abs(full, ref) <= ADAMW_TOL
    assert worlds["w2"][1]["full"][stage]["ours"] == {}  # rank0_only
    assert worlds["w2"][1]["full"][stage]["all_ranks_keys"] == sorted(ref)
    assert worlds["w2"][0]["full"][stage]["tied_shared"]


def test_bad_state_dicts_raise_and_change_nothing(worlds):
    for w in worlds["w2"]:
        bad = w["bad"]
        assert "gpt.transformer.h.0.mlp.c_fc.weight" in bad["wrong_shape"] and "(3, 3)" in bad["wrong_shape"]
        assert bad["fewer_groups"].startswith("ValueError") and "param groups" in bad["fewer_groups"]
        assert "'exp_avg'" in bad["missing_state"]
        assert bad["not_a_dict"].startswith("ValueError")
        assert bad["into_plain_model"] is not None and "DTensor" in bad["into_plain_model"]
        assert bad["unchanged"]


@pytest.mark.parametrize("case", ["gpt2_s2", "gpt2_s3", "llama_s2", "llama_s3"])
def test_save_pretrained_loads_into_plain_model(worlds, case):
    got = worlds["w2"][0]["pretrained"][case]
    assert "model.safetensors" in got["files"] and "config.json" in got["files"]
    assert got["names"] and got["equal"]
    assert got["tied"] == case.startswith("gpt2")
    if case.endswith("s3"):  # loaded into a model born sharded under zerodp.init: the same model
        assert torch.equal(got["born_logits"], got["plain_logits"])


@pytest.mark.parametrize("tag", ["s3_bf16", "s3_fp16", "s1_bf16", "s3_fp32"])
def test_dcp_round_trip_is_exact_with_awkward_parameters(worlds, tag):
    # A 0-d parameter first in its group, a (1, 5) one at N=2, tied and frozen weights, two
    # param groups per unit; torch's set_state_dict loads the optimizer before the model,
    # and the model's load keeps the exact fp32 master where it still rounds to the weights.
    for w in worlds["w2"]:
        case = w["hard"][tag]
        assert case["masters_exact"]
        assert case["resumed"] == case["straight"]  # same N, same stage: bit for bit
        if tag == "s3_fp16":  # the loss scale, moved off its initial 2**16, travels in the state dict
            assert case["scale"][1] == case["scale"][0] != 2.0**16


def test_dcp_into_stage_1_restores_the_optimizer_states(worlds):
    for w in worlds["w2"]:
        case = w["hard"]["to_stage1"]
        assert case["steps"] == [3.0, 3.0]
        # The first loss is computed from the restored weights (exact) by the same forward at
        # any stage: equal bit for bit. The later ones follow AdamW at another stage (no small
        # derived bound); the restored states are checked by "steps" and the exact-master cases.
        assert case["resumed"][0] == case["straight"][0]


def test_never_stepped_mixed_precision_state_dict_loads(worlds):
    assert all(w["hard"]["never_stepped"] is None for w in worlds["w2"])


def test_scheduler_built_before_initialize_is_refused(worlds):
    err = worlds["w2"][0]["hard"]["scheduler_first"]
    assert err.startswith("ValueError") and "LR scheduler" in err and "initialize returns" in err
