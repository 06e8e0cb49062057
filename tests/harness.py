"""Run a function on N local processes with gloo, and collect what each rank returns.

Spawning is the slow part on CPU, so tests spawn one world per world size and run a grid
of cases inside it. Every world has a timeout, so a hang fails instead of stalling CI.
"""
from __future__ import annotations

import atexit
import os
import pickle
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, fn, args, out_dir, timeout_s):
    import datetime

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result = None
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        # No rank tears the group down while another is still finishing its last collective.
        dist.barrier()
        result = ("ok", value)
    except BaseException as e:  # reported to the parent, which fails the test
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()
        # The result is delivered: leave without the C++ runtime's static destructors, one
        # of which rarely aborts a spawned worker at exit ("terminate called without an
        # active exception", seen once in a full CI run), turning a finished world into an
        # error. Python's own exit handlers (e.g. offload directories' cleanup) still run.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_world(world_size: int, fn, *args, timeout_s: float = 240.0):
    """fn(rank, world_size, *args) on `world_size` processes; returns the list of results.

    `fn` must be importable (defined at module level). Raises with every failing rank's
    traceback, or a TimeoutError if the world has not finished in `timeout_s`.
    """
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        ctx = mp.start_processes(_worker, args=(world_size, store_path, fn, args, tmp, timeout_s),
                                 nprocs=world_size, join=False, start_method="spawn")
        import time

        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"world of {world_size} ranks running {fn.__name__} did not finish in {timeout_s}s")
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: exited without a result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            (results if status == "ok" else errors).append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
