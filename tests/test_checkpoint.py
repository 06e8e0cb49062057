"""Sharded checkpoints: bitwise resume, resharding, atomicity, bad input, consolidation.

Four worlds run once, in order 1 -> 4 -> 2 -> 1, over one shared directory; the cases
are in checkpoint_cases.py.
"""
import itertools
import json
import os

import pytest
import torch
from checkpoint_cases import LM, TRAIN, max_abs
from safetensors.torch import load_file
from tolerances import CKPT_ADAMW_TOL as ADAMW_TOL
from tolerances import CKPT_SGD_TOL as SGD_TOL

import zerodp
from zerodp.demo.models import GPT

@pytest.fixture(scope="module")
def worlds(tmp_path_factory, pool):
    root = str(tmp_path_factory.mktemp("ckpt"))
    import checkpoint_cases as cases

    out = {"root": root}
    out["w1_first"] = pool.run(1, cases.world_one_first, root, timeout_s=120)[0]
    out["w4"] = pool.run(4, cases.world_four, root, timeout_s=200)
    out["w2"] = pool.run(2, cases.world_two, root, timeout_s=300)
    out["w1_last"] = pool.run(1, cases.world_one_last, root, timeout_s=120)[0]
    return out


def _check_resume(saver: dict, loader: dict):
    # Loading reproduces the saved values exactly, whatever the world size or stage ...
    for k, v in saver["at_save"].items():
        assert torch.equal(loader["after_load"][k], v.to(loader["after_load"][k].dtype)), k
    # ... and so does saving again (masters and every optimizer state, element by element).
    assert loader["roundtrip_equal"]
    assert loader["roundtrip_meta_equal"]
    assert loader["extra"] == {"data_position": TRAIN}
    # Training on continues the uninterrupted run: AdamW within its (weak) bound, plain SGD
    # with momentum from the loaded weights within the strict one (see SGD_TOL).
    assert max_abs(loader["end"], saver["end"]) <= ADAMW_TOL
    assert max_abs(loader["sgd_end"], saver["sgd_end"]) <= SGD_TOL


@pytest.mark.parametrize("pair", ["1->4", "4->2", "2->1", "1->4 at stage 3"])
def test_reshard_to_another_world_size(worlds, pair):
    w2 = worlds["w2"][0]
    saver, loaders = {"1->4": (worlds["w1_first"]["r1"], [w["from1"] for w in worlds["w4"]]),
                      "4->2": (worlds["w4"][0]["r4"], [w["from4"] for w in worlds["w2"]]),
                      "2->1": (w2["r2s2"], [worlds["w1_last"]["from2"]]),
                      "1->4 at stage 3": (worlds["w1_first"]["r1s3"], [w["from1s3"] for w in worlds["w4"]])}[pair]
    for loader in loaders:
        _check_resume(saver, loader)


@pytest.mark.parametrize("src,dst", [(1, 2), (2, 1), (0, 2), (2, 0), (2, 3), (3, 2)])
def test_reshard_to_another_stage(worlds, src, dst):
    for rank_result in worlds["w2"]:
        _check_resume(rank_result[f"r2s{src}"], rank_result[f"s{src}_to_s{dst}"])


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_bitwise_resume(worlds, stage, precision):
    for rank, r in enumerate(worlds["w2"]):
        res = r[("bitwise", stage, precision)]
        assert res["losses"] == res["resumed_losses"], rank
        assert res["diffs"] == [], (rank, res["diffs"])  # params, master, states, step, scaler, lr, RNG
        assert res["data_position"] == TRAIN
    if precision == "fp16":  # the dynamic scale grew (interval 2) so the scaler state mattered
        assert worlds["w2"][0][("bitwise", stage, precision)]["scale"] > 1024.0


def _assert_pieces_cover_once(path, world_size):
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    # Every parameter's pieces cover it exactly once, across the rank files.
    for name, info in meta["params"].items():
        covered = sorted((start, start + n) for _, start, n in info["pieces"])
        assert covered[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(covered)), name
        assert covered[-1][1] == torch.Size(info["shape"]).numel(), name
    assert {r for info in meta["params"].values() for r, _, _ in info["pieces"]} == set(range(world_size))
    # Each element is written once in total: the rank files hold no parameter twice.
    ranks = [load_file(os.path.join(path, f"rank{r}.safetensors")) for r in range(world_size)]
    numel = sum(t.numel() for f in ranks for k, t in f.items() if k.startswith("master/"))
    assert numel == sum(torch.Size(i["shape"]).numel() for i in meta["params"].values())
    return meta


def test_checkpoint_layout(worlds):
    path = worlds["w2"][0]["r2s2"]["path"]
    assert sorted(os.listdir(path)) == ["COMPLETE", "metadata.json", "rank0.json", "rank0.safetensors",
                                        "rank1.json", "rank1.safetensors", "replicated.safetensors"]
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    assert meta["world_size"] == 2 and meta["stage"] == 2 and meta["compute_dtype"] == "float32"
    assert meta["zerodp_version"] == zerodp.__version__
    wte = meta["params"]["gpt.transformer.wte.weight"]
    assert wte["shape"] == [256, 32]
    _assert_pieces_cover_once(path, 2)
    assert ["gpt.lm_head.weight", "param", "gpt.transformer.wte.weight"] in meta["state_dict_keys"]
    assert set(meta["replicated"]) == {"out_bias", "temperature"}
    # Stage 0 replicates the optimizer: rank 0 alone writes it.
    s0 = worlds["w2"][0]["r2s0"]["path"]
    assert len(load_file(os.path.join(s0, "rank1.safetensors"))) == 0
    # Stage 3 (parameters sharded per unit) writes the same format: full shapes, the
    # model's state_dict names, every element once.
    s3 = _assert_pieces_cover_once(worlds["w2"][0]["r2s3"]["path"], 2)
    assert s3["stage"] == 3
    assert {k: v["shape"] for k, v in s3["params"].items()} == {k: v["shape"] for k, v in meta["params"].items()}
    # The frozen parameter is sharded at stage 3: each rank writes its run of it, once in all.
    assert s3["replicated"] == {"temperature": meta["replicated"]["temperature"]}
    assert s3["frozen"] == {"out_bias": {**meta["replicated"]["out_bias"], "pieces": [[0, 0, 128], [1, 128, 128]]}}
    frozen_numel = sum(t.numel() for r in range(2) for k, t in
                       load_file(os.path.join(worlds["w2"][0]["r2s3"]["path"], f"rank{r}.safetensors")).items()
                       if k.startswith("frozen/"))
    assert frozen_numel == 256
    assert s3["state_dict_keys"] == [[k, "frozen" if k == "out_bias" else kind, src]
                                     for k, kind, src in meta["state_dict_keys"]]


@pytest.mark.parametrize("stage", [2, 3])
def test_consolidate_lm_into_plain_model(worlds, stage):
    # The wrapped LM (tied weights, frozen parameter, buffer), fp32, saved at stage 2 or 3.
    r = worlds["w2"][0][f"r2s{stage}"]
    sd = zerodp.consolidate(r["path"])
    plain = LM()
    plain.load_state_dict(sd, strict=True)
    assert list(sd) == list(plain.state_dict())
    for k, v in r["at_save"].items():
        assert sd[k].shape == v.shape and torch.equal(sd[k], v), k
    assert plain.gpt.lm_head.weight is plain.gpt.transformer.wte.weight


def test_consolidate_into_plain_model(worlds):
    w2 = worlds["w2"][0]
    # GPT('tiny') trained in bf16: fp32 masters by default, the bf16 weights with dtype="compute".
    g = w2["pretrained"]["gpt_bf16"]
    gpt = GPT("tiny")
    gpt.load_state_dict(zerodp.consolidate(g["path"]), strict=True)
    assert "lm_head.weight" in zerodp.consolidate(g["path"])
    compute = zerodp.consolidate(g["path"], dtype="compute")
    for k, v in g["state"].items():
        assert compute[k].dtype == torch.bfloat16 and torch.equal(compute[k], v), k
    masters = zerodp.consolidate(g["path"])
    for rank_result in worlds["w2"]:
        for (name, start), m in rank_result["pretrained"]["gpt_bf16"]["master"].items():
            assert torch.equal(masters[name].reshape(-1)[start: start + m.numel()], m), name


def test_export_file_loads_strict(worlds, tmp_path):
    path = worlds["w2"][0]["pretrained"]["gpt_bf16"]["path"]
    out = zerodp.export(path, tmp_path / "gpt.safetensors")
    gpt = GPT("tiny")
    gpt.load_state_dict(load_file(out), strict=True)
    sd = zerodp.consolidate(path)
    assert all(torch.equal(v, sd[k]) for k, v in gpt.state_dict().items())


def test_load_pretrained(worlds):
    for rank_result in worlds["w2"]:
        for tag in ("dict_s1_bf16", "file_s2_fp32", "dict_s3_bf16"):
            r = rank_result["pretrained"][tag]
            assert r["equal"] and r["master_equal"] and r["keys"], tag
            assert r["trains"] > 0


def test_crash_during_save_keeps_previous(worlds):
    for rank, r in enumerate(worlds["w2"]):
        c = r["crash"]
        # Every rank raises, naming the rank and the cause; nobody hangs.
        assert "rank 1" in c["rank1_fails"] and "No space left" in c["rank1_fails"], c["rank1_fails"]
        assert c["rank1_fails"].startswith("CheckpointError")
        assert "No space left on device" in c["rank0_fails"], c["rank0_fails"]
        assert "No space left on device" in c["rank0_fails_overwrite"], c["rank0_fails_overwrite"]
        # The half-written checkpoint is gone; latest() is still the previous one.
        assert c["after_rank1_fails"]["latest"] == c["good_path"]
        assert c["after_rank1_fails"]["listing"] == ["step3"]
        # A commit that fails writing COMPLETE leaves nothing behind, and the checkpoint it
        # was to replace is still there, complete and the newest.
        assert c["after_rank0_fails"]["latest"] == c["good_path"]
        assert c["after_rank0_fails"]["listing"] == ["step3"]
        assert "does not exist" in c["load_incomplete"]
        assert c["reloaded_diffs"] == [], (rank, c["reloaded_diffs"])


def test_latest_ignores_unfinished(tmp_path):
    assert zerodp.latest(tmp_path) is None
    assert zerodp.latest(tmp_path / "absent") is None
    # (name, step, completed at, has COMPLETE): the newest complete one is the one completed
    # last ([Note: checkpoint order]), whatever its step; unfinished saves and markers that
    # are not zerodp's never count.
    for name, step, done, complete in (("step10", 10, 100.0, True), ("step30", 30, 400.0, False),
                                       ("step40.tmp-0123456789ab", 40, 500.0, True), ("step20", 20, 300.0, True),
                                       ("step50", 50, 200.0, True), ("foreign", 60, 600.0, "{}")):
        d = tmp_path / name
        d.mkdir()
        (d / "metadata.json").write_text(f'{{"step": {step}}}')
        if complete:
            marker = {"format": "zerodp-checkpoint", "files": {}, "completed": done}
            (d / "COMPLETE").write_text(complete if isinstance(complete, str) else json.dumps(marker))
    assert zerodp.latest(tmp_path) == str(tmp_path / "step20")


BAD = {
    "missing_shard": ["rank1.safetensors is missing"],
    "truncated_shard": ["rank0.safetensors has", "truncated"],
    "corrupt_shard": ["rank1.safetensors is corrupt", "sha256"],
    "incomplete": ["incomplete", "no COMPLETE marker"],
    "not_a_checkpoint": ["is not a zerodp checkpoint"],
    "a_file": ["is not a checkpoint", "file"],
    "nonexistent": ["does not exist"],
    "other_model": ["does not match the model", "missing", "gpt.transformer.h.1.attn.c_attn.weight",
                    "shape differs", "gpt.transformer.wte.weight (256, 16) vs model (256, 32)"],
    "other_optimizer": ["holds SGD state", "AdamW"],
    "pretrained_missing": ["missing (1): gpt.transformer.ln_f.weight"],
    "pretrained_shape": ["shape differs", "gpt.transformer.wpe.weight (3, 3) vs model (32, 32)"],
    "pretrained_unexpected": ["not in the model (1): extra_head"],
    "pretrained_no_file": ["do not exist"],
}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_raises_and_changes_nothing(worlds, case, stage):
    for rank, r in enumerate(worlds["w2"]):
        res = r["bad"][stage][case]
        assert res["error"] is not None and res["error"].startswith("CheckpointError"), (rank, res)
        for fragment in BAD[case]:
            assert fragment in res["error"], (rank, fragment, res["error"])
        assert res["changed"] == [], (rank, res["changed"])


@pytest.mark.parametrize("stage", [2, 3])
def test_good_checkpoint_loads_after_bad_ones(worlds, stage):
    assert all(r["bad"][stage]["good_loads"] is None for r in worlds["w2"])


def test_two_jobs_saving_to_one_path(tmp_path):
    """Two jobs save to the same path at once: every save succeeds, the last one wins whole,
    and no displaced or temporary directory is left behind."""
    import multiprocessing as mp

    from checkpoint_cases import save_repeatedly

    path = str(tmp_path / "ckpt")
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(save_repeatedly, [(path, 25, 0), (path, 25, 1)], chunksize=1)
    assert results == [[], []], results
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert zerodp.latest(tmp_path) == path
    import torch.nn as nn

    model, opt = zerodp.initialize(nn.Linear(8, 8), torch.optim.AdamW, zerodp.Config(stage=2), lr=1e-3)
    zerodp.load(path, model, opt)  # complete and consistent


def test_overwriting_a_checkpoint_never_hides_it(tmp_path):
    """While a job overwrites its checkpoint again and again, a reader always finds one:
    the new directory is swapped in atomically (renameat2 RENAME_EXCHANGE on Linux)."""
    import multiprocessing as mp

    from checkpoint_cases import save_repeatedly

    path = str(tmp_path / "ckpt")
    assert save_repeatedly(path, 1, 0) == []
    seen_missing = 0
    with mp.get_context("spawn").Pool(1) as pool:
        job = pool.apply_async(save_repeatedly, (path, 30, 0))
        while not job.ready():
            seen_missing += zerodp.latest(tmp_path) is None
        assert job.get() == []
    assert seen_missing == 0
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
