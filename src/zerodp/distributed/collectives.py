"""Gather and reduce-scatter strategies: how a flat buffer's chunks move along one mesh axis.

A strategy is chosen per flat group or stage-3 unit (`Comm.collectives(axis)` gives the
default for the process group's backend) and is the one place where its all-gathers and
reduce-scatters are issued and recorded. A new way of moving the same bytes (quantized
weights or gradients, a hierarchical reduce) is a new subclass, plugged in where the
group or unit is built; nothing above this module changes.
"""
from __future__ import annotations

import time
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from .failure import CollectiveError, FailureReport, describe_record
from .ledger import CommLedger, CommRecord

__all__ = ["Collectives", "NativeCollectives", "GlooCollectives", "Works", "default_collectives", "guarded",
           "wire_tag"]


# [Note: gloo pairing]
# gloo pairs the n-th collective a rank issues on a process group with the n-th of every
# other rank, whatever each one is. Two that differ in size are not an error it raises:
# its I/O thread aborts the receiving process ("op.preamble.length <= op.nbytes. 544 vs
# 136 ... collective mismatch"), which no Python code can catch or report, and the other
# rank only sees a peer that exited. A rank that gathers alone (`gathered_parameters` or an
# eval forward under `if rank == 0` at stage 3, with units of different sizes) killed its
# peer that way, and [Note: no silent hang] in failure.py never ran. So on gloo no
# collective of zerodp may pair with a different one:
# - all-gathers and reduce-scatters (GlooCollectives) are point-to-point sends and
#   receives whose tag is a checksum of the collective (`wire_tag`: op, elements, bytes,
#   phase, axis, and the unit or bucket it moves). A rank in another collective sends
#   and waits under another tag: nothing pairs, both time out, and the failure report
#   names where each rank was. Free: no message beyond the data.
# - all-to-alls on gloo are the same kind of tagged exchange ([Note: gloo all-to-all]);
# - every other collective (all-reduce, broadcast, barrier, object gathers)
#   is preceded by a 16-byte all-reduce of that checksum, labels aside (`agree_before`):
#   ranks about to run different collectives find out there, together, and raise a
#   CollectiveError naming what each was about to run. One more small message per such
#   call (0.1-0.5 ms on CPU); it is not in the ledger, which counts what zerodp moves.
# This is stricter than the step fingerprint ([Note: step fingerprint] in comm.py), which
# stays for NCCL: there, mismatched collectives pair silently or hang until the timeout.
GLOO_TAG_MASK = 0x7FFFFFFF  # gloo's point-to-point tags are non-negative 32-bit integers


def wire_tag(record: CommRecord, with_label: bool = True) -> int:
    """A checksum of what a collective is, equal on every rank that runs the same one. The
    label of a gather or reduce-scatter names what it moves (a unit, a bucket, a row), the
    same on every rank; other collectives' labels are free text (a checkpoint's path, which
    ranks may spell differently), left out with `with_label=False`."""
    label = record.label if with_label else ""
    key = f"{record.op}:{record.agreed_sizes}:{record.phase}:{record.axis}:{label}"
    return zlib.crc32(key.encode()) & GLOO_TAG_MASK

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Works:
    """Several in-flight collectives as one handle (wait / is_completed), running `then`
    once, on the first wait after all are done. With `record` and `failures`, an error
    while waiting becomes a `CollectiveError` naming every rank ([Note: no silent hang])."""

    def __init__(self, works: list, then=None, record: Optional[CommRecord] = None,
                 failures: Optional[FailureReport] = None, started: Optional[float] = None):
        self.works, self.then, self.record, self.failures = works, then, record, failures
        self.started = time.monotonic() if started is None else started  # when it was issued

    def is_completed(self) -> bool:
        try:
            return all(w.is_completed() for w in self.works)
        except Exception as e:  # noqa: BLE001 - reported with every rank's whereabouts
            self._failed(e)

    def wait(self) -> bool:
        try:
            for w in self.works:
                w.wait()
        except Exception as e:  # noqa: BLE001
            self._failed(e)
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def _failed(self, error: BaseException) -> None:
        if self.failures is None:
            raise error
        self.failures.raise_for(self.record, error, self.started)

    def finish(self, async_op: bool):
        if async_op:
            return self
        self.wait()
        return None


def guarded(record: CommRecord, failures: Optional[FailureReport], call, *args,
            agree_on: Optional[dist.ProcessGroup] = None, **kwargs):
    """Issue one torch.distributed call; a failure now or at its wait becomes a
    `CollectiveError` naming every rank ([Note: no silent hang] in failure.py). With
    `agree_on` (the call's group, when its backend is gloo), the ranks first check that
    they are all about to run this same collective ([Note: gloo pairing])."""
    started = time.monotonic()
    try:
        if agree_on is not None:
            agree_before(record, agree_on)
        work = call(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        if failures is None:
            raise
        failures.raise_for(record, e, started)
    return Works([work], record=record, failures=failures, started=started) if work is not None else None


def pairs_by_order(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether collectives on `group` need `agree_before`: gloo's ([Note: gloo pairing])."""
    return dist.get_backend(group) == "gloo"


def agree_before(record: CommRecord, group: dist.ProcessGroup) -> None:
    """Raise a `CollectiveError` on every rank of `group` unless all of them are about to
    run the collective `record` describes ([Note: gloo pairing]). The ranks stay in step
    (each raised at the same point) and the group stays usable."""
    tag = wire_tag(record, with_label=False)
    header = torch.tensor([tag, -tag], dtype=torch.int64)
    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group)
    high, neg_low = header.tolist()
    if high == -neg_low:
        return
    # Every rank saw the difference at this same all-reduce: they are in step for one more.
    mine = describe_record(record)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    me = dist.get_rank(group)
    shown = "; ".join(f"rank {dist.get_global_rank(group, r)}: {d}" for r, d in enumerate(everyone))
    raise CollectiveError(
        f"rank {dist.get_global_rank(group, me)}: the ranks were about to run different collectives ({shown}). "
        f"Every rank must run the same forward, backward, step, clip_grad_norm_, save and gathered_parameters "
        f"calls in the same order: one under `if rank == 0` (logging weights, an eval forward at stage 3) must "
        f"run on every rank")


def check_device(device: torch.device, rank: int, op: str, *tensors: torch.Tensor) -> None:
    """NCCL only moves CUDA tensors, so a CPU tensor sent on an NCCL group fails at run
    time; checking here makes a CPU-only (gloo) run catch the same mistake."""
    for t in tensors:
        if t.device != device:
            raise ValueError(f"rank {rank}: {op} got a tensor on {t.device}, but this process group "
                             f"communicates tensors on {device}: create it on the model's device")


class Collectives:
    """All-gather and reduce-scatter of equal chunks over one axis's process group.

    Pure functions of tensors: nothing here knows about modules or parameters. Each call
    is recorded in the ledger with the bytes `wire_nbytes` says it sends."""

    def __init__(self, group: Optional[dist.ProcessGroup], axis: str, size: int, rank: int,
                 ledger: CommLedger, device: torch.device, failures: Optional[FailureReport] = None):
        self.group, self.axis, self.size, self.rank = group, axis, size, rank
        self.ledger, self.device, self.failures = ledger, device, failures

    def wire_nbytes(self, full: torch.Tensor) -> int:
        """Bytes the collective of the full tensor `full` sends: its own size, unless a
        strategy encodes what it sends."""
        return full.numel() * full.element_size()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, phase: str, async_op: bool = False,
                   label: str = ""):
        """Concatenate every rank's `input` chunk into `output` (the full tensor)."""
        return self._issue("all_gather", output, input, output, phase, label, self.launch_all_gather, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, phase: str, async_op: bool = False,
                       label: str = ""):
        """Sum `input` (the full tensor) over ranks; this rank receives its chunk in `output`."""
        return self._issue("reduce_scatter", output, input, input, phase, label, self.launch_reduce_scatter,
                           async_op)

    def _issue(self, op: str, output: torch.Tensor, input: torch.Tensor, full: torch.Tensor, phase: str,
               label: str, launch, async_op: bool):
        record = self._record(op, output, input, full, phase, label)
        if record is None:
            return None
        return guarded(record, self.failures, launch, output, input, async_op, wire_tag(record))

    def _record(self, op: str, output: torch.Tensor, input: torch.Tensor, full: torch.Tensor, phase: str,
                label: str) -> Optional[CommRecord]:
        """Check and record one collective whose full tensor is `full`; None when there is
        nothing to send (one rank on the axis: the result is a copy, and the same volume
        is recorded either way)."""
        self.check_sizes(op, output, input, full)
        record = self.ledger.record(op, full.numel(), self.wire_nbytes(full), phase, self.axis, label)
        if self.size > 1:
            return record
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None


    def check_sizes(self, op: str, output: torch.Tensor, input: torch.Tensor, full: torch.Tensor) -> None:
        """The tensors lie on the group's device and the full one is the chunk x the axis size."""
        check_device(self.device, self.rank, op, output, input)
        chunk = input if full is output else output
        if full.numel() != chunk.numel() * self.size:
            raise ValueError(f"{op}: the full tensor has {full.numel()} elements and the chunk {chunk.numel()}; "
                             f"the full one must be the chunk x the {self.axis} axis size ({self.size})")

    def launch_all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool, tag: int = 0):
        """Issue the all-gather; `tag` is `wire_tag` of its record, for strategies that pair
        their messages by it ([Note: gloo pairing])."""
        raise NotImplementedError

    def launch_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool, tag: int = 0):
        raise NotImplementedError

    def launch_all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list,
                          input_splits: list, tag: int = 0) -> None:
        """Issue and finish an all-to-all-v along dim 0 (`Comm.all_to_all`)."""
        raise NotImplementedError


class NativeCollectives(Collectives):
    """torch's single-tensor collectives: NCCL's fast ones, used unchanged."""

    def launch_all_gather(self, output, input, async_op, tag=0):
        return _all_gather_single(output, input, group=self.group, async_op=async_op)

    def launch_reduce_scatter(self, output, input, async_op, tag=0):
        return _reduce_scatter_single(output, input, group=self.group, async_op=async_op)

    def launch_all_to_all(self, output, input, output_splits, input_splits, tag=0):
        dist.all_to_all_single(output, input, output_split_sizes=list(output_splits),
                               input_split_sizes=list(input_splits), group=self.group)


class GlooCollectives(Collectives):
    """[Note: gloo all-gather and reduce-scatter]
    gloo's all-gather and reduce-scatter stage every call through freshly allocated flat
    buffers and extra copies, and run at half the speed of its in-place send/recv. So on
    gloo both are direct exchanges of point-to-point messages: in an all-gather each rank
    sends its chunk straight into every other rank's slot for it; in a reduce-scatter each
    rank sends chunk s to rank s and sums the N-1 chunks it receives into its own. Each
    rank sends and receives the same bytes as with the ring versions, so the ledger
    records the same volume. Measured on a 28 MB buffer, N=2, CPU, median of 30 calls:
    all-gather 13.8-14.8 ms as N in-place broadcasts, the form used before (the exchange:
    10.7-11.2 ms against the broadcasts' 12.0-12.2 ms, interleaved on one machine) vs
    21.6-26.7 ms (gloo's list form; single-tensor form 30-38 ms); reduce-scatter 14.7 ms
    vs 30.1-34.1 ms (list form). Every message carries the collective's `wire_tag`, so a
    rank in another collective never pairs with it ([Note: gloo pairing])."""

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def launch_all_gather(self, output, input, async_op, tag=0):
        n, r = self.size, self.rank
        chunks = output.chunk(n)
        if chunks[r].data_ptr() != input.data_ptr():
            chunks[r].copy_(input)
        works = []
        for k in range(1, n):  # round k: send ours to rank r+k, receive rank r-k's into its slot
            works.append(dist.isend(chunks[r], self._peer((r + k) % n), group=self.group, tag=tag))
            works.append(dist.irecv(chunks[(r - k) % n], self._peer((r - k) % n), group=self.group, tag=tag))
        return Works(works).finish(async_op)

    def launch_reduce_scatter(self, output, input, async_op, tag=0):
        n, r = self.size, self.rank
        chunks = input.chunk(n)
        received = [torch.empty_like(chunks[r]) for _ in range(n - 1)]
        works = []
        for k in range(1, n):  # round k: send chunk r+k to its owner, receive ours from r-k
            works.append(dist.isend(chunks[(r + k) % n], self._peer((r + k) % n), group=self.group, tag=tag))
            works.append(dist.irecv(received[k - 1], self._peer((r - k) % n), group=self.group, tag=tag))

        def then():
            rest = received
            if output.dtype == chunks[r].dtype:  # one pass for the first sum, in the same order
                torch.add(chunks[r], received[0], out=output)
                rest = received[1:]
            elif output.data_ptr() != chunks[r].data_ptr():  # summed in the output's dtype
                output.copy_(chunks[r])
            for t in rest:
                output.add_(t)
        return Works(works, then).finish(async_op)

    def launch_all_to_all(self, output, input, output_splits, input_splits, tag=0):
        """[Note: gloo all-to-all]
        An all-to-all-v along dim 0 on gloo is point-to-point messages tagged with the
        collective's `wire_tag`, as its all-gathers are ([Note: gloo all-gather and
        reduce-scatter]): in round k rank r's rows for rank r+k go out while rank r-k's land in
        their slot of `output`; its own rows are copied. torch's `all_to_all_single` would need
        the agreement round before it ([Note: gloo pairing]), a second exchange on which every
        rank of the group waits for the others; the tags make it unnecessary. Measured at N=4
        on a 2-core CPU (median of 300, interleaved), a count exchange then a 256 KiB row
        exchange: 6.1 ms against 8.1 ms with all_to_all_single after the agreement. Sending
        the rows with their counts in one round (the receiver posting its receives once the
        counts arrive) measured 7.6 ms: the senders' rows wait on the receivers anyway. Both
        sides of a pair know its size (the caller's splits), so an empty piece sends no
        message. The ledger's record and its bytes are the single call's."""
        n, r = self.size, self.rank
        ins, outs = input.split(list(input_splits)), output.split(list(output_splits))
        works = []
        for k in range(1, n):
            to, frm = (r + k) % n, (r - k) % n
            if ins[to].numel():
                works.append(dist.isend(ins[to].contiguous(), self._peer(to), group=self.group, tag=tag))
            if outs[frm].numel():
                works.append(dist.irecv(outs[frm], self._peer(frm), group=self.group, tag=tag))
        outs[r].copy_(ins[r])
        for w in works:
            w.wait()


def default_collectives(backend: Optional[str]) -> type[Collectives]:
    """The strategy for a backend: gloo's own exchange on gloo, torch's collectives elsewhere."""
    return GlooCollectives if backend == "gloo" else NativeCollectives
