"""SIGKILL a training worker under torchrun at chosen moments: mid-step or mid-save."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time

import zerodp


def worker_pids(launcher_pid: int) -> list[int]:
    """The training workers a launch (`launcher_pid`: torchrun's agent, or `zerodp train`, which
    runs it) has started: its descendants running the demo, torchrun's agent aside."""
    parents, commands = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                commands[int(entry)] = f.read()
        except (OSError, IndexError, ValueError):
            continue

    def descends(pid: int) -> bool:
        while pid in parents and pid > 1:
            pid = parents[pid]
            if pid == launcher_pid:
                return True
        return False

    return sorted(pid for pid, cmd in commands.items()
                  if b"zerodp.demo.train" in cmd and b"torch.distributed.run" not in cmd and descends(pid))


def _saving(ckpt_dir: str, left: set = frozenset()) -> bool:
    """Whether a save is being written: a `.tmp-` directory other than those earlier kills left."""
    try:
        return any(".tmp-" in name and name not in left for name in os.listdir(ckpt_dir))
    except FileNotFoundError:
        return False


def _over(deadline: float, proc, what: str, kills: list) -> None:
    if time.monotonic() > deadline or proc.poll() is not None:
        raise AssertionError(f"the run ended or timed out {what}; kills so far: {kills}")


def _latest_step(ckpt_dir: str) -> int:
    path = zerodp.latest(ckpt_dir)
    return -1 if path is None else int(os.path.basename(path).split("_")[-1])


def run_with_kills(cmd: list, env: dict, ckpt_dir: str, plan: list[str], seed: int, nproc: int,
                   timeout: float) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run `cmd` (a torchrun launch, or `zerodp train`) and SIGKILL one of its workers once per
    entry of `plan`: "save" while a checkpoint is being written (a `.tmp-` directory exists), "step" at a
    random moment of training outside a save. Before each kill the (restarted) workers must
    have saved a checkpoint newer than the one the previous kill left, so every kill hits a
    resumed run. Returns the finished process and what was killed when."""
    rng = random.Random(seed)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    kills, after, left = [], -1, set()
    try:
        for kind in plan:
            what = f"before kill {len(kills) + 1} ({kind})"
            while True:
                _over(deadline, proc, what, kills)
                pids = worker_pids(proc.pid)
                if len(pids) == nproc and _latest_step(ckpt_dir) > after:
                    break
                time.sleep(0.005)
            # Chosen before the wait: listing the workers walks /proc, long enough on a busy
            # machine for a save of the tiny model to finish between seeing it and the kill.
            victim = rng.choice(pids)
            if kind == "save":
                while not _saving(ckpt_dir, left):
                    _over(deadline, proc, what, kills)
                    time.sleep(0.0005)
            else:
                time.sleep(rng.uniform(0.0, 0.2))
                while _saving(ckpt_dir, left):
                    _over(deadline, proc, what, kills)
                    time.sleep(0.0005)
            os.kill(victim, signal.SIGKILL)
            # Read after the kill, which leaves the save it hit incomplete: the newest before it.
            kills.append({"kind": kind, "was_saving": _saving(ckpt_dir, left)})
            step = kills[-1]["latest_before"] = _latest_step(ckpt_dir)
            left |= {n for n in os.listdir(ckpt_dir) if ".tmp-" in n}
            after = step
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:  # the workers too: they hold the pipes, and would outlive the agent
            for pid in worker_pids(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.communicate(timeout=30)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), kills
