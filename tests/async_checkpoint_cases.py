"""Asynchronous checkpoint cases, one per test of test_async_checkpoint.py, run in the
session's world of 2 (the SIGKILL case in a world of its own: harness.run_world).

The background write is slowed (`slow_writes`) so that it is still running while the
training thread trains on: its agreement then overlaps the training's own collectives, the
case [Note: asynchronous save] in checkpoint/background.py is about.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time

import torch
from safetensors.torch import load_file
from checkpoint_cases import LM, TRAIN, adamw_groups, barrier, config, diffs, error_of, fixed_batch, snapshot, train

import zerodp
from zerodp.checkpoint import background
from zerodp.checkpoint import files as ckpt_files
from zerodp.checkpoint.format import COMPLETE


@contextlib.contextmanager
def slow_writes(delay_s: float, log: list | None = None, fail_on_rank: int | None = None, rank: int = 0):
    """Every safetensors write of this rank sleeps `delay_s` first; `log` gets each write's
    (file, start, end); on `fail_on_rank` the write fails as a full disk does."""
    real = ckpt_files.write_safetensors

    def slow(file, tensors):
        start = time.monotonic()
        time.sleep(delay_s)
        if rank == fail_on_rank:
            raise OSError(28, "No space left on device")
        out = real(file, tensors)
        if log is not None:
            log.append((os.path.basename(os.path.dirname(file)), start, time.monotonic()))
        return out

    ckpt_files.write_safetensors = slow
    try:
        yield
    finally:
        ckpt_files.write_safetensors = real


def _digests(path: str) -> dict:
    out = {}
    for name in sorted(os.listdir(path)):
        if name != COMPLETE:  # it records when the save completed
            with open(os.path.join(path, name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _fresh(stage: int, precision: str, seed: int = 0):
    torch.manual_seed(seed)
    return zerodp.initialize(LM(dropout=0.1), adamw_groups, config(stage, mixed_precision=precision))


def _resumed(path: str, stage: int, precision: str):
    model, opt = _fresh(stage, precision, seed=1)
    extra = zerodp.load(path, model, opt)
    losses = train(model, opt, TRAIN, fixed_batch, first_step=TRAIN)
    return extra, losses, snapshot(model, opt)


def async_equals_sync(rank, world_size, root, stage, precision):
    """The same state saved synchronously and asynchronously (training on while the second
    is written): the same files bit for bit, and the same resumed training."""
    model, opt = _fresh(stage, precision)
    train(model, opt, TRAIN, fixed_batch)
    sync = zerodp.save(os.path.join(root, "sync"), model, opt, data_position=TRAIN)
    with slow_writes(1.0):
        handle = zerodp.save(os.path.join(root, "async"), model, opt, asynchronous=True, data_position=TRAIN)
        in_flight = not handle.done() and zerodp.latest(root) == sync
        losses = train(model, opt, TRAIN, fixed_batch, first_step=TRAIN)  # changes what was staged
        still_in_flight_after_training = not handle.done()
        path = handle.wait()
    continued = snapshot(model, opt)
    staging = background.staging(opt)
    written = [f"rank{rank}.safetensors"] + (["replicated.safetensors"] if rank == 0 else [])
    shard_nbytes = sum(t.numel() * t.element_size() for name in written
                       for t in load_file(os.path.join(path, name)).values())
    pointers = sorted(b.data_ptr() for b in staging.buffers.values())
    # A second asynchronous save reuses the same staging buffers.
    zerodp.save(os.path.join(root, "async2"), model, opt, asynchronous=True).wait()
    reused = pointers == sorted(b.data_ptr() for b in staging.buffers.values())
    results = {name: _resumed(os.path.join(root, name), stage, precision) for name in ("sync", "async")}
    barrier()
    return {"digests": (_digests(sync), _digests(path)), "in_flight": in_flight,
            "overlapped_training": still_in_flight_after_training, "latest": zerodp.latest(root),
            "losses": losses, "resumed_losses": [results[n][1] for n in ("sync", "async")],
            "extra": results["async"][0],
            "diffs_sync_async": [k for k in diffs(results["sync"][2], results["async"][2])],
            "diffs_continued": [k for k in diffs(continued, results["async"][2]) if k != "rng"],
            "staging_nbytes": staging.nbytes, "shard_nbytes": shard_nbytes, "staging_reused": reused}


def second_save_waits(rank, world_size, root):
    """A save while one is in flight waits for it: the writes never overlap, and the first is
    committed before the second's plan runs, whether the second is asynchronous or not."""
    model, opt = _fresh(2, "fp32")
    train(model, opt, 1, fixed_batch)
    writes: list = []
    with slow_writes(0.5, log=writes):
        first = zerodp.save(os.path.join(root, "first"), model, opt, asynchronous=True)
        train(model, opt, 1, fixed_batch, first_step=1)
        t0 = time.monotonic()
        second = zerodp.save(os.path.join(root, "second"), model, opt, asynchronous=True)
        blocked = time.monotonic() - t0
        first_done_when_second_returned = first.done()
        first_complete = os.path.isfile(os.path.join(root, "first", COMPLETE))
        third = zerodp.save(os.path.join(root, "third"), model, opt)  # synchronous, after an asynchronous one
        second_complete = second.done() and os.path.isfile(os.path.join(root, "second", COMPLETE))
    return {"writes": writes, "blocked": blocked, "first_done": first_done_when_second_returned,
            "first_complete": first_complete, "second_complete": second_complete,
            "paths": [first.wait(), second.wait(), third], "latest": zerodp.latest(root)}


def background_error(rank, world_size, root):
    """Rank 1's background write fails: every rank raises it at the next save, then at
    wait_for_saves; nothing of the failed saves is left, the previous checkpoint is the newest."""
    model, opt = _fresh(2, "fp32")
    train(model, opt, 1, fixed_batch)
    good = zerodp.save(os.path.join(root, "good"), model, opt, asynchronous=True).wait()
    out = {}
    with slow_writes(0.2, fail_on_rank=1, rank=rank):
        zerodp.save(os.path.join(root, "bad1"), model, opt, asynchronous=True)
        out["returned"] = True
        train(model, opt, 1, fixed_batch, first_step=1)
        out["next_save"] = error_of(lambda: zerodp.save(os.path.join(root, "next"), model, opt))
        zerodp.save(os.path.join(root, "bad2"), model, opt, asynchronous=True)
        out["wait_for_saves"] = error_of(zerodp.wait_for_saves)
    out["after"] = zerodp.wait_for_saves()  # reported once
    barrier()
    out["listing"] = sorted(os.listdir(root))
    out["latest"] = zerodp.latest(root)
    out["good"] = good
    barrier()  # every rank has looked before the next save creates its staging directory
    out["recovers"] = zerodp.save(os.path.join(root, "recovered"), model, opt, asynchronous=True).wait()
    return out


def killed_while_writing(rank, world_size, root):
    """Spawned world: a checkpoint, then an asynchronous save whose background write is cut
    by SIGKILL (half of the rank file written) on every rank while training goes on."""
    model, opt = _fresh(2, "fp32")
    train(model, opt, 1, fixed_batch)
    zerodp.save(os.path.join(root, "step1"), model, opt, asynchronous=True).wait()
    if rank == 0:
        torch.save(snapshot(model, opt)["model"], os.path.join(root, "..", "at_step1.pt"))
    barrier()
    train(model, opt, 1, fixed_batch, first_step=1)
    real = ckpt_files.write_safetensors

    def cut(file, tensors):
        real(file, tensors)
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)
        open(os.path.join(root, "..", f"half{rank}"), "w").close()
        while not all(os.path.exists(os.path.join(root, "..", f"half{r}")) for r in range(world_size)):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    ckpt_files.write_safetensors = cut
    zerodp.save(os.path.join(root, "step2"), model, opt, asynchronous=True)
    for step in range(2, 10_000):  # training goes on until the kill
        train(model, opt, 1, fixed_batch, first_step=step)
    return "not killed"


def trainer_async_save(rank, world_size, root):
    """zerodp's Trainer saving every 2 steps with zerodp_async_save=True and without: the same
    checkpoint-N folders, the same zerodp checkpoints in them (bit for bit), the same training."""
    from hf_trainer_cases import _distributed_env, history, trainer_for

    from zerodp.integrations.hf import CHECKPOINT_DIR, last_complete_checkpoint

    _distributed_env(rank, world_size)
    out = {}
    for mode in ("sync", "async"):
        d = os.path.join(root, mode)
        trainer = trainer_for(d, zerodp.Config(stage=2), save_strategy="steps", save_steps=2)
        trainer.zerodp_async_save = mode == "async"  # as Trainer(..., zerodp_async_save=True) sets it
        trainer.train()
        folders = sorted(os.listdir(d))
        out[mode] = {"history": history(trainer), "folders": folders, "last": last_complete_checkpoint(d),
                     "zerodp": {f: _digests(os.path.join(d, f, CHECKPOINT_DIR)) for f in folders
                                if f.startswith("checkpoint-")},
                     "files": {f: sorted(os.listdir(os.path.join(d, f))) for f in folders if f.startswith("checkpoint-")}}
    return out
