"""Stage 3's units whose forward runs on some ranks only: the part of the engine that keeps
every rank's gathers and reductions alike whatever its data reached.

[Note: units run on some ranks]
A unit whose forward runs on some ranks only (an expert that is a unit of its own, which no
token reached on this rank) would be gathered, backpropagated and reduced there only. So:
- a training forward gathers the units in one order on every rank (registration order until
  the first backward, then the order the forwards ran them in): a rank that reaches a unit
  past units it did not run gathers those first, in that order, and frees them at once, and
  the root's end passes any left; a unit run again (a block called twice) is gathered as it
  comes, as on every rank. Each rank thus issues the forward's gathers the others issue.
- the first hook of each backward pass gathers from every rank which units it ran (one
  small all-gather). A unit run on some ranks only is then gathered on every rank (freed at
  once where it did not run), and reduced when the backward ends, after the other units, on
  every rank (zeros where it did not run); its own backward issues no collective. So the
  ranks' sequences stay alike whatever each one's data reached.
Cost: the all-gather, once per backward; a unit run on some ranks only stays gathered from
the start of backward to its own backward, and its gradient from then to the end of
backward; a unit no rank ran in a training forward is gathered there all the same. The
order is that of first calls: a rank that skips a unit and then calls an earlier one again
(a block called twice) is elsewhere in it than a rank that ran the unit, and so are ranks
that run units in an order of their data's choosing; those still part ways (Config.debug
names where).
"""
from __future__ import annotations

import torch


class UnitUsage:
    """Stage3Engine's handling of [Note: units run on some ranks]; a mixin over the engine's
    units, order, queue and gathers."""

    def _visit(self, ui: int) -> None:
        """A training forward reaches unit `ui`: first gather, in order, the units before it
        that this rank did not run ([Note: units run on some ranks])."""
        if self._ran_stale:
            self._ran, self._ran_stale = [False] * len(self.units), False
        self._ran[ui] = True
        if ui == self.root:
            self._cursor = 0
            return
        at = self._position.get(ui)
        if at is None or at < self._cursor:
            return
        self._pass_over(self._catchup[self._cursor:at])
        self._cursor = at + 1

    def _pass_over(self, skipped: list[int]) -> None:
        """What a forward of each unit does with collectives, without running it: gather,
        prefetch the next ones, free."""
        for ui in skipped:
            self._gather(ui, "forward", async_op=False)
            self._prefetch(self.forward_order, ui, "forward")
            self.units[ui].reshard()

    def _agree_on_units_run(self) -> None:
        """At the start of a backward pass: which units the forwards before it ran on every
        rank, some ranks, or none ([Note: units run on some ranks])."""
        ran = torch.tensor(self._ran, dtype=torch.int32, device=self.comm.device)
        n = self.comm.world_size
        everyone = torch.empty(n * len(ran), dtype=ran.dtype, device=ran.device)
        # An all-gather: on gloo one exchange of tagged messages, where an all-reduce is preceded by
        # an agreement of its own ([Note: gloo pairing] in distributed/collectives.py).
        self.comm.collectives("data").all_gather(everyone, ran, "control", label="units each rank ran")
        counts = everyone.view(n, -1).sum(0).tolist()
        self._extend_order(counts, n)
        self._mixed = [ui for ui, c in enumerate(counts) if 0 < c < n]
        if not self._mixed:
            return
        for ui in self._mixed:
            unit = self.units[ui]
            unit.reshard()  # one kept since its forward (reshard_after_forward=False) is gathered as everywhere
            self._gather(ui, "backward", async_op=False)
            unit.wait()
            unit.held = True
            if not self._ran[ui]:
                unit.reshard()
        self._queue_order = self.queue.order
        self.queue.order = [i for i in self.queue.order if i not in self._mixed] + self._mixed

    def _extend_order(self, counts: list[int], n: int) -> None:
        """The forwards' gather order: after the first backward, the units every rank ran, in
        the order they ran; then each unit first run by some rank, after the last unit of the
        order registered before it. The same on every rank: built from the summed counts."""
        if not any(counts):
            return
        if self._catchup_final:
            order = list(self._catchup)
        else:
            order = [ui for ui in self.forward_order if ui != self.root and counts[ui] == n]
        seen = set(order)
        for ui in range(self.root):
            if counts[ui] and ui not in seen:
                order.insert(max((i + 1 for i, v in enumerate(order) if v < ui), default=0), ui)
        if not self._catchup_final or len(order) != len(self._catchup):
            self._catchup, self._catchup_final = order, True
            self._position = {ui: i for i, ui in enumerate(order)}
            self.forward_order = ([self.root] if self.root in self.forward_order else []) + order

    def _end_mixed(self) -> None:
        """The pass is over: units run on some ranks reduce in their places again."""
        for ui in self._mixed:
            self.units[ui].held = False
        self._mixed = []
        if self._queue_order is not None:
            self.queue.order, self._queue_order = self._queue_order, None

    def begin_backward(self) -> None:
        """The first hook of a pass also settles which units ran where ([Note: units run on some ranks])."""
        opening = not self._backward_open
        super().begin_backward()
        if opening:
            self._agree_on_units_run()
