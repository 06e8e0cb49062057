"""The comm ledger: every collective zerodp issues, with its volume, bytes, phase and axis.

Volume is counted the way the ZeRO paper counts it (arXiv 1910.02054, §7): in elements
of the full, unsharded tensor a rank sends and receives. A reduce-scatter or an
all-gather of a Ψ-element tensor moves Ψ; an all-reduce is a reduce-scatter followed by
an all-gather and moves 2Ψ. So DDP moves 2Ψ per step, stages 1-2 Ψ + Ψ, stage 3 3Ψ.
`nbytes` is what the collective strategy put on the wire for the full tensor (the same
Ψ times the element size for the native and gloo strategies; less for a quantized one),
and `axis` is the mesh axis it ran on ([Note: mesh axes] in topology.py).
"""
from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["CommLedger", "CommRecord", "PHASES"]

# The phases a collective can belong to; "control" are scalar agreements (overflow flag,
# gradient norm, debug checks) that the paper's volume does not count.
PHASES = ("init", "forward", "backward", "step", "control", "checkpoint")

# Elements moved per element of the full tensor, by op (see the module docstring).
# An all-to-all (qgZ's levels) counts the elements of what it exchanges, like a reduce-scatter.
VOLUME_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "all_to_all": 1}


@dataclass(frozen=True)
class CommRecord:
    op: str
    numel: int  # elements of the full (unsharded) tensor
    nbytes: int  # bytes of the full tensor as sent
    phase: str
    step: int
    axis: str = "data"
    label: str = ""  # the unit or bucket it moves, for error messages
    # An all-to-all-v (expert parallelism's token exchange): its sizes differ between ranks
    # by design, so the ranks' agreement on what they run leaves them out.
    uneven: bool = False

    @property
    def agreed_sizes(self) -> str:
        """numel:nbytes as the ranks compare them ("v" for an uneven exchange)."""
        return "v:v" if self.uneven else f"{self.numel}:{self.nbytes}"

    @property
    def volume_numel(self) -> int:
        return VOLUME_FACTOR.get(self.op, 0) * self.numel


@dataclass
class CommLedger:
    """Records of the current and the last finished step, plus totals since creation."""

    step: int = 0
    current: list = field(default_factory=list)
    last_step: list = field(default_factory=list)
    totals: Counter = field(default_factory=Counter)
    fingerprint: int = 0  # of the current step's collectives: [Note: step fingerprint] in comm.py
    # Mesh axes whose groups span torchrun nodes (Topology.crosses_nodes): their bytes are
    # the inter-node ones. A collective over a group that spans nodes is counted whole (it
    # is what crosses, or waits on, the slower link); set by the Comm.
    inter_node_axes: frozenset = frozenset()

    def record(self, op: str, numel: int, nbytes: int, phase: str, axis: str = "data",
               label: str = "", uneven: bool = False) -> CommRecord:
        if phase not in PHASES:
            raise ValueError(f"comm phase {phase!r} is unknown: use one of {PHASES}")
        rec = CommRecord(op, int(numel), int(nbytes), phase, self.step, axis, label, uneven)
        self.current.append(rec)
        self.totals[(op, phase)] += rec.volume_numel
        self.fingerprint = zlib.crc32(f"{op}:{rec.agreed_sizes}:{phase}:{axis}".encode(), self.fingerprint)
        return rec

    def end_step(self) -> None:
        self.last_step, self.current = self.current, []
        self.step += 1
        self.fingerprint = 0

    @staticmethod
    def volume(records, phases=("forward", "backward", "step")) -> int:
        """Elements moved by `records` in the given phases (the paper's count)."""
        return sum(r.volume_numel for r in records if r.phase in phases)

    def summary(self, records=None) -> dict:
        records = self.last_step if records is None else records
        by_op: Counter = Counter()  # the paper's volume by op: scalar agreements ("control") apart
        by_axis: Counter = Counter()  # bytes sent, by mesh axis
        by_link: Counter = Counter({"intra_node": 0, "inter_node": 0})  # by whether the group spans nodes
        control = 0
        for r in records:
            if r.phase == "control":
                control += 1
            else:
                by_op[f"{r.op}/{r.phase}"] += r.volume_numel
                by_axis[r.axis] += r.nbytes
                by_link["inter_node" if r.axis in self.inter_node_axes else "intra_node"] += r.nbytes
        return {
            "volume_numel": self.volume(records),
            "calls": len(records),
            "nbytes": sum(by_axis.values()),
            "by_op": dict(by_op),
            "nbytes_by_axis": dict(by_axis),
            "nbytes_by_link": dict(by_link),
            "control_calls": control,
        }
