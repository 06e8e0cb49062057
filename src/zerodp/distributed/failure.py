"""What every rank says when a collective fails: which ranks did not arrive, and where each was.

[Note: no silent hang]
zerodp's collectives run on process groups of its own whose timeout is
`Config.collective_timeout_s` (topology.py), far below torch's 30-minute default. Each
collective is recorded in the ledger before it is issued (op, elements, phase, step and a
label: the unit or bucket), which costs nothing beyond the record the ledger keeps anyway.
Only when a collective raises (a timeout, or a peer that is gone: gloo's "Connection
closed by peer") does a rank publish its failing record under its rank in the process
group's store and read what the others published for a few seconds. Ranks that were in
the same collective arrived; a rank that was in another one, or published nothing (it
exited, or it is computing outside any collective), is named with what it reported. The
error raised, `CollectiveError`, says all of it on every rank that reaches a collective.
On NCCL, errors are asynchronous: `wait()` does not raise and torch's watchdog aborts the
process after the timeout, so this report runs only with TORCH_NCCL_BLOCKING_WAIT=1 (not
yet run on CUDA); the timeout itself holds either way.
"""
from __future__ import annotations

import json
import logging
import pickle
import re
import time
from typing import Optional

import torch.distributed as dist

from .ledger import CommRecord

log = logging.getLogger(__name__)

__all__ = ["CollectiveError", "FailureReport"]

# How long a failing rank waits for the others' reports, at most: one collective timeout
# when that is shorter. A peer still inside a collective when ours timed out entered it less
# than one timeout after ours began, so its own times out (and reports) within one timeout of
# ours; a peer that reports nothing by then was outside every collective when ours failed.
REPORT_WAIT_S = 5.0

# Errors a collective call raises for its own arguments (a wrong tensor, an object that does
# not pickle): passed on as they are, the process group is fine.
LOCAL_ERRORS = (TypeError, ValueError, AttributeError, pickle.PickleError)

# Reports of one mesh's failures, one namespace per Comm built over it: every rank builds its
# Comms in the same order (initialize is collective), so the n-th is the n-th everywhere,
# and a later initialize never reads an earlier failure's reports.
_GENERATIONS: dict = {}


class CollectiveError(RuntimeError):
    """A collective timed out or lost a peer; the message names the ranks and where each was."""


def describe(record: Optional[dict]) -> str:
    if record is None:
        return "nothing"
    where = f" ({record['label']})" if record.get("label") else ""
    size = f" of {record['numel']:,} elements" if record["numel"] else ""
    return f"{record['op']}/{record['phase']}{where}{size}, step {record['step']}"


def as_dict(record: CommRecord) -> dict:
    """What a rank publishes about its collective (plain data, for the store)."""
    return {"op": record.op, "numel": record.numel, "phase": record.phase, "step": record.step,
            "label": record.label}


def describe_record(record: CommRecord) -> str:
    return describe(as_dict(record))


# How a collective's error reads when the peer's process is gone (gloo, TCPStore), not late.
_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "closed by peer", "connection refused",
              "end of file")


def what_happened(error: BaseException, elapsed_s: Optional[float], timeout_s: Optional[float]) -> str:
    """The failure as it was: a timeout (after how long, of which limit), a peer that
    closed its connection (its process exited or crashed) and when, or the backend's own
    words; the backend's text is kept, without its source location or advice."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[/path/pair.cc:553] "
    text = text.split(". This is typically", 1)[0][:300]
    after = f" after {elapsed_s:.1f} s" if elapsed_s is not None else ""
    limit = f" (Config.collective_timeout_s={timeout_s:g} s)" if timeout_s else ""
    lowered = text.lower()
    if any(s in lowered for s in _PEER_GONE):
        return (f"failed{after}: a peer closed its connection ({text}): its process exited or crashed, or it gave "
                f"up waiting in a collective of its own")
    if "timed out" in lowered or "timeout" in type(error).__name__.lower():
        return f"timed out{after}{limit}: {text}"
    return f"failed{after}: {text}"


def _default_store():
    """The store every rank of the default process group shares, or None. torch exposes it
    only through a private accessor; without it the error names this rank's collective alone."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


class FailureReport:
    """Turns an exception from a collective into a `CollectiveError` naming every rank."""

    def __init__(self, rank: int, world_size: int, namespace: str, timeout_s: Optional[float]):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        _GENERATIONS[namespace] = _GENERATIONS.get(namespace, 0) + 1
        self.namespace = f"{namespace}/{_GENERATIONS[namespace]}"
        self.reported: Optional[CollectiveError] = None

    def raise_for(self, record: CommRecord, error: BaseException, started: Optional[float] = None) -> None:
        """Publish this rank's failing collective, gather the others' and raise. `started`:
        when the collective was issued (time.monotonic()), to say how long it ran."""
        if isinstance(error, LOCAL_ERRORS):  # a mistake in this rank's own call, not a lost peer
            raise error
        if isinstance(error, CollectiveError):
            raise error
        if self.reported is not None:  # the group is broken: every later collective fails alike
            raise CollectiveError(str(self.reported)) from error
        # Measured now: the exchange below waits for the peers' reports, which is not the collective's time.
        elapsed = None if started is None else time.monotonic() - started
        mine = as_dict(record)
        others = self._exchange(mine)
        lines = [f"rank {self.rank}: collective {describe(mine)} {what_happened(error, elapsed, self.timeout_s)}."]
        missing = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            theirs = others.get(r)
            if theirs == mine:
                continue
            missing.append(r)
            lines.append(f"rank {r} " + (f"was in {describe(theirs)}." if theirs is not None else
                                         "reported nothing: it exited, or is computing outside any collective "
                                         "(an exception of its own, a hang, another code path)."))
        if missing:
            lines.insert(1, f"ranks {missing} did not arrive.")
        else:
            lines.insert(1, "every rank reported this collective: the network or a peer process failed.")
        if any(r.get("phase") == "checkpoint" for r in [mine, *others.values()] if r):
            lines.append("zerodp.save and zerodp.load must be called on every rank (each rank writes and reads "
                         "its own shard), not under `if rank == 0`.")
        lines.append("Every rank must run the same forward (eval ones too), backward, step and gathered_parameters "
                     "calls in the same order (at stage 3 each gathers parameters: under `if rank == 0` it runs "
                     "on one rank only); an error on one rank fails the others at their next collective.")
        self.reported = CollectiveError(" ".join(lines))
        log.error("%s", self.reported)
        raise self.reported from error

    def _exchange(self, mine: dict) -> dict:
        store = _default_store()
        if store is None:
            return {}
        others: dict = {}
        try:
            prefixed = dist.PrefixStore(f"zerodp/failure/{self.namespace}/", store)
            prefixed.set(str(self.rank), json.dumps(mine))
            # One counter to poll, not every peer's key: N failing ranks make O(N) requests.
            reported = prefixed.add("reported", 1)
            deadline = time.monotonic() + min(REPORT_WAIT_S, self.timeout_s or REPORT_WAIT_S)
            while reported < self.world_size and time.monotonic() < deadline:
                time.sleep(0.1)
                reported = prefixed.add("reported", 0)
            for r in range(self.world_size):
                if r != self.rank and prefixed.check([str(r)]):
                    others[r] = json.loads(prefixed.get(str(r)))
        except Exception as e:  # noqa: BLE001 - the store may be gone with the peer; report what we have
            log.warning("rank %d: could not exchange failure reports through the store (%s)", self.rank, e)
        return others

