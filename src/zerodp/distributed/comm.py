"""The one door to torch.distributed: every collective zerodp issues passes through a
`Comm` (its gathers and reduce-scatters through the `Collectives` strategy of an axis) and
is recorded in its ledger (ledger.py).
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from .collectives import Collectives, check_device, default_collectives, guarded, wire_tag
from .failure import CollectiveError, FailureReport
from .ledger import CommLedger, CommRecord
from .sync_points import SyncPoints, leave_all
from .topology import AXES, Topology, forget_meshes

log = logging.getLogger(__name__)

__all__ = ["Comm", "init_distributed", "shutdown_distributed"]


class Comm:
    """Collectives over the data-parallel mesh (topology.py), each recorded in `ledger`.

    `rank` and `world_size` are this process's place among all data-parallel ranks;
    `shard_rank` and `shard_size` its place on the axis model states are sharded over.
    Every tensor must lie on `device` (the model's): see `check_device`.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, ledger: Optional[CommLedger] = None,
                 device: Optional[torch.device] = None, topology: Optional[Topology] = None):
        self.topology = topology if topology is not None else Topology.build(group, device)
        self.ledger = ledger if ledger is not None else CommLedger()
        self.device = self.topology.device
        self.rank, self.world_size = self.topology.rank, self.topology.world_size
        self.shard_rank, self.shard_size = self.topology.shard_rank, self.topology.shard_size
        self.ledger.inter_node_axes = frozenset(a for a in AXES
                                                if self.topology.crosses_nodes(a))
        self.failures = FailureReport(self.rank, self.world_size, self.topology.name, self.topology.timeout_s)
        # Calls made on some ranks only are refused on all of them: [Note: sync points] in sync_points.py.
        self.sync_points = SyncPoints.of(self)
        self._strategies: dict = {}

    def side_channel(self, timeout_s: float) -> "Comm":
        """A Comm over a new gloo group of the same data-parallel ranks (under tensor
        parallelism, of every rank, in global order), on the CPU, with a ledger of its own:
        for collectives a background thread issues while training's run (gloo pairs the
        collectives of one group by their order, so the two must not share one). Collective:
        every rank of the group calls it. A world of one needs no group."""
        group = self.topology.data_group
        if self.topology.tp_size > 1:  # a checkpoint spans the tensor-parallel ranks too: the whole world
            ranks = list(range(dist.get_world_size()))
        elif group is None:
            return Comm(topology=self.topology, ledger=CommLedger())
        else:
            ranks = dist.get_process_group_ranks(group)
        side = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend="gloo",
                              use_local_synchronization=len(ranks) != dist.get_world_size())
        return Comm(side, device=torch.device("cpu"))

    def collectives(self, axis: str = "shard") -> Collectives:
        """The default gather/reduce-scatter strategy on `axis` for this backend."""
        if axis not in self._strategies:
            t = self.topology
            strategy = default_collectives(t.backend)
            self._strategies[axis] = strategy(t.group(axis), axis, t.size(axis), t.rank_on(axis), self.ledger,
                                              self.device, self.failures)
        return self._strategies[axis]

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        check_device(self.device, self.rank, op, *tensors)

    def _peer(self, axis: str, rank: int) -> int:
        group = self.topology.group(axis)
        return dist.get_global_rank(group, rank) if group is not None else rank

    def _run(self, record: CommRecord, group: Optional[dist.ProcessGroup], call, *args, **kwargs):
        """Issue `call` on `group`; on gloo the ranks first agree that they all run this
        collective ([Note: gloo pairing] in collectives.py)."""
        agree_on = group if self.topology.backend == "gloo" else None
        return guarded(record, self.failures, call, *args, agree_on=agree_on, group=group, **kwargs)

    # A single process needs no communication; these shortcuts keep world size 1 free of
    # a process group while recording the same volume (0 moved between ranks either way).
    def all_reduce(self, tensor: torch.Tensor, phase: str, op=dist.ReduceOp.SUM, async_op: bool = False,
                   axis: str = "data", label: str = ""):
        self._check("all_reduce", tensor)
        record = self.ledger.record("all_reduce", tensor.numel(), tensor.numel() * tensor.element_size(), phase,
                                    axis, label)
        if self.topology.size(axis) == 1:
            return None
        return self._run(record, self.topology.group(axis), dist.all_reduce, tensor, op=op, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, phase: str, axis: str = "data", label: str = "") -> None:
        self._check("broadcast", tensor)
        record = self.ledger.record("broadcast", tensor.numel(), tensor.numel() * tensor.element_size(), phase,
                                    axis, label)
        if self.topology.size(axis) > 1:
            self._run(record, self.topology.group(axis), dist.broadcast, tensor, src=self._peer(axis, src))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list, input_splits: list,
                   phase: str, axis: str = "ep", label: str = "", uneven: bool = True) -> None:
        """Rank i's `input` rows [sum(input_splits[:j]), +input_splits[j]) to rank j, which
        receives them at its `output` rows for i (`output_splits[i]` of them): an
        all-to-all-v along dim 0, on `axis`. Recorded as the elements this rank sends
        (its `input`); `uneven`: the sizes differ between ranks by design (a token
        exchange), so the ranks' agreement on what they run compares the rest only."""
        self._check("all_to_all", output, input)
        record = self.ledger.record("all_to_all", input.numel(), input.numel() * input.element_size(), phase, axis,
                                    label, uneven=uneven)
        if self.topology.size(axis) == 1:
            output.copy_(input)
            return
        # gloo's is a tagged exchange that needs no agreement round ([Note: gloo all-to-all]).
        guarded(record, self.failures, self.collectives(axis).launch_all_to_all, output, input, output_splits,
                input_splits, wire_tag(record))

    def all_gather_object(self, obj, phase: str = "control", label: str = "", axis: str = "data") -> list:
        """Every rank's small Python object (agreement, checkpoint metadata) on `axis`: the
        data-parallel ranks, or the tensor-parallel group ("tp")."""
        record = self.ledger.record("all_gather_object", 0, 0, phase, axis, label=label)
        size = self.topology.size(axis)
        if size == 1:
            return [obj]
        out = [None] * size
        self._run(record, self.topology.group(axis), dist.all_gather_object, out, obj)
        return out

    def barrier(self, phase: str = "control", label: str = "") -> None:
        record = self.ledger.record("barrier", 0, 0, phase, label=label)
        if self.world_size > 1:
            self._run(record, self.topology.data_group, dist.barrier)

    # [Note: step fingerprint]
    # Ranks that issue different collectives usually fail at once (a timeout, mismatched
    # sizes), but not always: equal-sized collectives pair up across different calls (an
    # extra micro-batch's reduce-scatters against another rank's step all-gathers) and
    # train silently wrong (on NCCL; gloo's never pair: [Note: gloo pairing] in
    # collectives.py). The ledger keeps a CRC of every collective since the last step
    # (op, elements, bytes, phase, axis); before the master weights change, the ranks
    # all-reduce with MAX [nan/inf flag, crc, -crc]: one 24-byte collective per step, which
    # also carries the non-finite check the step needs anyway. max(crc) != -max(-crc) means
    # the sequences differ; only then are they gathered, to name the first difference.
    def agree_on_step(self, nonfinite: Optional[torch.Tensor] = None) -> bool:
        """Check the step fingerprint on every rank; returns whether any rank's `nonfinite`
        flag (a 0/1 tensor) is set. Raises `CollectiveError` if the ranks' collectives differ."""
        self.sync_points.before_training(f"optimizer.step() of step {self.ledger.step}")
        crc = float(self.ledger.fingerprint)
        t = torch.tensor([0.0, crc, -crc], dtype=torch.float64, device=self.device)
        if nonfinite is not None:
            t[0] = nonfinite.to(device=self.device, dtype=torch.float64)
        self.all_reduce(t, "control", op=dist.ReduceOp.MAX, label="step agreement")
        if self.topology.tp_size > 1:  # tensor-parallel ranks step (or skip) together too
            self.all_reduce(t, "control", op=dist.ReduceOp.MAX, axis="tp", label="step agreement")
        flag, high, neg_low = t.tolist()
        if high != -neg_low:
            self._raise_divergence()
        return flag > 0

    def _raise_divergence(self) -> None:
        mine = [(r.op, r.numel, r.nbytes, r.phase, r.axis, r.label) for r in self.ledger.current[:-1]]
        everyone = self.all_gather_object(mine)
        at = next((i for i in range(max(map(len, everyone)))
                   if len({seq[i] if i < len(seq) else None for seq in everyone}) > 1), 0)

        def shown(seq):
            if at >= len(seq):
                return f"nothing (it ran {len(seq)} collectives)"
            op, numel, _, phase, axis, label = seq[at]
            return f"{op}/{phase}{f' ({label})' if label else ''} of {numel:,} elements on the {axis} axis"
        detail = "; ".join(f"rank {r}: {shown(seq)}" for r, seq in enumerate(everyone)
                           if r == 0 or shown(seq) != shown(everyone[0]))
        raise CollectiveError(
            f"rank {self.rank}: the ranks ran different collectives in step {self.ledger.step}; the first that "
            f"differs is number {at + 1}: {detail}. Every rank must run the same forward and backward passes "
            f"(the same number of micro-batches, the same modules) between optimizer steps; the master weights "
            f"were not updated")

    def max_scalar(self, value: float, phase: str = "control", axis: str = "data") -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        self.all_reduce(t, phase, op=dist.ReduceOp.MAX, axis=axis)
        return float(t.item())

    def sum_scalar(self, value: torch.Tensor, phase: str = "control", axis: str = "data") -> torch.Tensor:
        t = value.detach().to(device=self.device, dtype=torch.float64).reshape(1).clone()
        self.all_reduce(t, phase, axis=axis)
        return t[0]


def init_distributed(backend: Optional[str] = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group torchrun describes in the environment, or run alone.

    With no RANK/WORLD_SIZE in the environment this is a single process (world size 1) and
    no process group is created. The backend is NCCL when CUDA is available, gloo otherwise.
    `timeout_s` bounds the default group's own collectives (5 minutes, not torch's 30);
    zerodp's collectives use `Config.collective_timeout_s`. Returns (rank, world_size).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return 0, 1
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s)
    one_node = os.environ.get("LOCAL_WORLD_SIZE") == str(world_size)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and one_node:
        # torchrun's agent keeps one store for every restart of the workers, so a restarted
        # worker can read its peers' addresses from the attempt before (measured: gloo then
        # fails "Connection refused" connecting to a dead rank). Each attempt gets keys of its
        # own. Only on one node: there every worker shares the agent's restart count, while
        # agents of several nodes count restarts each on their own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                    is_master=False, timeout=timeout)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"zerodp/attempt{attempt}/", agent_store),
                                rank=int(os.environ["RANK"]), world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    global _joined
    _joined = True  # zerodp's to leave at exit if the script does not: [Note: exit path]
    log.info("rank %d/%d joined with %s", dist.get_rank(), dist.get_world_size(), backend)
    return dist.get_rank(), dist.get_world_size()


# [Note: exit path]
# A gloo process group's worker threads outlive a script that returns without destroying
# it, and torch destroys a finished collective's work on the worker that ran it. If the
# work holds tensors Python made (all_gather_object's, the checkpoint channel's agreement),
# releasing them takes the GIL; a thread that asks for the GIL once the interpreter is
# finalizing is ended by CPython with pthread_exit, whose unwinding through the work's
# noexcept destructor calls std::terminate: "terminate called without an active
# exception", SIGABRT after the script's last line ran (core dump: ~AsyncAllgatherWork ->
# TensorImpl::decref_pyobject -> gil_scoped_acquire -> take_gil -> PyThread_exit_thread, in
# ProcessGroupGloo::runLoop, the main thread in Py_FinalizeEx). torch's part (pytorch
# #190489): it asks for destroy_process_group() before exit. destroy_process_group alone does
# not stop a gloo group's workers while anything still references the group (only freeing
# it joins them), so zerodp's exit path, `shutdown_distributed` and, for a script that
# returns without it, an atexit hook, runs while the interpreter is whole:
# 1. the work that must end first (`before_shutdown`): the background saves commit, their
#    agreement being a collective on the checkpoint channel;
# 2. the groups that work used are destroyed and every reference zerodp holds to them
#    dropped, so they are freed and their workers joined (torch frees a group with the GIL
#    released, so a worker waiting for it finishes first);
# 3. the default group and every group over it, when `init_distributed` joined it; a
#    script that called init_process_group itself destroys it itself, as torch asks;
# 4. the GIL is released for a moment (`_GIL_HANDOVER_S`). The groups the model and
#    optimizer still reference (training's) keep their workers, and the main thread has
#    held the GIL since the last collective returned, so a worker releasing that
#    collective's tensors is waiting for it; CPython hands it over only after a 5 ms switch
#    interval of bytecode, longer than the rest of a script's exit takes. A worker still
#    waiting when finalization starts is the one killed.
# At exit there is no barrier: a peer still in a collective would pair it with the wrong
# call; the process ends either way. tests/test_exit_path.py runs such scripts to their
# exit.
_BEFORE_SHUTDOWN: list = []  # (finish, close) pairs, registered by higher layers, which distributed/ may not import
_joined = False  # whether init_distributed created the default group
_GIL_HANDOVER_S = 0.05  # step 4: ample for a waiting thread to be scheduled, small beside an exit


def before_shutdown(finish, close=None) -> None:
    """Run `finish()` (on every rank) when `shutdown_distributed` waits for the other ranks,
    and at exit; then `close()`, which destroys the process groups of the caller's own, at
    every shutdown ([Note: exit path])."""
    if (finish, close) not in _BEFORE_SHUTDOWN:
        _BEFORE_SHUTDOWN.append((finish, close))


def _close_own_groups() -> None:
    for _, close in list(_BEFORE_SHUTDOWN):
        if close is not None:
            close()


def shutdown_distributed(wait: Optional[bool] = None) -> None:
    """Leave the process group joined by `init_distributed`. Every rank waits for the others
    first, so that no rank tears its connections down while a peer is still finishing its
    last collective (with gloo that aborts the peer). Called while an exception propagates
    (from a `finally:`), it does not wait: the peers may never reach the barrier, and the
    rank's own error must surface rather than hang; closing the group makes the peers fail
    promptly. After an error handled in an `except`, the exception is gone: pass
    `wait=False` there (a barrier cannot be bounded while a peer sits in another
    collective). A no-op in a single process."""
    global _joined
    if dist.is_available() and dist.is_initialized():
        if wait is None:
            wait = sys.exc_info()[0] is None
        leave_all(raise_on_mismatch=wait)  # a rank waiting in a call this one skipped raises now: [Note: sync points]
        if wait:
            for finish, _ in list(_BEFORE_SHUTDOWN):  # e.g. an asynchronous checkpoint's commit
                finish()
            dist.barrier()
        else:
            log.error("rank %d: leaving the process group without waiting for the other ranks", dist.get_rank())
        _close_own_groups()
        forget_meshes()
        dist.destroy_process_group()
        _joined = False
        time.sleep(_GIL_HANDOVER_S)  # [Note: exit path], step 4


@atexit.register
def _leave_at_exit() -> None:
    """[Note: exit path], for a script that returns without `shutdown_distributed`."""
    used_groups = dist.is_available() and dist.is_initialized()
    for finish, _ in list(_BEFORE_SHUTDOWN):
        try:
            finish()
        except Exception as e:  # noqa: BLE001 - at exit there is no one to raise to
            log.error("%s", e)
    try:
        _close_own_groups()
        if _joined and dist.is_available() and dist.is_initialized():
            log.info("rank %d: leaving the process group at exit (zerodp.shutdown_distributed was not called)",
                     dist.get_rank())
            forget_meshes()
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - at exit there is no one to raise to
        log.error("rank %s: leaving the process group at exit failed: %s", os.environ.get("RANK", "?"), e)
    if used_groups:
        time.sleep(_GIL_HANDOVER_S)  # step 4
