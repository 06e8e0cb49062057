"""A zerodp script's end: resumed, saved (asynchronously or not), then returning, with or
without zerodp.shutdown_distributed(), exits cleanly every time ([Note: exit path] in
distributed/comm.py). Real processes under torchrun that exit normally (exit_path_script.py):
no abort ("terminate called without an active exception", SIGABRT), and zerodp's exit path
left nothing running into finalization: the group init_distributed joined is left, and the
checkpoint channel's group is freed (its gloo workers joined)."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ITERATIONS = 6  # every mode once, the two without shutdown_distributed twice; ~1.5 s each


def test_scripts_that_resume_save_and_return_exit_cleanly(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "exit_path_script.py"), str(tmp_path), "--iterations", str(ITERATIONS)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the scripts did not end in 180 s:\n{e.stderr}")
    assert "terminate called" not in done.stderr, done.stderr[-4000:]
    assert done.returncode == 0, done.stderr[-4000:]
    servers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(s["rank"] for s in servers) == [0, 1], done.stdout
    for s in servers:  # every child exited with 0 (a SIGABRT is status 6)
        assert s["statuses"] == [0] * ITERATIONS, (s, done.stderr[-4000:])
    for i in range(ITERATIONS):
        for rank in range(2):
            with open(tmp_path / f"exit-{i}-{rank}.json") as f:
                r = json.load(f)
            assert not r["joined_at_exit"], (i, rank, r)
            if r["mode"].startswith("async"):  # the checkpoint channel: one group, made by the save
                assert r["save_groups_alive"] == 0, (i, rank, r)
            assert os.path.isdir(tmp_path / f"step{i}"), i  # the save was committed, the async one at exit
