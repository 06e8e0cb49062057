"""Leftovers of killed saves are removed by the next save; keep_last keeps the newest."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

import zerodp
from zerodp.checkpoint import CheckpointError
from zerodp.checkpoint.retention import OWNER


def tiny():
    torch.manual_seed(0)
    return zerodp.initialize(nn.Linear(4, 4), torch.optim.SGD, zerodp.Config(stage=2), lr=0.1)


def leftover(root, name, owner=None, age_s=0.0):
    path = root / name
    path.mkdir()
    (path / "rank0.safetensors").write_bytes(b"half")
    if owner is not None:
        (path / OWNER).write_text(json.dumps(owner))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_the_next_save_removes_what_killed_saves_left_and_nothing_else(tmp_path, monkeypatch):
    from zerodp.checkpoint import retention

    model, opt = tiny()
    # A moved-aside directory's age is its ctime (a rename sets it; utime cannot): make one,
    # and let it grow older than a shortened limit. Leftover names end in a 12-digit hex id,
    # as save, commit and prune make them.
    monkeypatch.setattr(retention, "OLD_STALE_S", 1.0)
    leftover(tmp_path, "b.old-00000000000a")
    time.sleep(1.2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from zerodp.checkpoint.retention import owner_record

    host = owner_record()["host"]
    left = {
        "dead": leftover(tmp_path, "a.tmp-00000000000d", {"host": host, "pid": dead.pid, "started": time.time()}),
        "live": leftover(tmp_path, "a.tmp-00000000000e", {"host": host, "pid": os.getpid(), "started": time.time()}),
        "foreign old": leftover(tmp_path, "a.tmp-0000000000f0",
                                {"host": "elsewhere", "pid": 1, "started": time.time() - 2 * 86400}),
        "foreign new": leftover(tmp_path, "a.tmp-0000000000f1", {"host": "elsewhere", "pid": 1, "started": time.time()}),
        "unowned old": leftover(tmp_path, "a.tmp-000000000a00", age_s=2 * 86400),
        "unowned new": leftover(tmp_path, "a.tmp-000000000a01"),
        "committing": leftover(tmp_path, "b.old-00000000000b"),
        # Killed between making its directory and naming its writer in it: never a .tmp-.
        "staging old": leftover(tmp_path, "c.staging-00000000000c", age_s=120),
        "staging naming": leftover(tmp_path, "c.staging-0000000000c1"),
        # Not zerodp's: a user's name with a tag in it, and a leftover name holding a user's file.
        "user name": leftover(tmp_path, "data.tmp-2023", age_s=2 * 86400),
        "user file": leftover(tmp_path, "d.tmp-000000000ddd", age_s=2 * 86400),
    }
    (left["user file"] / "notes.txt").write_text("mine")
    (tmp_path / "notes").mkdir()
    zerodp.save(tmp_path / "step_1", model, opt)
    kept = sorted(os.listdir(tmp_path))
    assert kept == sorted(["step_1", "notes", "a.tmp-00000000000e", "a.tmp-0000000000f1", "a.tmp-000000000a01",
                           "b.old-00000000000b", "c.staging-0000000000c1", "data.tmp-2023",
                           "d.tmp-000000000ddd"]), kept
    assert zerodp.latest(tmp_path).endswith("step_1")


def test_the_writer_stays_named_through_the_commit(tmp_path, monkeypatch):
    """A kill while rank 0 commits (writing COMPLETE, renaming) leaves a `.tmp-` directory
    that the next save must recognise as a leftover: its OWNER is still in it then."""
    from zerodp.checkpoint import files

    model, opt = tiny()
    seen, real_commit = [], files.commit

    def commit(tmp, path, listed):
        seen.append(os.path.exists(os.path.join(tmp, OWNER)))
        real_commit(tmp, path, listed)
    monkeypatch.setattr(files, "commit", commit)
    zerodp.save(tmp_path / "step_1", model, opt)
    assert seen == [True]
    assert not (tmp_path / "step_1" / OWNER).exists()  # a finished checkpoint names no writer
    zerodp.load(tmp_path / "step_1", model, opt)


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path):
    model, opt = tiny()
    (tmp_path / "notes").mkdir()
    for step in range(1, 5):
        x = torch.randn(2, 4)
        opt.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
        zerodp.save(tmp_path / f"step_{step}", model, opt, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["notes", "step_3", "step_4"]
    assert zerodp.latest(tmp_path).endswith("step_4")
    with pytest.raises(CheckpointError, match="keep_last=0: use a positive integer"):
        zerodp.save(tmp_path / "step_5", model, opt, keep_last=0)
    assert sorted(os.listdir(tmp_path)) == ["notes", "step_3", "step_4"]
