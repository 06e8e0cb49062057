"""Asynchronous checkpoints (`zerodp.save(..., asynchronous=True)`): the same checkpoint as
a synchronous save, one save at a time, failures raised on every rank, and a crash in the
background write leaving the previous checkpoint the newest. Cases: async_checkpoint_cases.py."""
import os

import pytest
import torch
from async_checkpoint_cases import async_equals_sync, background_error, killed_while_writing, second_save_waits
from harness import run_world

import zerodp
from zerodp.checkpoint.format import COMPLETE
from zerodp.checkpoint.retention import remove_stale


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16"), (3, "bf16")])
def test_asynchronous_save_is_the_synchronous_one(pool, tmp_path, stage, precision):
    for rank, r in enumerate(pool.run(2, async_equals_sync, str(tmp_path), stage, precision, timeout_s=240)):
        sync, asynchronous = r["digests"]
        assert sync == asynchronous, rank  # every file but COMPLETE's time, bit for bit
        # save returned before the files were written, and training ran while they were.
        assert r["in_flight"] and r["overlapped_training"], rank
        assert r["resumed_losses"][0] == r["resumed_losses"][1] == r["losses"], rank
        assert r["diffs_sync_async"] == [] and r["diffs_continued"] == [], rank
        assert r["extra"] == {"data_position": 3}
        assert r["latest"] == str(tmp_path / "async2")
        # Staging: the rank's checkpoint bytes exactly, allocated once and reused.
        assert r["staging_nbytes"] == r["shard_nbytes"] > 0, rank
        assert r["staging_reused"], rank


def test_a_save_waits_for_the_one_in_flight(pool, tmp_path):
    for rank, r in enumerate(pool.run(2, second_save_waits, str(tmp_path), timeout_s=240)):
        assert r["first_done"] and r["first_complete"] and r["second_complete"], rank
        assert r["blocked"] >= 0.3, rank  # it waited for the first save's slowed write
        # Never two saves writing at once: each save's writes end before the next one's start.
        by_save: dict = {}
        for save, start, end in r["writes"]:
            lo, hi = by_save.get(save, (start, end))
            by_save[save] = (min(lo, start), max(hi, end))
        spans = sorted(by_save.values())
        assert len(spans) == 3 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (rank, spans)
        assert r["paths"] == [str(tmp_path / n) for n in ("first", "second", "third")]
        assert r["latest"] == str(tmp_path / "third")


def test_a_background_failure_is_raised_on_every_rank(pool, tmp_path):
    results = pool.run(2, background_error, str(tmp_path), timeout_s=240)
    for rank, r in enumerate(results):
        assert r["returned"], rank
        for key, path in (("next_save", "bad1"), ("wait_for_saves", "bad2")):
            err = r[key]
            assert err is not None and err.startswith("CheckpointError"), (rank, key, err)
            assert f"asynchronous save of {tmp_path / path} failed" in err, (rank, err)
            assert "rank 1: OSError: [Errno 28] No space left on device" in err, (rank, err)
        assert r["after"] == []  # a failure is raised once
        assert r["latest"] == r["good"] == str(tmp_path / "good")
        # Nothing of the failed saves is left; the save after the failure did not run.
        assert r["listing"] == ["good"], (rank, r["listing"])
        assert r["recovers"] == str(tmp_path / "recovered")


def test_sigkill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    # The first rank to die takes the world down (as torchrun does): spawn reports its signal.
    with pytest.raises(Exception, match="SIGKILL|exited without a result"):
        run_world(2, killed_while_writing, str(root), timeout_s=180)
    names = sorted(os.listdir(root))
    unfinished = [n for n in names if n.startswith("step2.tmp-")]
    assert "step1" in names and "step2" not in names and len(unfinished) == 1, names
    assert not os.path.exists(root / unfinished[0] / COMPLETE)
    assert {"rank0.safetensors", "rank1.safetensors"} <= set(os.listdir(root / unfinished[0]))
    assert zerodp.latest(root) == str(root / "step1")  # the unfinished one is skipped
    # The previous checkpoint is whole: its values are the model's at that step.
    at_step1 = torch.load(tmp_path / "at_step1.pt")
    consolidated = zerodp.consolidate(root / "step1", dtype=None)
    for k, v in at_step1.items():
        assert torch.equal(consolidated[k], v), k
    # Its writers are dead, so the next save's tidying removes it.
    assert remove_stale(str(root)) == unfinished


def test_the_trainer_saves_asynchronously(pool, tmp_path):
    from async_checkpoint_cases import trainer_async_save

    for rank, r in enumerate(pool.run(2, trainer_async_save, str(tmp_path), timeout_s=300)):
        sync, asynchronous = r["sync"], r["async"]
        assert asynchronous["history"] == sync["history"], rank
        assert asynchronous["folders"] == sync["folders"] and len(sync["zerodp"]) >= 2, (rank, asynchronous["folders"])
        assert asynchronous["files"] == sync["files"], rank  # every folder in place, nothing staged left
        assert asynchronous["zerodp"] == sync["zerodp"], rank
        assert os.path.basename(asynchronous["last"]) == os.path.basename(sync["last"]) == sync["folders"][-1]
