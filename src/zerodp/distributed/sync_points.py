"""Sync points: a call that is collective at some stages (`optimizer.state_dict()`, a stage-3
forward under torch.no_grad(), ...) made on some ranks only is refused on every rank, with
the call, the fix and where each rank was, before any collective of it runs.

[Note: sync points]
DDP scripts save and evaluate on the master process: nanoGPT's `if master_process:
torch.save({'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict()})` and
`if iter_num % eval_interval == 0 and master_process: losses = estimate_loss()`. Under DDP
both are local. Under zerodp some calls are collective: `optimizer.state_dict()` at stages
1-3 gathers each state's rows, `optimizer.load_state_dict()` checks the dict on every rank,
`model.state_dict()` / `load_state_dict()` at stage 3 (and packed projections under tensor
parallelism) gather or scatter parameters, and every stage-3 forward all-gathers each unit.
Made on one rank, such a call waits in a collective that the others never join while they
go on training; on gloo its messages never pair with theirs ([Note: gloo pairing] in
collectives.py), so each side waits out Config.collective_timeout_s, and a blocked gloo
receive cannot be interrupted to say why. The ranks must find out before they issue anything.

So every rank numbers its *sync points* in program order:
- each such call, right before its first collective (`SyncPoints.call`);
- right before training's first collective of each accumulation window (a stage-3
  training forward's first gather, else the first gradient reduction: schedule/base.py)
  and of each step (the step agreement, `Comm.agree_on_step`): `SyncPoints.before_training`.
At its i-th point a rank adds itself to point i's counter in the process group's store (a
call adds 2^32 + 1, any other point 1; a call also counts itself under its name). The rank
whose add completes the count writes the verdict: every rank at the same point (no call, or
all in the same call) or not; the others wait for it (a store wait on that key: woken at
once). On a mismatch every rank publishes where it is and raises `UnmatchedCallError`,
naming the call, the ranks that did not make it, what they went on to, and the fix; no
collective of the call has run, and the process group stays usable.

No false positives: a rank's points follow from the collectives it issues. A training
point sits immediately before a collective that every rank runs at that place of the
program, and a call's point immediately before the collectives the call issues; a stage-3
forward or model.state_dict() is a point only when it must gather a unit (inside
gathered_parameters it is local, and no point). Ranks that issue the same collectives in
the same order therefore pass the same points in the same order, and a point whose kinds
differ means their next collectives differ: the call would wait for ranks that never join
it. Arrivals are counted per point, never inferred from totals, so a rank that is merely
late (still computing, or in an evaluation that is local at its stage) is waited for, not
taken for one that skipped a call.

Why a training point waits: a rank that only read the counters would miss a call that
another rank enters a moment later (rank 0 takes the state dict right after the step while
rank 1 reaches its next forward's first gather), issue its collective, and be stuck in it.
So it waits for the others, but at most `grace_s` (1 s; an eighth of the collective timeout
when that is shorter): a peer that died must still be found by the collective at once.
After that it publishes what it went on to and issues its collective as before; a peer
that enters a call even later finds the mismatch itself and raises at once with this
rank's story, while this rank stays in its collective until that peer's process ends (its
failure report then names the call) or the timeout. A call waits up to the collective
timeout. A rank that leaves (shutdown_distributed, or its process ending) publishes so, and
a rank waiting in a call raises at once. After a mismatch the ranks' points no longer
align: that Comm's points stop. A world of one process has none.

Cost: two points a step (the window's first collective, the step agreement). A point is
one add, then either the verdict (a set, two deletes of the previous point's keys) or a
wait and a check: 0.2-0.4 ms a point with torchrun's TCPStore on one host, measured with
nothing else running (benchmarks/bench_sync_points.py).
"""
from __future__ import annotations

import atexit
import datetime
import json
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .failure import CollectiveError

log = logging.getLogger(__name__)

__all__ = ["CollectiveCall", "EVAL_FORWARD", "MODEL_LOAD_STATE_DICT", "MODEL_STATE_DICT", "OPTIMIZER_LOAD_STATE_DICT",
           "OPTIMIZER_STATE_DICT", "SyncPoints", "UnmatchedCallError", "leave_all"]

GRACE_S = 1.0  # longest wait of a training point for the other ranks
REPORT_WAIT_S = 2.0  # how long a rank that found a mismatch waits for the others' whereabouts
_SPIN_S = 0.02  # a FileStore's wait() polls every 10 ms: check more often for this long first
_CALL_ARRIVAL = (1 << 32) + 1  # one arrival, one call: the counter keeps arrivals below bit 32
_ARRIVALS = (1 << 32) - 1
_ABANDONED = 1 << 31  # added by a call that gave up waiting: no later arrival completes the count

# Per mesh name: how many SyncPoints were built over it. Every rank builds its Comms in the
# same order, so the n-th is the n-th everywhere (as failure.py's reports).
_GENERATIONS: dict = {}
# The SyncPoints of live Comms: told when this process leaves (shutdown_distributed, exit).
_LIVE: "weakref.WeakSet[SyncPoints]" = weakref.WeakSet()
_AT_EXIT: list = []


class UnmatchedCallError(CollectiveError):
    """A collective call that not every rank made: raised on every rank, before any
    collective of it ran ([Note: sync points])."""


@dataclass(frozen=True)
class CollectiveCall:
    """A call that is collective at some stages: its name as a script writes it, how to make
    it on every rank, and the verb a message uses with it (a forward is run, not called)."""

    name: str
    fix: str
    verb: tuple = ("call", "called")


_FULL = ("torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer, options=StateDictOptions("
         "full_state_dict=True, cpu_offload=True))")
OPTIMIZER_STATE_DICT = CollectiveCall(
    "optimizer.state_dict()",
    f"Call it on every rank. For one file written by rank 0: {_FULL} on every rank gives rank 0 the whole model "
    f"and optimizer state (the others get empty dicts), then `if master_process: torch.save(...)` (a rank's own "
    f"optimizer.state_dict() holds only its rows, so saving rank 0's alone loses the others'); or "
    f"zerodp.save(path, model, optimizer) on every rank, each writing its shard.")
MODEL_STATE_DICT = CollectiveCall(
    "model.state_dict()",
    f"Call it on every rank. For one file written by rank 0: zerodp.full_state_dict(model, optimizer, "
    f"rank0_only=True) or {_FULL} on every rank gives rank 0 the whole model, then `if master_process: "
    f"torch.save(...)`; or zerodp.save(path, model, optimizer) on every rank.")
OPTIMIZER_LOAD_STATE_DICT = CollectiveCall(
    "optimizer.load_state_dict()",
    "Load on every rank, each from the same state dict (torch.load the file on every rank), or "
    "torch.distributed.checkpoint.state_dict.set_state_dict(model, optimizer, model_state_dict=..., "
    "optim_state_dict=..., options=StateDictOptions(full_state_dict=True)) on every rank; or zerodp.load(path, "
    "model, optimizer) on every rank.")
MODEL_LOAD_STATE_DICT = CollectiveCall(
    "model.load_state_dict()",
    "Load on every rank, each from the same state dict (torch.load the file on every rank); or zerodp.load(path, "
    "model, optimizer) or zerodp.load_pretrained on every rank.")
EVAL_FORWARD = CollectiveCall(
    "a forward under torch.no_grad() (evaluation)",
    verb=("run", "ran"),
    fix="Run the evaluation on every rank, each on its own batches (log on the master only, or average the losses "
    "with torch.distributed.all_reduce first). `with zerodp.gathered_parameters(model):` around a master-only "
    "block does not help: entering it gathers every unit, itself a collective of every rank, and each forward "
    "inside frees the units again, so the next forward gathers on one rank.")


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _went(d: Optional[dict]) -> str:
    """Where a rank that did not make the call was."""
    if d is None:
        return "it said nothing: it is elsewhere (computing, or in a collective of its own)"
    if d["kind"] == "call":
        return f"it called {d['name']} instead"
    text = f"it went on to {d['doing']}"
    if d.get("blocked"):
        text += (" after waiting for the others there, and waits in that collective until this process ends or "
                 "Config.collective_timeout_s passes")
    return text


def story(rank: int, everyone: dict, world_size: int) -> str:
    """The error of `rank` at a point where the ranks differ; `everyone`: rank -> what it
    published (its call, or what it went on to), for the ranks that did."""
    mine = everyone[rank]
    calls = {r: d for r, d in sorted(everyone.items()) if d["kind"] == "call"}
    names = sorted({d["name"] for d in calls.values()})
    if not names:  # the calling rank did not say which call (its process ended)
        return (f"rank {rank}: another rank waits in a collective call that this rank did not make "
                f"({_went(mine)}); it did not say which. Every rank must make the same collective calls "
                f"(state_dict, load_state_dict, forwards at stage 3) in the same order.")
    if len(names) == 1:
        call = next(iter(calls.values()))
        head = f"rank {rank}: {call['name']} is collective {call['why']}"
        absent = [r for r in range(world_size) if r not in calls]
        verb, past = call["verb"]
        if not absent:  # every rank came, one too late
            late = [r for r, d in calls.items() if not d.get("gave_up")]
            return (f"{head}: {_ranks([r for r in calls if r not in late])} gave up waiting for {_ranks(late)} "
                    f"after Config.collective_timeout_s: a rank {past} it too late. {call['fix']}")
        if mine["kind"] == "call":
            where = "; ".join(f"rank {r}: {_went(everyone.get(r))}" for r in absent) if len(absent) > 1 \
                else _went(everyone.get(absent[0]))
            text = f"{head}: {_ranks(absent)} did not {verb} it ({where})."
        else:
            text = f"{head}: {_ranks(list(calls))} {past} it and waited for every rank, but this rank did not " \
                   f"({_went(mine)})."
        return f"{text} {call['fix']}"
    shown = "; ".join(f"rank {r}: {d['name']} (collective {d['why']})" if d["kind"] == "call"
                      else f"rank {r}: {d['doing']}" for r, d in sorted(everyone.items()))
    fixes = " ".join(d["fix"] for d in {d["name"]: d for d in calls.values()}.values())
    return (f"rank {rank}: the ranks made different collective calls at the same point ({shown}). Every rank must "
            f"make the same collective calls in the same order. {fixes}")


class SyncPoints:
    """This process's sync points over one Comm's ranks ([Note: sync points]); inert
    (`enabled` False) in a world of one process or without a store."""

    def __init__(self, store: Optional[dist.Store], rank: int, world_size: int, timeout_s: float,
                 failures=None, ledger=None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s = timeout_s
        self.grace_s = min(GRACE_S, timeout_s / 8)
        self.failures, self.ledger = failures, ledger  # the Comm's: see `_tell_blocked_peers`
        self.enabled = store is not None and world_size > 1
        self.point = 0  # points passed
        self._last_call: Optional[str] = None  # the previous point's call, whose counter the next verdict deletes
        self._spin = self.enabled and isinstance(_underlying(store), dist.FileStore)
        if self.enabled:
            _LIVE.add(self)
            if not _AT_EXIT:
                _AT_EXIT.append(atexit.register(_leave_all_at_exit))

    @classmethod
    def of(cls, comm) -> "SyncPoints":
        """The points of `comm`: over every process its collectives involve (under tensor
        parallelism the whole world), in a namespace of the store of their own."""
        topology = comm.topology
        world = topology.process_count
        store = _group_store() if world > 1 else None
        if store is None:
            return cls(None, 0, 1, topology.timeout_s or 300.0)
        name = "world" if topology.tp_size > 1 else topology.name
        _GENERATIONS[name] = _GENERATIONS.get(name, 0) + 1
        prefixed = dist.PrefixStore(f"zerodp/sync/{name}/{_GENERATIONS[name]}/", store)
        return cls(prefixed, topology.process_rank, world, topology.timeout_s or 300.0, comm.failures, comm.ledger)

    # -- the points ----------------------------------------------------------------------------
    def call(self, call: CollectiveCall, why: str) -> None:
        """Right before the first collective of `call`, collective `why` (e.g. "at stage 1 (it
        gathers ...)"): returns once every rank made it; raises `UnmatchedCallError` on every
        rank if one went on to something else, or did not come within the collective timeout."""
        if self.enabled:
            self._arrive({"kind": "call", "name": call.name, "why": why, "fix": call.fix, "verb": call.verb},
                         self.timeout_s)

    def before_training(self, doing: str) -> None:
        """Right before training's collective `doing` (e.g. "the backward of step 12"): raises
        `UnmatchedCallError` on every rank if another waits in a call that this rank skipped."""
        if self.enabled:
            self._arrive({"kind": "training", "doing": doing}, self.grace_s)

    def leave(self, doing: str, raise_on_mismatch: bool) -> None:
        """This process leaves (`doing`: how): a rank waiting in a call learns it at once. With
        `raise_on_mismatch`, this rank raises too if one does; the points end either way."""
        if not self.enabled:
            return
        me = {"kind": "left", "doing": doing}
        try:
            self._publish(self.point + 1, me)  # first: a rank waiting in a call reads it once this arrives
        except Exception:  # noqa: BLE001 - the store is gone with its host: nobody is waiting there
            self.close()
            return
        try:
            self._arrive(me, None, refuse=raise_on_mismatch)
        finally:
            self.close()

    def close(self) -> None:
        self.enabled = False
        _LIVE.discard(self)

    # -- one point -----------------------------------------------------------------------------
    def _arrive(self, me: dict, wait_s: Optional[float], refuse: bool = True) -> None:
        """Count this rank in at the next point, then wait up to `wait_s` (None: not at all)
        for the verdict; a mismatch raises (with `refuse`)."""
        i = self.point = self.point + 1
        call = me["kind"] == "call"
        previous, self._last_call = self._last_call, me["name"] if call else None
        try:
            if call:
                self.store.add(f"{i}/call/{me['name']}", 1)
            count = self.store.add(f"{i}/n", _CALL_ARRIVAL if call else 1)
            if count & _ARRIVALS == self.world_size:
                agreed = self._agreed(i, count >> 32, me)
                if not agreed:
                    self.store.set(f"{i}/differ", "")
                self.store.set(f"{i}/go", "")
                self._forget(i - 1, previous)
            elif wait_s is None:
                return
            elif self._wait(f"{i}/go", wait_s):
                agreed = not self.store.check([f"{i}/differ"])
            elif call:
                self._timed_out(i, me)
            else:  # on into the collective, as without sync points; a later arrival reads where this rank went
                self._publish(i, {**me, "blocked": True})
                return
        except UnmatchedCallError:
            raise
        except Exception as e:  # noqa: BLE001 - the store failed: go on as without sync points
            log.warning("rank %d: sync points off, the store failed (%s: %s)", self.rank, type(e).__name__, e)
            self.close()
            return
        if not agreed and refuse:
            self._refuse(i, me)

    def _agreed(self, i: int, calls: int, me: dict) -> bool:
        """Whether every rank is at the same point: no call, or every rank in this one."""
        return calls == 0 or (calls == self.world_size and me["kind"] == "call" and
                              self.store.add(f"{i}/call/{me['name']}", 0) == self.world_size)

    def _forget(self, i: int, call: Optional[str]) -> None:
        """Point `i`'s keys (`call`: its call), once every rank is past it (each arrived at the next)."""
        if i < 1:
            return
        self.store.delete_key(f"{i}/n")
        self.store.delete_key(f"{i}/go")
        if call is not None:
            self.store.delete_key(f"{i}/call/{call}")

    def _wait(self, key: str, timeout_s: float) -> bool:
        """Whether `key` appeared within `timeout_s`."""
        start = time.monotonic()
        if self._spin:  # ranks mostly arrive within a few ms of each other
            pause = 0.0002
            while time.monotonic() - start < min(_SPIN_S, timeout_s):
                if self.store.check([key]):
                    return True
                time.sleep(pause)
                pause = min(2 * pause, 0.002)
        left = timeout_s - (time.monotonic() - start)
        if left <= 0:
            return self.store.check([key])
        try:
            self.store.wait([key], datetime.timedelta(seconds=left))
            return True
        except RuntimeError as e:  # TCPStore: DistStoreError "wait timeout after ..."; FileStore: "Wait timeout"
            if "timeout" in str(e).lower():
                return False
            raise

    def _publish(self, i: int, me: dict) -> None:
        self.store.set(f"{i}/at/{self.rank}", json.dumps(me))

    def _whereabouts(self, i: int, me: dict) -> dict:
        """Every rank's entry at point `i` that is published within REPORT_WAIT_S."""
        self._publish(i, me)
        keys = [f"{i}/at/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + REPORT_WAIT_S
        while not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {r: json.loads(self.store.get(k)) for r, k in enumerate(keys) if r == self.rank or
                self.store.check([k])}

    def _refuse(self, i: int, me: dict) -> None:
        self.close()  # the ranks' points no longer align
        try:
            everyone = self._whereabouts(i, me)
        except Exception as e:  # noqa: BLE001 - the story without the others' part
            log.warning("rank %d: could not read the other ranks' whereabouts (%s)", self.rank, e)
            everyone = {self.rank: me}
        error = UnmatchedCallError(story(self.rank, everyone, self.world_size))
        if me["kind"] == "call" and any(d.get("blocked") for d in everyone.values()):
            self._tell_blocked_peers(me)
        log.error("%s", error)
        raise error

    def _timed_out(self, i: int, me: dict) -> None:
        """No verdict within the collective timeout: a rank that arrives later finds this
        point abandoned (it never completes the count) and raises with this call named."""
        self.close()
        self._publish(i, {**me, "gave_up": True})
        self.store.set(f"{i}/differ", "")
        self.store.add(f"{i}/n", _ABANDONED)
        self.store.set(f"{i}/go", "")
        raise UnmatchedCallError(
            f"rank {self.rank}: {me['name']} is collective {me['why']}, and not every rank {me['verb'][1]} it within "
            f"{self.timeout_s:g} s (Config.collective_timeout_s): the others are elsewhere (computing, or in a "
            f"collective of their own). {me['fix']}")

    def _tell_blocked_peers(self, me: dict) -> None:
        """Peers that went on into a training collective wait there until this process ends;
        their failure report ([Note: no silent hang] in failure.py) then reads what this rank
        publishes under its rank, as a failing collective would, and names the call."""
        failures = self.failures
        store = _group_store()
        if failures is None or store is None:
            return
        record = {"op": me["name"], "numel": 0, "phase": "call", "step": self.ledger.step if self.ledger else "-",
                  "label": f"collective {me['why']}; called on this rank only"}
        try:
            prefixed = dist.PrefixStore(f"zerodp/failure/{failures.namespace}/", store)
            prefixed.set(str(failures.rank), json.dumps(record))
            prefixed.add("reported", 1)
        except Exception as e:  # noqa: BLE001 - their error then says that this rank reported nothing
            log.warning("rank %d: could not publish the call for the blocked ranks (%s)", self.rank, e)


def _group_store() -> Optional[dist.Store]:
    """The default process group's store, where every rank meets (failure.py's reports too);
    torch exposes it only through a private accessor."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


def _underlying(store):
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def leave_all(raise_on_mismatch: bool) -> None:
    """This process leaves the process group (shutdown_distributed): every live Comm's
    points are told, so that a rank waiting in a call raises at once."""
    for points in list(_LIVE):
        points.leave("shutdown_distributed()", raise_on_mismatch)


def _leave_all_at_exit() -> None:
    for points in list(_LIVE):
        try:
            points.leave("the end of its process", raise_on_mismatch=False)
        except Exception:  # noqa: BLE001 - leaving anyway
            pass
