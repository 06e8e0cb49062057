"""Gloo worlds kept for the whole pytest session: one per world size, each test one case.

[Note: reused worlds]
A spawned rank is a fresh interpreter that imports torch and zerodp (~5 s on a 2-core
machine), so spawning a world per test module was about half the suite's time, and running a
whole grid inside it meant one exception failed every test of the module. Here each world
size gets one world, started on first use and kept until the session ends (DeepSpeed's
`reuse_dist_env` does the same), its ranks forked from a forkserver that imported torch and
zerodp once (PRELOAD); a test sends it one case (an importable function and its
arguments), every rank runs it, and the test asserts on what the ranks returned, so
`pytest -k name` runs that case alone.

A world is only reused while it is known to be sound. A case that raises on any rank, times
out or loses a rank may have left a rank inside a collective that the others abandoned, so
that world is killed and the next case starts a fresh one. Between cases every rank
restores what a case may change and a fresh world would not have: os.environ, the default
RNG's seed and the default dtype. Process groups a case builds through zerodp are cached by
zerodp itself (distributed/topology.py) and are reused, not leaked, by the next case.

Cases that kill a rank or tear the process group down on purpose use `harness.run_world`,
which spawns a world for that one call.
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.connection import wait

# Started once per session; a world of 4 is 4 interpreters, so more would only compete for
# the two cores. The largest world any case needs is 4.
WORLD_SIZES = (1, 2, 4)
# A rank is forked from a server that has imported these once ([Note: reused worlds]): a
# spawned rank imported them itself, ~2.5 s of CPU each, in every world a test session
# starts or restarts after a case that failed on purpose.
START_METHOD = "forkserver"
PRELOAD = ["torch", "torch.distributed", "zerodp"]


def _serve(rank: int, world_size: int, store_path: str, conn, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    seed, dtype = torch.initial_seed(), torch.get_default_dtype()
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args, kwargs = task
        environ = dict(os.environ)
        torch.manual_seed(seed)
        try:
            value = fn(rank, world_size, *args, **kwargs)
            # No rank takes the next case while another is still in this one's last collective.
            dist.barrier()
            result = ("ok", value)
        except BaseException as e:  # reported to the test, which fails
            result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            os.environ.clear()
            os.environ.update(environ)
            torch.set_default_dtype(dtype)
        try:
            conn.send(result)
        except Exception as e:  # an unpicklable result is the case's error, not the world's
            conn.send(("error", f"rank {rank}: the result could not be sent: {type(e).__name__}: {e}"))
    dist.destroy_process_group()
    conn.close()
    # Skip the C++ runtime's static destructors (one of them rarely aborts a spawned worker
    # at exit); Python's exit handlers, e.g. offload directories' cleanup, still run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class World:
    """`world_size` ranks in one gloo group, serving cases until closed."""

    world_size: int
    timeout_s: float = 600.0  # the process group's: a collective left waiting longer raises
    _tmp: tempfile.TemporaryDirectory = field(default=None, repr=False)
    _ctx: object = field(default=None, repr=False)
    _conns: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        context = mp.get_context(START_METHOD)
        context.set_forkserver_preload(PRELOAD)
        pipes = [context.Pipe() for _ in range(self.world_size)]
        self._conns = [parent for parent, _ in pipes]
        store_path = os.path.join(self._tmp.name, "store")
        self._ctx = mp.start_processes(
            _serve_entry, args=(self.world_size, store_path, [child for _, child in pipes], self.timeout_s),
            nprocs=self.world_size, join=False, start_method=START_METHOD)
        for _, child in pipes:
            child.close()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._ctx.processes)

    def run(self, fn, *args, timeout_s: float = 300.0, **kwargs) -> list:
        """fn(rank, world_size, *args, **kwargs) on every rank; the ranks' results in rank
        order. Raises with every failing rank's traceback, or TimeoutError; either way the
        world is closed and must not be used again ([Note: reused worlds])."""
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        deadline = time.monotonic() + timeout_s
        results: list = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            # Woken by the first rank that reports, not after a fixed poll per rank.
            ready = wait([self._conns[r] for r in pending], timeout=0.5)
            for r in [r for r in pending if self._conns[r] in ready]:
                try:
                    results[r] = self._conns[r].recv()
                except (EOFError, OSError):
                    results[r] = ("error", f"rank {r}: exited without a result")
                pending.discard(r)
            if pending and not self.alive:
                time.sleep(0.5)  # a rank that died may have sent nothing; let the others report
                for r in list(pending):
                    if not self._conns[r].poll(0):
                        results[r] = ("error", f"rank {r}: exited without a result")
                        pending.discard(r)
            failed = any(res is not None and res[0] != "ok" for res in results)
            if pending and failed:
                # The world is lost anyway; a rank still waiting in a collective the failed
                # one left would only report its timeout, minutes later.
                deadline = min(deadline, time.monotonic() + 5.0)
                if time.monotonic() >= deadline:
                    for r in pending:
                        results[r] = ("error", f"rank {r}: still running when another rank failed")
                    pending.clear()
                    break
            if pending and time.monotonic() > deadline:
                self.close(kill=True)
                raise TimeoutError(f"world of {self.world_size} ranks running {fn.__name__} did not finish in "
                                   f"{timeout_s}s")
        # The ranks that failed first, then those cut short by them.
        errors = sorted((value for status, value in results if status != "ok"),
                        key=lambda text: "still running when another rank failed" in text)
        if errors:
            self.close(kill=True)
            raise RuntimeError("\n".join(errors))
        return [value for _, value in results]

    def close(self, kill: bool = False) -> None:
        if self._ctx is None:
            return
        if not kill:
            for conn in self._conns:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    kill = True
            deadline = time.monotonic() + 30
            while not all(not p.is_alive() for p in self._ctx.processes) and time.monotonic() < deadline:
                time.sleep(0.05)
        for p in self._ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
        for conn in self._conns:
            conn.close()
        self._ctx = None
        self._tmp.cleanup()


def _serve_entry(rank: int, world_size: int, store_path: str, conns: list, timeout_s: float) -> None:
    # start_processes passes the same arguments to every rank: each takes its own end.
    _serve(rank, world_size, store_path, conns[rank], timeout_s)


class Worlds:
    """The session's worlds by size, each started on first use and replaced once broken."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}
        self._cache: dict = {}

    def run(self, world_size: int, fn, *args, timeout_s: float = 300.0, **kwargs) -> list:
        world = self._worlds.get(world_size)
        if world is None or world._ctx is None or not world.alive:
            if world is not None:
                world.close(kill=True)
            world = self._worlds[world_size] = World(world_size)
        try:
            return world.run(fn, *args, timeout_s=timeout_s, **kwargs)
        finally:
            if world._ctx is None:
                del self._worlds[world_size]

    def cached(self, world_size: int, fn, *args, timeout_s: float = 300.0) -> list:
        """`run`, once per session for the same world size, case and arguments: for a case
        whose one run several tests assert on (a sub-grid not yet split into cases)."""
        key = (world_size, fn.__module__, fn.__qualname__, args)
        if key not in self._cache:
            self._cache[key] = self.run(world_size, fn, *args, timeout_s=timeout_s)
        return self._cache[key]

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()



class LazyWorld:
    """`results[rank][part]` of a world whose cases are named parts, each run on first use
    (once per session, `Worlds.cached`), so a test runs only the parts it reads and one
    part's failure fails only the tests that read it. For grids whose parts are not yet
    split into a case per test."""

    def __init__(self, pool: Worlds, world_size: int, parts: dict, *args, timeout_s: float = 300.0):
        self._pool, self._n, self._parts, self._args, self._timeout_s = pool, world_size, parts, args, timeout_s
        self._ranks = [_RankView(self, r) for r in range(world_size)]

    def part(self, name: str) -> list:
        if name not in self._parts:
            raise KeyError(f"world of {self._n} has no part {name!r}: it has {sorted(self._parts)}")
        return self._pool.cached(self._n, self._parts[name], *self._args, timeout_s=self._timeout_s)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, rank: int) -> "_RankView":
        return self._ranks[rank]

    def __iter__(self):
        return iter(self._ranks)


class _RankView:
    def __init__(self, world: LazyWorld, rank: int):
        self._world, self._rank = world, rank

    def __getitem__(self, name: str):
        return self._world.part(name)[self._rank]

    def __contains__(self, name: str) -> bool:
        return name in self._world._parts
