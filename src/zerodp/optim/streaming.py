"""Offloaded gradients streamed to the host during backward (ZeRO-Offload, arXiv 2101.06840 §4.1).

[Note: gradient streaming]
With the master on the host ([Note: master placement] in master.py), every owned gradient piece is copied into its
host fp32 buffer before the step. Waiting for the step to copy them all leaves the link idle
during backward and the step waiting on it. The backward schedule instead announces each
storage part whose owned gradient is final (`BackwardSchedule.on_final_grads`: a stage-3 unit,
or one bucket of a stage 1-2 group, once its last reduction of the accumulation window has
landed), and its pieces are copied at once (non-blocking from device to pinned memory on
CUDA), overlapping the rest of backward; the step then copies only what was not streamed.
The values are the same either way (the copy reads the final reduced gradient), so the
results are bit for bit those of copying at the step. Off under the delayed update, whose
host step still reads the buffers while the next backward runs.
"""
from __future__ import annotations

import bisect

__all__ = ["GradStreamer"]


class GradStreamer:
    """Which master pieces already hold their final gradient, by shard."""

    def __init__(self, shards: list):
        # What the schedule announces -> [(shard, piece index)] it finalises.
        self._targets: dict = {}
        for shard in shards:
            if not shard.grad_staging:
                continue  # no host buffer to fill (the shard's gradient is on the host already)
            storage = shard.storage
            unit = getattr(storage, "unit", None)
            if unit is None:  # a stage 1-2 group: its pieces by the segment (bucket) they lie in
                starts = [seg.start for seg in storage.layout.segments]
            for i, piece in enumerate(storage.owned_pieces()):
                key = id(unit) if unit is not None else (id(storage), bisect.bisect_right(starts, piece.flat_start) - 1)
                self._targets.setdefault(key, []).append((shard, i))
        self.staged: set = set()  # (id(shard), piece index) copied since the last step
        self.streamed_pieces = 0  # copied during backward since initialize, for tests and tuning

    def on_final_grads(self, storage, segment=None) -> None:
        """`storage`'s owned gradient is final: a stage-3 unit (segment None), or segment
        `segment` of a stage 1-2 flat group."""
        key = id(storage) if segment is None else (id(storage), segment)
        for shard, i in self._targets.get(key, ()):
            shard.stage_grad(i)
            self.staged.add((id(shard), i))
            self.streamed_pieces += 1

    def take(self, shard) -> set:
        """The piece indices of `shard` already copied; they count as consumed."""
        mine = {i for s, i in self.staged if s == id(shard)}
        self.staged -= {(id(shard), i) for i in mine}
        return mine

    def clear(self) -> None:
        self.staged.clear()
