"""A checkpoint is trusted only for what the format writes (issue 22, items 15, 16, 18, 19, 26).

- `save` never deletes what it did not write (15);
- `latest` and `keep_last` order checkpoints the same way, by completion (16);
- loading opens no file outside the checkpoint's real directory, and no name the format
  does not write (18);
- a checkpoint that fails validation changes nothing, and nothing is touched before every
  value was checked (types, finiteness, shapes against the model, sizes) (19);
- under tensor parallelism the refusal recommends only what works (26).

Tampered checkpoints are built by hand from one good checkpoint of a tiny model, world 1 in
this process; one world of 2 ranks checks that each refusal happens on every rank.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time

import pytest
import torch
from checkpoint_cases import diffs, error_of, snapshot
from checkpoint_integrity_cases import edit_json, forged_digest, rehash, trained, two_ranks
from compat_model import loss_at
from safetensors.torch import load_file, save_file

import zerodp
from zerodp.checkpoint import CheckpointError

# -- no file outside the checkpoint is opened ---------------------------------------------------
# Python's audit hook sees every open() and os.open() of this process (safetensors opens its
# files from Rust, unseen: those cases are caught by the outside file's content instead).
_OPENED: list = []
_RECORDING = [False]


def _audit(event, args):
    if _RECORDING[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)


def opened_outside(fn, inside: str) -> list:
    """Files outside `inside` that `fn()` opened (its exception is swallowed: error_of)."""
    inside = os.path.realpath(inside)
    _OPENED.clear()
    _RECORDING[0] = True
    try:
        error_of(fn)
    finally:
        _RECORDING[0] = False
    return [f for f in _OPENED if os.path.commonpath([f, inside]) != inside and "site-packages" not in f
            and not f.startswith(sys.prefix) and not f.startswith(sys.base_prefix)]


# -- the model and a good checkpoint --------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory) -> str:
    model, opt = trained(0, 2)
    return zerodp.save(tmp_path_factory.mktemp("good") / "step_2", model, opt, note="good")


@pytest.fixture
def victim():
    """Another run (other weights, one step: optimizer states exist) that a refused load must leave as it is."""
    return trained(1, 1)


def copy_of(good: str, tmp_path) -> str:
    dst = str(tmp_path / "ckpt" / "step_2")
    shutil.copytree(good, dst)
    return dst


def refused(path: str, model, opt) -> str:
    """The error of loading `path`, after checking that the load changed nothing."""
    before = snapshot(model, opt)
    err = error_of(lambda: zerodp.load(path, model, opt))
    assert err is not None, "the tampered checkpoint loaded"
    assert err.startswith("InvalidCheckpoint") or err.startswith("CheckpointError"), err
    assert diffs(before, snapshot(model, opt)) == [], (err, diffs(before, snapshot(model, opt)))
    return err


# == 18: nothing outside the checkpoint, no name the format did not write ===========================
def outside_secret(tmp_path) -> str:
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir(exist_ok=True)
    secret.write_text("s3cr3t!" * 111)  # 777 bytes: a size the error must not report
    return str(secret)


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_complete_naming_a_file_outside_is_refused_unopened(good, victim, tmp_path, how):
    ckpt = copy_of(good, tmp_path)
    secret = outside_secret(tmp_path)
    name = os.path.relpath(secret, ckpt) if how == "relative" else secret
    with open(os.path.join(ckpt, "COMPLETE")) as f:
        complete = json.load(f)
    complete["files"][name] = {"size": 1, "sha256": "0" * 64}
    with open(os.path.join(ckpt, "COMPLETE"), "w") as f:
        json.dump(complete, f)
    err = refused(ckpt, *victim)
    assert "777 bytes" not in err, err  # not even the outside file's size comes back
    assert repr(name) in err and "not a file a zerodp checkpoint has" in err, err
    for fn in (lambda: zerodp.load(ckpt, *victim), lambda: zerodp.consolidate(ckpt)):
        assert opened_outside(fn, ckpt) == []
    assert "not a file a zerodp checkpoint has" in error_of(lambda: zerodp.consolidate(ckpt))


def evil_twin(ckpt: str, file: str) -> str:
    """An outside safetensors file with every tensor of rank0.safetensors set to 1234."""
    tensors = {k: torch.full_like(v, 1234.0) for k, v in load_file(os.path.join(ckpt, "rank0.safetensors")).items()}
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def test_a_piece_naming_a_rank_outside_is_refused(good, victim, tmp_path):
    ckpt = copy_of(good, tmp_path)
    (tmp_path / "outside").mkdir()
    evil = evil_twin(ckpt, str(tmp_path / "outside" / "evil.safetensors"))
    os.mkdir(os.path.join(ckpt, "rank.."))  # the first component, "rank..", must exist to be walked through
    rank = "../../" + os.path.relpath(evil, ckpt).removesuffix(".safetensors")
    listed = f"rank{rank}.safetensors"
    assert os.path.realpath(os.path.join(ckpt, listed)) == os.path.realpath(evil)

    def retarget(meta):
        for info in meta["params"].values():
            info["pieces"] = [[rank, start, numel] for _, start, numel in info["pieces"]]
    edit_json(ckpt, "metadata.json", retarget)
    err = refused(ckpt, *victim)  # the piece alone: its rank is not a rank
    assert "pieces" in err and repr(rank) in err, err
    with open(os.path.join(ckpt, "COMPLETE")) as f:
        complete = json.load(f)
    complete["files"][listed] = forged_digest(evil)  # and the forger lists the outside file too
    with open(os.path.join(ckpt, "COMPLETE"), "w") as f:
        json.dump(complete, f)
    err = refused(ckpt, *victim)  # today: loads 1234 everywhere, no error
    assert repr(listed) in err, err
    err = error_of(lambda: zerodp.consolidate(ckpt))
    assert err is not None and err.startswith("InvalidCheckpoint"), err


@pytest.mark.parametrize("link", ["rank0.safetensors", "metadata.json", "COMPLETE", "rank0.json",
                                  "replicated.safetensors"])
def test_a_file_that_is_a_link_to_outside_is_not_followed(good, victim, tmp_path, link):
    ckpt = copy_of(good, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = str(outside / link)
    if link == "rank0.safetensors":
        evil_twin(ckpt, target)  # content a followed link would load
    else:
        shutil.copyfile(os.path.join(ckpt, link), target)  # the same bytes: only the link is wrong
    os.remove(os.path.join(ckpt, link))
    os.symlink(target, os.path.join(ckpt, link))
    if link != "COMPLETE":
        rehash(ckpt, link)
    err = refused(ckpt, *victim)
    assert f"{link} is a symbolic link" in err, err
    assert "symbolic link" in error_of(lambda: zerodp.consolidate(ckpt))
    assert opened_outside(lambda: zerodp.load(ckpt, *victim), ckpt) == []


def test_a_checkpoint_reached_through_a_link_still_loads(good, victim, tmp_path):
    """The checkpoint directory itself may be a link ("latest" -> step_2): its files are inside its real path."""
    os.symlink(good, tmp_path / "latest")
    model, opt = victim
    assert zerodp.load(tmp_path / "latest", model, opt) == {"note": "good"}


@pytest.mark.parametrize("name", ["notes.txt", "rank01.safetensors", "rank-1.json", "metadata.json.bak"])
def test_complete_listing_a_name_the_format_does_not_write_is_refused(good, victim, tmp_path, name):
    ckpt = copy_of(good, tmp_path)
    with open(os.path.join(ckpt, name), "w") as f:
        f.write("{}")
    rehash(ckpt, name)
    err = refused(ckpt, *victim)
    assert repr(name) in err and "not a file a zerodp checkpoint has" in err, err


# == 19: validate everything, then write ==========================================================
def set_in(obj, keys, value):
    for k in keys[:-1]:
        obj = obj[k]
    obj[keys[-1]] = value


FIRST = "embed.weight"
METADATA_CASES = {
    # field path, forged value, fragment the error must hold
    "step_nan": (["step"], math.nan, "step"),
    "step_string": (["step"], "3", "step"),
    "scaler_no_clean_steps": (["loss_scaler"], {"scale": 1.0}, "loss_scaler"),
    "scaler_scale_inf": (["loss_scaler", "scale"], math.inf, "loss_scaler"),
    "scaler_not_a_dict": (["loss_scaler"], [1.0], "loss_scaler"),
    "lr_shell": (["param_groups", 0, "lr"], "0.1; rm -rf /", "lr"),
    "lr_nan": (["param_groups", 0, "lr"], math.nan, "lr"),
    "betas_wrong": (["param_groups", 0, "betas"], ["a", 0.999], "betas"),
    "betas_length": (["param_groups", 0, "betas"], [0.9, 0.99, 0.9], "betas"),
    "amsgrad_number": (["param_groups", 0, "amsgrad"], 3, "amsgrad"),
    "scalar_state_string": (["scalar_states", 0, "step"], "two", "scalar_states"),
    "scalar_state_nan": (["scalar_states", 0, "step"], math.nan, "scalar_states"),
    "config_no_precision": (["config"], {}, "mixed_precision"),
    "world_size_zero": (["world_size"], 0, "world_size"),
    "negative_shape": (["params", FIRST, "shape"], [-32, -16], "shape"),
    "piece_rank_bool": (["params", FIRST, "pieces", 0, 0], True, "pieces"),
    "piece_past_the_end": (["params", FIRST, "pieces", 0, 2], 10 ** 12, "pieces"),
    "group_out_of_range": (["params", FIRST, "group"], 5, "group"),
}


@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_malformed_metadata_changes_nothing(good, victim, tmp_path, case):
    keys, value, fragment = METADATA_CASES[case]
    ckpt = copy_of(good, tmp_path)
    edit_json(ckpt, "metadata.json", lambda meta: set_in(meta, keys, value))
    err = refused(ckpt, *victim)
    assert "zerodp did not write this" in err and fragment in err, err


@pytest.mark.parametrize("case", ["torch_state_short", "python_state_wrong", "not_a_dict"])
def test_malformed_rng_state_changes_nothing(good, victim, tmp_path, case):
    ckpt = copy_of(good, tmp_path)

    def change(obj):
        if case == "torch_state_short":
            obj["rng"]["torch"] = "AAAA"
        elif case == "python_state_wrong":
            obj["rng"]["python"] = [3, [1, 2], None]
        else:
            obj["rng"] = "seed"
    edit_json(ckpt, "rank0.json", change)
    err = refused(ckpt, *victim)
    assert "rank0.json" in err, err


def test_a_replicated_tensor_of_another_shape_than_the_model_changes_nothing(good, victim, tmp_path):
    """metadata.json says [16] (the model's), the file holds [1]: today copy_ broadcasts it silently."""
    ckpt = copy_of(good, tmp_path)
    save_file({"offset": torch.full((1,), 7.0)}, os.path.join(ckpt, "replicated.safetensors"))
    rehash(ckpt, "replicated.safetensors")
    err = refused(ckpt, *victim)
    assert "offset" in err and "(1,)" in err, err


CONSOLIDATE_CASES = {
    "huge_shape": (["params", FIRST, "shape"], [2 ** 40, 2 ** 20], "shape"),
    "negative_shape": (["params", FIRST, "shape"], [-32, -16], "shape"),
    "key_of_nothing": (["state_dict_keys", 0, 2], "absent.weight", "state_dict_keys"),
    "compute_dtype_not_a_dtype": (["compute_dtype"], "save", "compute_dtype"),
    "replicated_huge": (["replicated", "offset", "shape"], [2 ** 50], "offset"),
}


@pytest.mark.parametrize("case", sorted(CONSOLIDATE_CASES))
def test_consolidate_and_export_refuse_malformed_metadata(good, tmp_path, case):
    keys, value, fragment = CONSOLIDATE_CASES[case]
    ckpt = copy_of(good, tmp_path)
    edit_json(ckpt, "metadata.json", lambda meta: set_in(meta, keys, value))
    for fn in (lambda: zerodp.consolidate(ckpt, dtype="compute"),
               lambda: zerodp.export(ckpt, tmp_path / "out" / "m.safetensors")):
        err = error_of(fn)
        # A ValueError: `zerodp export` reports it as bad input, in one line.
        assert err is not None and err.startswith("InvalidCheckpoint") and fragment in err, err
    assert not (tmp_path / "out" / "m.safetensors").exists()
    from zerodp.checkpoint import InvalidCheckpoint

    assert issubclass(InvalidCheckpoint, ValueError) and issubclass(InvalidCheckpoint, CheckpointError)


# == 15: save never deletes what it did not write ================================================
def test_save_onto_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path):
    model, opt = trained(0, 1)
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("step 1 loss 4.2\n")
    err = error_of(lambda: zerodp.save(run, model, opt))
    assert err is not None and str(run) in err and "not a zerodp checkpoint" in err and "train.log" in err, err
    assert "save to a new path" in err, err  # the fix
    assert sorted(os.listdir(tmp_path)) == ["run"] and os.listdir(run) == ["train.log"]
    assert (run / "train.log").read_text() == "step 1 loss 4.2\n"
    # A file, and a link, where the checkpoint would go: refused too, left alone.
    (tmp_path / "a_file").write_text("mine")
    os.symlink(run, tmp_path / "a_link")
    for target in ("a_file", "a_link"):
        err = error_of(lambda target=target: zerodp.save(tmp_path / target, model, opt))
        assert err is not None and str(tmp_path / target) in err, err
    assert (tmp_path / "a_file").read_text() == "mine" and os.path.islink(tmp_path / "a_link")
    assert sorted(os.listdir(tmp_path)) == ["a_file", "a_link", "run"]


def test_save_onto_an_empty_directory_or_a_checkpoint_works(tmp_path):
    model, opt = trained(0, 1)
    (tmp_path / "ckpt").mkdir()  # made beforehand, as many scripts do
    zerodp.save(tmp_path / "ckpt", model, opt, n=1)
    opt.backward(loss_at(model, 1))
    opt.step()
    zerodp.save(tmp_path / "ckpt", model, opt, n=2)  # overwriting a checkpoint: as documented
    fresh, fresh_opt = trained(1, 0)
    assert zerodp.load(tmp_path / "ckpt", fresh, fresh_opt) == {"n": 2} and fresh_opt.step_count == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# == 16: latest() and keep_last agree ==============================================================
def test_a_run_started_over_in_an_old_directory_resumes_its_own_checkpoint(tmp_path):
    old, old_opt = trained(0, 3)
    zerodp.save(tmp_path / "step_3", old, old_opt)  # the previous run's
    new, new_opt = trained(1, 1)
    zerodp.save(tmp_path / "step_1", new, new_opt, keep_last=2)
    assert zerodp.latest(tmp_path) == str(tmp_path / "step_1")
    new_opt.backward(loss_at(new, 1))
    new_opt.step()
    zerodp.save(tmp_path / "step_2", new, new_opt, keep_last=2)
    # keep_last removed the previous run's, the order latest() follows.
    assert sorted(os.listdir(tmp_path)) == ["step_1", "step_2"]
    assert zerodp.latest(tmp_path) == str(tmp_path / "step_2")


def test_latest_follows_the_recorded_completion_not_file_times(tmp_path):
    """A copy (cp -r, a sync to object storage) gives every file a new time: the order is
    the one recorded in COMPLETE, and keep_last follows the same one."""
    model, opt = trained(0, 1)
    for name in ("b", "a", "c"):  # completed in this order
        zerodp.save(tmp_path / "orig" / name, model, opt)
    copy = tmp_path / "copy"
    for i, name in enumerate(("c", "a", "b")):  # copied in another order
        shutil.copytree(tmp_path / "orig" / name, copy / name)
        later = time.time() + 10 * i
        os.utime(copy / name / "COMPLETE", (later, later))
    assert zerodp.latest(copy) == str(copy / "c")
    zerodp.save(copy / "d", model, opt, keep_last=2)
    assert sorted(os.listdir(copy)) == ["c", "d"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory, pool):
    return pool.run(2, two_ranks, str(tmp_path_factory.mktemp("w2")), timeout_s=60)


def test_refusals_happen_on_every_rank_and_change_nothing(world2):
    for rank, r in enumerate(world2):
        err = r["save_onto_run"]
        assert err is not None and "not a zerodp checkpoint" in err and "train.log" in err, (rank, err)
        assert r["run_listing"] == ["train.log"], rank
        for case, fragment in (("rng", "rank1.json"), ("link", "rank1.safetensors is a symbolic link"),
                               ("lr", "lr")):
            res = r[case]
            assert res["error"] is not None and fragment in res["error"], (rank, case, res["error"])
            assert res["changed"] == [], (rank, case, res["changed"])


def test_tensor_parallel_saves_and_loads_and_checks_its_input(world2):
    for rank, r in enumerate(world2):
        for stage, res in r["tp"].items():
            assert res["round_trip"] is True, (rank, stage)
            assert res["shapes"] == res["plain_shapes"], (rank, stage)  # whole, as one process has them
            err = res["other_model"]
            assert err is not None and "does not match the model" in err, (rank, stage, err)
            # The DCP state dicts under tensor parallelism: the original shapes (DTensors of them).
            assert res["state_dict_shapes"] == res["plain_shapes"], (rank, stage)
            assert res["optimizer_state_shapes"] == sorted({tuple(v) for v in res["plain_shapes"].values()}), \
                (rank, stage, res["optimizer_state_shapes"])


# -- the recorded sha256 is the file's -------------------------------------------------------------
def test_the_digest_hashed_from_memory_is_the_file_s(tmp_path):
    """write_safetensors hashes the tensors' memory, not the file read back: it must equal the
    sha256 of the bytes on disk for every dtype, a 0-d and an empty tensor, and refuse a file
    that does not hold exactly those tensors."""
    from zerodp.checkpoint import files as ckpt_files

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 4, generator=g), "half": torch.randn(5, generator=g).to(torch.bfloat16),
               "f16": torch.randn(2, generator=g).half(), "scalar": torch.tensor(3.0), "empty": torch.empty(0),
               "steps": torch.arange(7), "mask": torch.tensor([True, False]), "bytes": torch.arange(3, dtype=torch.uint8)}
    for case in (tensors, {}, {"only": torch.zeros(1, 1)}):
        file = str(tmp_path / "x.safetensors")
        assert ckpt_files.write_safetensors(file, case) == ckpt_files.digest(file)
        assert {k: v.tolist() for k, v in load_file(file).items()} == {k: v.tolist() for k, v in case.items()}
    save_file({**tensors, "w": tensors["w"] + 1}, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lay out"):  # same names and sizes, but one more tensor
        ckpt_files.digest_written(file, {**tensors, "extra": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="lay out 'w'"):
        ckpt_files.digest_written(file, {**tensors, "w": torch.zeros(2)})
    # digest_written vouches for the layout, not the bytes: the load's verify catches the rest.
    assert ckpt_files.digest_written(file, tensors) != ckpt_files.digest(file)


def test_the_digest_is_written_where_no_thread_can_start(tmp_path, monkeypatch):
    """At interpreter shutdown Python 3.12.0-3.12.2 refuses new threads: an asynchronous save
    finishing at exit then flushes on its own thread, with the same result."""
    import threading

    from zerodp.checkpoint import files as ckpt_files

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    file = str(tmp_path / "x.safetensors")
    tensors = {"w": torch.arange(6.0).reshape(2, 3)}
    assert ckpt_files.write_safetensors(file, tensors) == ckpt_files.digest(file)
