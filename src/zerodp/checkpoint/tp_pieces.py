"""Checkpoints under tensor parallelism: the ranks a checkpoint spans, and pieces of split
parameters read by the original parameter's coordinates.

[Note: tensor-parallel pieces]
Under tensor parallelism (DP x TP = a x b) the checkpoint is still the one of [Note:
checkpoint layout]: one rank file per process (rank = data rank * b + tensor-parallel rank,
Megatron's order: [Note: tensor-parallel axis] in distributed/topology.py), and in
metadata.json every parameter under its model name with its *original* shape, the shape a
one-process model has. What changes:

- A parameter the tensor-parallel plan did not split (a norm, a row-parallel bias) is the
  same on every tensor-parallel rank; only tensor-parallel rank 0's owners write it, with
  plain pieces [rank, start, numel] of the original parameter: written once.
- A split parameter gains `"split": {"dim", "parts", "size"}` ([Note: tensor-parallel
  split] in tensor_parallel/split.py) and pieces [rank, start, numel, tp_rank]: a range of
  the flattened slice of tensor-parallel rank `tp_rank`, as its owner holds it. Every
  owner writes its own range in parallel; nothing is gathered. The split is an affine map,
  so the pieces are the original parameter by global coordinates: fused projections (GPT-2's
  q, k, v) come back in the model's own packed order, whole, and nothing is padded.
- Reading: a rank wants elements of its own slice (or of the whole parameter, at TP 1);
  both that and every saved piece are turned into runs of the original flattened parameter,
  and the overlaps are read with one slice per saved piece (`Reader.read_runs`). So any
  layout c x d at any stage loads any a x b checkpoint, including one process, with no
  conversion step, and `consolidate` gives the original model's state dict.

- Checking: the pieces are trusted only as far as the rank files agree with them. A piece
  [rank, start, numel, tp_rank] must lie in a file of tensor-parallel rank `tp_rank` (process
  rank r holds tensor-parallel rank r % b's slices; an unsplit parameter's pieces, rank 0's),
  and each rank's rank{r}.json records its tensor-parallel rank and the split of every split
  parameter it wrote, which a reader compares with metadata.json's before it reads a piece.
  Otherwise a `split` whose parts were changed (still cutting the shape evenly), or a piece
  pointed at another tensor-parallel rank's file (which holds a tensor of the same name and
  size), would read valid tensors into the wrong places without any other check failing.

Checkpoints written without tensor parallelism have no "split", 3-element pieces and no
record in rank{r}.json: read as before, and into a tensor-parallel model too.

Expert parallelism's banks are pieces of this form too ([Note: expert split] in
expert_parallel/plan.py): a bank is split on dim 0 over the ``ep`` axis, its split recorded
with `"axis": "ep"` and its pieces' fourth entry the expert-parallel rank whose experts the
piece is of (data rank r holds expert-parallel rank r % ep_size's); rank{r}.json records
the rank's expert-parallel rank beside. So a run saved at N=4, EP=2 loads at N=2, EP=2 and
into one process without expert parallelism, by the banks' global coordinates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from ..tensor_parallel.split import TensorSplit

__all__ = ["ExpertSplit", "Ranks", "local_runs", "piece_runs", "ranks_of", "saved_split", "split_info",
           "split_rank", "splits_of"]


@dataclass(frozen=True)
class ExpertSplit(TensorSplit):
    """An expert bank's split over the ``ep`` axis: the same map as a tensor-parallel split
    of dim 0, recorded with its axis."""


@dataclass(frozen=True)
class Ranks:
    """Every process a checkpoint spans, in global order: the data-parallel ranks of every
    tensor-parallel rank. `rank` names this process's files."""

    comm: object  # zerodp.distributed.Comm
    rank: int
    world_size: int

    def all_gather_object(self, obj, phase: str = "control", label: str = "") -> list:
        """Every process's object, in global rank order: over the tensor-parallel group,
        then its result over the data-parallel ranks."""
        t = self.comm.topology
        if t.tp_size == 1:
            return self.comm.all_gather_object(obj, phase, label=label)
        group = self.comm.all_gather_object(obj, phase, label=label, axis="tp")
        return [o for g in self.comm.all_gather_object(group, phase, label=label) for o in g]


def ranks_of(optimizer) -> Ranks:
    comm = optimizer.comm
    return Ranks(comm, comm.topology.process_rank, comm.topology.process_count)


def splits_of(optimizer) -> Mapping[str, TensorSplit]:
    """How the model's tensor parallelism and expert parallelism cut each parameter they
    split, by name ({} without)."""
    tp = getattr(optimizer, "tensor_parallel", None)
    ep = getattr(optimizer, "expert_parallel", None)
    if ep is None:
        return tp.splits if tp is not None else {}
    return {**(tp.splits if tp is not None else {}), **{n: ExpertSplit(s.dim, s.parts, s.size)
                                                        for n, s in ep.splits.items()}}


def split_rank(optimizer, name: str) -> int:
    """The rank along its split's axis whose slice this rank holds of parameter `name`:
    its expert-parallel rank for a bank, else its tensor-parallel rank."""
    ep = getattr(optimizer, "expert_parallel", None)
    topology = optimizer.comm.topology
    return topology.ep_rank if ep is not None and name in ep.splits else topology.tp_rank


def split_info(split: Optional[TensorSplit]) -> Optional[dict]:
    if split is None:
        return None
    info = {"dim": split.dim, "parts": split.parts, "size": split.size}
    return {**info, "axis": "ep"} if isinstance(split, ExpertSplit) else info


def saved_split(info: dict) -> Optional[TensorSplit]:
    s = info.get("split")
    return None if s is None else TensorSplit(s["dim"], s["parts"], s["size"])


def local_runs(shape, split: Optional[TensorSplit], tp_rank: int, start: int, numel: int) -> list:
    """Elements [start, start+numel) of this rank's flattened parameter (its slice when
    `split`) as runs (original flat start, offset in the range, length)."""
    if split is None:
        return [(start, 0, numel)] if numel else []
    return split.runs(shape, tp_rank, start, numel)


def piece_runs(info: dict) -> list:
    """Every saved piece of one parameter as runs of the original flattened parameter:
    (original flat start, length, rank, piece start, piece numel, offset in the piece,
    tensor-parallel rank of the slice the piece is of), sorted by where they start."""
    split = saved_split(info)
    out = []
    for piece in info["pieces"]:
        rank, start, numel = piece[:3]
        tp_rank = piece[3] if split is not None else 0
        for g, off, n in local_runs(info.get("shape"), split, tp_rank, start, numel):
            out.append((g, n, rank, start, numel, off, tp_rank))
    out.sort()
    return out
