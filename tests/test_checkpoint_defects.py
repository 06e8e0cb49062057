"""Checkpoints that saved but did not load, tampered ones that loaded, and inputs that made
save, load, latest() and keep_last fail with a raw Python error:

- optimizer states that differ by parameter: the Muon + AdamW recipe, SGD with momentum in
  one group only, AdamW with amsgrad in one group only (metadata's per-parameter "states");
- tensor-parallel checkpoints whose metadata changed a split or pointed a piece at another
  tensor-parallel rank's file (rank{r}.json's record, [Note: tensor-parallel pieces]);
- JSON nested too deeply for Python's decoder, in a marker, the metadata or an OWNER;
- a checkpoint pruned by keep_last while latest(), load or consolidate reads it;
- a checkpoint path that is not UTF-8;
- ranks that call save with different keep_last or asynchronous.

Multi-rank cases: checkpoint_defects_cases.py.
"""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from checkpoint_cases import diffs, error_of, full_state, snapshot
from checkpoint_defects_cases import (DEEP, OPTIMIZERS, TAMPERS, disagreeing_arguments_case, gpt, muon_recipe,
                                      muon_recipe_case, mixed_states_case, saved_arrays, tampered_tp_case,
                                      tidying_beside_malformed_json_case)
from checkpoint_integrity_cases import rehash, trained
from compat_model import TiedNet, loss_at

import zerodp
from zerodp.checkpoint import CheckpointError, InvalidCheckpoint
from zerodp.checkpoint import reader as ckpt_reader
from zerodp.checkpoint import sharded as ckpt_sharded


def assert_same_arrays(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert torch.equal(v, b[k]), k


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k


# == 1: the Muon + AdamW recipe ====================================================================
@pytest.fixture(scope="module")
def muon_runs(pool, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("muon_recipe"))
    return pool.run(2, muon_recipe_case, root, 2, (2, 3), timeout_s=120)


def test_muon_recipe_loads_exactly_at_the_same_layout(muon_runs):
    saved = saved_arrays(muon_runs[0]["path"])
    # Muon's momentum beside AdamW's moments: the states really differ by parameter.
    assert ("state/momentum_buffer", "transformer.h.1.mlp.c_proj.weight") in saved
    assert ("state/exp_avg", "transformer.h.1.mlp.c_proj.weight") not in saved
    assert ("state/exp_avg", "transformer.wte.weight") in saved
    for r in muon_runs:
        assert_same_state(r["loads"][2]["loaded"], r["at_save"])
        assert_same_state(r["loads"][2]["continued"], r["uninterrupted"])  # bitwise resume
    assert_same_arrays(saved_arrays(muon_runs[0]["loads"][2]["resaved"]), saved)


def test_muon_recipe_loads_exactly_at_another_stage_and_world_size(muon_runs):
    saved = saved_arrays(muon_runs[0]["path"])
    for r in muon_runs:  # N = 2, stage 3
        assert_same_state(r["loads"][3]["loaded"], r["at_save"])
    assert_same_arrays(saved_arrays(muon_runs[0]["loads"][3]["resaved"]), saved)
    # N = 1, stage 1, in this process.
    torch.manual_seed(1)
    model = gpt()
    model, opt = zerodp.initialize(model, muon_recipe(model), zerodp.Config(stage=1))
    zerodp.load(muon_runs[0]["path"], model, opt)
    assert_same_state(full_state(model), muon_runs[0]["at_save"])
    resaved = zerodp.save(os.path.join(os.path.dirname(muon_runs[0]["path"]), "resaved_n1"), model, opt)
    assert_same_arrays(saved_arrays(resaved), saved)


# == 2: param groups whose states differ ===========================================================
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_param_groups_with_different_states_resume_exactly(pool, tmp_path, opt_name, stage):
    results = pool.run(2, mixed_states_case, str(tmp_path), opt_name, stage, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["error"])
        assert_same_state(r["resumed"], r["uninterrupted"])
    saved = saved_arrays(results[0]["path"])
    if opt_name == "sgd_mixed":
        assert ("state/momentum_buffer", "hidden.weight") in saved
        assert ("state/momentum_buffer", "norm.weight") not in saved
    else:
        assert ("state/max_exp_avg_sq", "hidden.weight") in saved
        assert ("state/max_exp_avg_sq", "norm.weight") not in saved and ("state/exp_avg", "norm.weight") in saved


def test_states_a_parameter_lacks_are_refused_before_anything_changes(tmp_path):
    """Per-parameter states still have to match where the optimizer has its own: a
    checkpoint of AdamW with amsgrad in one group, into one that stepped without amsgrad,
    is refused, naming a parameter and the states, and nothing changes."""
    torch.manual_seed(0)
    model = TiedNet()
    model, opt = zerodp.initialize(model, OPTIMIZERS["adamw_amsgrad_one_group"](model), zerodp.Config(stage=1))
    opt.backward(loss_at(model, 0))
    opt.step()
    path = zerodp.save(tmp_path / "ams", model, opt)
    other = TiedNet()
    groups = OPTIMIZERS["adamw_amsgrad_one_group"](other).param_groups
    for g in groups:
        g["amsgrad"] = False
    other, other_opt = zerodp.initialize(other, torch.optim.AdamW(groups, lr=1e-2), zerodp.Config(stage=1))
    other_opt.backward(loss_at(other, 0))
    other_opt.step()
    before = snapshot(other, other_opt)
    err = error_of(lambda: zerodp.load(path, other, other_opt))
    assert err is not None and "max_exp_avg_sq" in err and "embed.weight" in err, err
    assert diffs(before, snapshot(other, other_opt)) == []


# == 3: tampered tensor-parallel checkpoints =======================================================
@pytest.fixture(scope="module")
def tampered(pool, tmp_path_factory):
    return pool.run(2, tampered_tp_case, str(tmp_path_factory.mktemp("tampered_tp")), 1, timeout_s=120)


@pytest.mark.parametrize("case", list(TAMPERS))
def test_a_tampered_tensor_parallel_checkpoint_is_refused_on_every_rank(tampered, case):
    fragment = {"split_parts_changed": "rank0.json records", "piece_at_another_rank": "rank1.safetensors"}[case]
    for rank, r in enumerate(tampered):
        res = r[case]
        err = res["error"]
        assert err is not None, (rank, case, "loaded")
        assert "fc.weight" in err and fragment in err and "metadata.json" in err, (rank, err)
        assert res["changed"] == [], (rank, res["changed"])
        assert r["good"] is None, (rank, r["good"])
    err = error_of(lambda: zerodp.consolidate(tampered[0][case]["path"]))
    assert err is not None and err.startswith("InvalidCheckpoint") and "fc.weight" in err and fragment in err, err


# == 4: JSON nested too deeply =====================================================================
def test_latest_skips_a_deeply_nested_marker_with_a_warning(tmp_path, caplog):
    model, opt = trained(0, 1)
    good = zerodp.save(tmp_path / "step_1", model, opt)
    planted = tmp_path / "step_9"
    planted.mkdir()
    (planted / "COMPLETE").write_text(DEEP)
    with caplog.at_level(logging.WARNING, logger="zerodp"):
        assert zerodp.latest(tmp_path) == good
    assert any(str(planted) in rec.getMessage() and "COMPLETE" in rec.getMessage() for rec in caplog.records), \
        [rec.getMessage() for rec in caplog.records]
    # load names the file instead of raising RecursionError
    err = error_of(lambda: zerodp.load(planted, model, opt))
    assert err is not None and err.startswith("CheckpointError") and "COMPLETE" in err, err
    assert "RecursionError" not in err


@pytest.mark.parametrize("name", ["COMPLETE", "metadata.json", "rank0.json"])
def test_a_deeply_nested_file_is_a_clear_error_of_load_and_consolidate(tmp_path, name):
    model, opt = trained(0, 1)
    path = zerodp.save(tmp_path / "ckpt", model, opt)
    with open(os.path.join(path, name), "w") as f:
        f.write(DEEP)
    if name != "COMPLETE":
        rehash(path, name)
    before = snapshot(model, opt)
    err = error_of(lambda: zerodp.load(path, model, opt))
    assert err is not None and name in err and "RecursionError" not in err, err
    assert diffs(before, snapshot(model, opt)) == []
    if name != "rank0.json":  # consolidate reads no RNG states
        err = error_of(lambda: zerodp.consolidate(path))
        assert err is not None and err.startswith("InvalidCheckpoint") and name in err, err


def test_keep_last_beside_a_deeply_nested_marker_or_owner_fails_no_rank(pool, tmp_path):
    for rank, r in enumerate(pool.run(2, tidying_beside_malformed_json_case, str(tmp_path), timeout_s=120)):
        assert r["keep_last"] is None, (rank, r["keep_last"])
        assert r["stale_owner"] is None, (rank, r["stale_owner"])
        assert r["after_keep_last"] == ["planted", "step_1"], (rank, r["after_keep_last"])
        # A leftover whose writer cannot be told is judged by its age: a fresh one stays.
        assert r["after_stale_owner"] == ["planted", "step_1", "step_1.tmp-0123456789ab", "step_2"], \
            (rank, r["after_stale_owner"])
    assert zerodp.latest(tmp_path) == str(tmp_path / "step_2")


# == 5: pruned while being read ====================================================================
def prune_now(path: str) -> None:
    """What keep_last does to a checkpoint (retention.prune): renamed aside, then removed."""
    aside = f"{path}.old-0123456789ab"
    os.rename(path, aside)
    shutil.rmtree(aside)


def test_latest_skips_a_checkpoint_pruned_after_the_listing(tmp_path, monkeypatch):
    model, opt = trained(0, 1)
    older = zerodp.save(tmp_path / "a", model, opt)
    newer = zerodp.save(tmp_path / "b", model, opt)
    listing = ckpt_sharded.by_completion

    def listed_then_pruned(directory):
        found = listing(directory)
        prune_now(found[0])
        return found

    monkeypatch.setattr(ckpt_sharded, "by_completion", listed_then_pruned)
    assert zerodp.latest(tmp_path) == older
    assert not os.path.exists(newer)


@pytest.mark.parametrize("file", ["metadata.json", "rank0.safetensors", "rank0.json"])
def test_a_checkpoint_pruned_while_read_is_a_clear_error(tmp_path, monkeypatch, file):
    model, opt = trained(0, 1)
    digest = ckpt_reader.digest

    def pruned_first(name):
        if os.path.basename(name) == file and os.path.exists(name):
            prune_now(os.path.dirname(name))
        return digest(name)

    monkeypatch.setattr(ckpt_reader, "digest", pruned_first)
    calls = [lambda p: zerodp.load(p, model, opt)]
    if file != "rank0.json":
        calls.append(zerodp.consolidate)
    for call in calls:
        path = zerodp.save(tmp_path / "ckpt", model, opt)
        before = snapshot(model, opt)
        err = error_of(lambda path=path: call(path))
        assert err is not None and err.startswith("CheckpointError"), err
        assert f"checkpoint {path} was removed while being read (keep_last pruning?)" in err, err
        assert diffs(before, snapshot(model, opt)) == []


# == 6: a checkpoint path that is not UTF-8 =========================================================
@pytest.mark.parametrize("form", ["str", "bytes"])
def test_a_path_that_is_not_utf8_is_refused_before_anything_is_written(tmp_path, form):
    model, opt = trained(0, 1)
    raw = os.path.join(os.fsencode(tmp_path), b"ckpt\xff")
    path = raw if form == "bytes" else os.fsdecode(raw)
    err = error_of(lambda: zerodp.save(path, model, opt))
    assert err is not None and err.startswith("CheckpointError") and "not valid UTF-8" in err, err
    assert repr(os.fsdecode(raw)) in err, err
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_renamed_to_a_name_that_is_not_utf8_is_a_clear_error(tmp_path):
    model, opt = trained(0, 1)
    good = zerodp.save(tmp_path / "ckpt", model, opt)
    renamed = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"ckpt\xff"))
    os.rename(good, renamed)
    for fn in (lambda: zerodp.load(renamed, model, opt), lambda: zerodp.consolidate(renamed)):
        err = error_of(fn)
        assert err is not None and "not valid UTF-8" in err and repr(renamed) in err, err


# == the save's arguments agree across ranks =======================================================
def test_ranks_that_disagree_on_save_arguments_all_get_a_clear_error(pool, tmp_path):
    for rank, r in enumerate(pool.run(2, disagreeing_arguments_case, str(tmp_path), timeout_s=90)):
        for arg, values in (("keep_last", "2 vs 3"), ("asynchronous", "True vs False")):
            err = r[arg]
            assert err is not None and err.startswith("CheckpointError"), (rank, arg, err)
            assert f"argument {arg} (rank 0 vs rank 1: {values})" in err, (rank, arg, err)
        assert r["listing"] == [], (rank, r["listing"])  # nothing was written
        assert r["agreeing"] is None, (rank, r["agreeing"])
