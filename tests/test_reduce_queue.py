"""The reduce queue shared by stages 0-3 (schedule/base.py), single-process with fake items:
launch order, the bound on reductions in flight, the replicate-axis sum and the final
gradient announcement."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from zerodp.schedule.base import MAX_IN_FLIGHT, ReduceQueue


class Work:
    def __init__(self, log, name):
        self.log, self.name, self.done = log, name, False

    def is_completed(self):
        return self.done

    def wait(self):
        self.log.append(("wait", self.name))


class Item:
    """What a bucket or a unit offers the queue."""

    def __init__(self, log, name, scattered=True, async_work=True):
        self.log, self.label, self.scattered, self.async_work = log, name, scattered, async_work
        self.storage_part = (name, None)
        self.ready_to_reduce, self.accumulates = False, False

    def launch_reduce(self, accumulate, async_op):
        self.log.append(("launch", self.label, accumulate, async_op))
        return Work(self.log, self.label) if self.async_work else None

    def reduced_chunk(self, accumulate):
        return f"chunk of {self.label}"

    def finish_reduce(self, accumulate):
        self.log.append(("finish", self.label, accumulate))


def schedule(log, replicate_size=1, at_boundary=True, reduces_now=True):
    comm = SimpleNamespace(topology=SimpleNamespace(replicate_size=replicate_size),
                           all_reduce=lambda t, phase, axis, label: log.append(("all_reduce", t, phase, axis, label)))
    return SimpleNamespace(comm=comm, reduces_now=reduces_now, at_boundary=at_boundary,
                           on_final_grads=lambda *part: log.append(("final", *part)),
                           meet_before_training=lambda doing: log.append(("met", doing)),
                           adopt_recorded_order=lambda order: [2, 0, 1])


def test_launches_in_order_up_to_the_first_not_ready_and_flush_launches_the_rest():
    log = []
    items = [Item(log, f"b{i}", async_work=False) for i in range(3)]
    queue = ReduceQueue(schedule(log), items, [2, 0, 1], async_op=False)
    items[0].ready_to_reduce = True
    queue.launch_ready()
    assert log == []  # item 2 comes first and is not ready
    items[2].ready_to_reduce = True
    queue.launch_ready()
    assert [e[1] for e in log if e[0] == "launch"] == ["b2", "b0"]
    assert log[0] == ("met", "the backward")  # the sync point before its first collective ([Note: sync points])
    queue.flush()
    assert [e[1] for e in log if e[0] == "launch"] == ["b2", "b0", "b1"]
    assert [e[1] for e in log if e[0] == "finish"] == ["b2", "b0", "b1"]
    queue.adopt_recorded_order()
    queue.rewind()
    assert queue.order == [2, 0, 1]


def test_at_most_max_in_flight_wait_behind_the_wire():
    log = []
    items = [Item(log, f"u{i}") for i in range(MAX_IN_FLIGHT + 2)]
    for item in items:
        item.ready_to_reduce = True
    queue = ReduceQueue(schedule(log), items, list(range(len(items))), async_op=True)
    queue.launch_ready()
    # Nothing completes on its own: each launch past the bound waits for the oldest.
    assert [e[1] for e in log if e[0] == "wait"] == ["u0", "u1"]
    assert [e[1] for e in log if e[0] == "finish"] == ["u0", "u1"]
    queue.wait_all()
    assert [e[1] for e in log if e[0] == "finish"] == [f"u{i}" for i in range(len(items))]


@pytest.mark.parametrize("replicate_size", [1, 2])
def test_replicate_sum_for_scattered_items_and_announcement_at_the_boundary(replicate_size):
    log = []
    items = [Item(log, "bucket 0"), Item(log, "bucket 1", scattered=False)]
    queue = ReduceQueue(schedule(log, replicate_size), items, [0, 1], async_op=True)
    queue.flush()
    sums = [e for e in log if e[0] == "all_reduce"]
    assert sums == ([("all_reduce", "chunk of bucket 0", "backward", "replicate", "bucket 0")]
                    if replicate_size > 1 else [])
    assert [e for e in log if e[0] == "final"] == [("final", "bucket 0", None), ("final", "bucket 1", None)]
    # Summed over the replicas before it lands, announced once it has.
    names = [e[0] for e in log]
    assert names.index("finish") < names.index("final")
    if replicate_size > 1:
        assert names.index("all_reduce") < names.index("finish")


def test_after_a_failed_backward_no_collective_and_no_announcement():
    log = []
    items = [Item(log, "unit a"), Item(log, "unit b")]
    for item in items:
        item.ready_to_reduce = True
    queue = ReduceQueue(schedule(log, replicate_size=2), items, [0, 1], async_op=True)
    queue.launch_ready()
    log.clear()
    queue.wait_all(failed=True)
    assert [e[0] for e in log] == ["wait", "finish", "wait", "finish"]


def test_nothing_launches_in_a_backward_that_does_not_reduce():
    log = []
    items = [Item(log, "unit a")]
    items[0].ready_to_reduce = True
    queue = ReduceQueue(schedule(log, reduces_now=False), items, [0], async_op=True)
    queue.launch_ready(flush=True)
    assert log == []


def test_accumulation_is_read_at_launch_and_passed_through():
    log = []
    item = Item(log, "bucket 0", async_work=False)
    item.ready_to_reduce, item.accumulates = True, True
    queue = ReduceQueue(schedule(log, at_boundary=False), [item], [0], async_op=False)
    queue.launch_ready()
    assert log == [("met", "the backward"), ("launch", "bucket 0", True, False),
                   ("finish", "bucket 0", True)]  # no announcement
