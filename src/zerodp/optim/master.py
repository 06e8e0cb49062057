"""The fp32 master of each storage's owned pieces, where its placement keeps it.

[Note: master placement]
The shard's `Placement` ([Note: placement] in memory/placement.py) decides where its fp32
master (and, through the tensors the optimizer is handed, its per-element states) is
allocated, how the reduced gradient reaches it, and how updated values go back to the
compute parameters:
- "device": everything beside the parameters; in fp32 the owned parameter pieces are their
  own master (views, no copy), and the master's `.grad` is the reduced gradient itself (an
  fp32 upcast under bf16/fp16).
- "host" (ZeRO-Offload): the master lives in host memory even in fp32 (unless the fp32
  shards are offloaded with it, Config.offload_params), each owned gradient piece is copied
  into a host fp32 buffer of its own (`grad_staging`, during backward where it can be:
  [Note: gradient streaming] in streaming.py), the optimizer steps on the host, and the
  updated masters are copied into the compute parameters.
- "disk" (ZeRO-Infinity): the 16-bit runs' master and every per-element state in files,
  the step a bucket at a time (stepper.py); in fp32 the parameters stay their own master
  (a copy on disk would add bytes, not remove any); the gradient is not copied.
The stepper, the state dicts and the checkpoints (through `OwnedSlice.read`/`write`) only
ever go through these.
"""
from __future__ import annotations

import bisect
from typing import Mapping, Optional, Protocol

import torch

from ..memory.placement import Placement
from ..sharding.model_state import LoadedValues

__all__ = ["MasterShard", "ShardStorage", "piece_runs", "piece_shapes", "runs_of_bytes"]


class ShardStorage(Protocol):
    """What the optimizer needs from a group's storage (stages 0-2: FlatParamGroup;
    stage 3: a unit's sharded parameters)."""

    def owned_params(self) -> list[torch.Tensor]: ...
    def owned_grads(self) -> list[torch.Tensor]: ...
    def owned_fp32(self) -> list[torch.Tensor]: ...
    def drop_initial_fp32(self) -> None: ...
    def owned_pieces(self) -> list: ...
    def publish(self, phase: str = "step") -> None: ...
    def zero_grad(self) -> None: ...
    def held_tensors(self) -> dict: ...
    def offloaded_tensors(self) -> dict: ...  # placement kind ("host"/"disk") -> tensors kept there
    offloaded: bool  # the parameter shard itself lives off the device (Config.offload_params)
    # For state dicts (optim/state_dict.py): the layout's slots that are this storage's,
    # their names, this rank on the shard axis, and the shard axis's collectives.
    layout: object
    indices: list
    names: list
    rank: int
    collectives: object


class MasterShard:
    """One storage's owned pieces and the master tensors the inner optimizer updates: one
    tensor per owned piece (a bucket's chunk at stages 0-2, a parameter's part at stage
    3), so the optimizer's temporaries stay piece-sized rather than shard-sized. In fp32
    the owned parameter pieces are their own master (views, no copy)."""

    def __init__(self, storage: ShardStorage, full_precision: bool, placement: Placement):
        # `full_precision`: the parameters are the master (fp32, kept beside them, or
        # offloaded with them: Config.offload_params puts fp32 shards where the master goes).
        self.full_precision = full_precision and (placement.kind != "host" or storage.offloaded)
        self.storage, self.placement = storage, placement
        self.grad_staging: list[torch.Tensor] = []  # the gradient beside an offloaded master
        # Written by an optimizer state dict since the last step: a model state dict loaded
        # next in the compute dtype (torch's set_state_dict loads the optimizer first) keeps it.
        self.restored = False
        # A parameter stepped whole is one piece, shown to the optimizer in its own shape
        # ([Note: whole-parameter alignment] in memory/layout.py); any other piece is 1-D.
        shapes = piece_shapes(storage)
        if self.full_precision:
            self.master_tensors = [t.view(shape) for t, shape in zip(storage.owned_params(), shapes)]
        else:
            fp32 = storage.owned_fp32()
            sizes = [t.numel() for t in fp32]
            device = fp32[0].device if fp32 else torch.device("cpu")
            flat = placement.empty(sum(sizes), torch.float32, device)
            self.master_tensors = ([t.view(shape) for t, shape in zip(torch.split(flat, sizes), shapes)]
                                   if fp32 else [])
            for m, t in zip(self.master_tensors, fp32):
                m.view(-1).copy_(t.reshape(-1))
            if placement.kind == "host" and fp32:  # the gradient is copied next to the master
                self.grad_staging = [b.view(shape) for b, shape in
                                     zip(torch.split(placement.empty(sum(sizes), torch.float32, device), sizes), shapes)]

    def attach_grads(self, inv_scale: float, streamed: frozenset = frozenset()) -> None:
        """Each master's fp32 `.grad`, unscaled; the pieces in `streamed` were copied to their
        staging buffers during backward already ([Note: gradient streaming])."""
        self.restored = False
        staging = self.grad_staging or [None] * len(self.master_tensors)
        for i, (m, g, buf) in enumerate(zip(self.master_tensors, self.storage.owned_grads(), staging)):
            m.grad = buf.view(m.shape) if i in streamed else self._fp32_grad(g, m, buf)
        self.placement.synchronize()
        if inv_scale != 1.0:
            for m in self.master_tensors:
                m.grad.mul_(inv_scale)

    def stage_grad(self, i: int) -> None:
        """Piece `i`'s final reduced gradient into its host buffer now ([Note: gradient streaming])."""
        self._fp32_grad(self.storage.owned_grads()[i], self.master_tensors[i], self.grad_staging[i])

    def _fp32_grad(self, grad: torch.Tensor, master: torch.Tensor, staging) -> torch.Tensor:
        """The reduced gradient as the master's `.grad`: copied into its staging buffer where
        it has one (upcast on the way if 16-bit), else itself when fp32, else an fp32 upcast."""
        if staging is None:
            return grad.view(master.shape) if grad.dtype == torch.float32 else grad.float().view(master.shape)
        self.placement.copy_into(staging, grad.view(staging.shape))
        return staging.view(master.shape)

    def write_back(self) -> None:
        """Masters into the compute parameters (nothing to do when they are the parameters)."""
        if not self.full_precision:
            for m, param in zip(self.master_tensors, self.storage.owned_params()):
                self.placement.copy_into(param, m.reshape(param.shape))
            self.placement.synchronize()
            self.placement.release(self.master_tensors)  # disk: read for this, dropped again

    def refresh_from_params(self, loaded: Optional[Mapping[str, LoadedValues]] = None) -> None:
        """Restart the master from parameters changed by hand or by a load ([Note: weight
        loading] in sharding/model_state.py): each element that no longer rounds to its
        parameter takes the parameter's value. A parameter a load gave values for (`loaded`,
        by name) takes them as given where they were finer than the parameter (fp32 weights
        into bf16: the master keeps what the parameter rounded away), else the parameter's
        value everywhere, as `load_pretrained` does; except where an optimizer state dict
        has just restored the master (`restored`) and it rounds to the load: it is those
        weights' exact value."""
        if self.full_precision:  # the parameters are the master
            return
        params = self.storage.owned_params()
        for m, param in zip(self.master_tensors, params):
            m, p = m.view(-1), param.reshape(-1).to(m.device)  # an offloaded master lives elsewhere
            m.copy_(torch.where(m.to(p.dtype) != p, p.float(), m))
        if loaded:
            self._take_loaded(loaded, params)
        self.placement.release(self.master_tensors)

    def _take_loaded(self, loaded: Mapping[str, LoadedValues], params: list[torch.Tensor]) -> None:
        """The part of `refresh_from_params` for the parameters a load gave values for."""
        st = self.storage
        pieces = st.owned_pieces()
        for pi, si, a, b in piece_runs(st):
            name, slot = st.names[si], st.layout.slots[si]
            if name not in loaded:
                continue
            master = self.master_tensors[pi].view(-1)[a:b]
            given = loaded[name].values(pieces[pi].flat_start + a - slot.offset, b - a)
            if given is not None:
                master.copy_(given.reshape(-1).to(master.device, torch.float32))
            elif not self.restored:
                master.copy_(params[pi].reshape(-1)[a:b].to(master.device, torch.float32))


def piece_shapes(storage: ShardStorage) -> list[tuple]:
    """The shape the optimizer sees each owned piece in: its parameter's, where the piece is a
    whole parameter the layout packed whole (`FlatLayout.whole`), else 1-D."""
    layout = storage.layout
    whole = {layout.slots[i].offset: layout.slots[i] for i in storage.indices if layout.whole[i]}
    out = []
    for piece in storage.owned_pieces():
        slot = whole.get(piece.flat_start)
        out.append(slot.shape if slot is not None and slot.numel == piece.numel else (piece.numel,))
    return out


def piece_runs(storage: ShardStorage) -> list[tuple[int, int, int, int]]:
    """(piece, slot, start, end in the piece) of each run where one of the storage's owned
    pieces meets one of its parameters, in piece order."""
    slots = storage.layout.slots
    order = sorted(storage.indices, key=lambda i: slots[i].offset)
    offsets = [slots[i].offset for i in order]
    out = []
    for pi, piece in enumerate(storage.owned_pieces()):
        end = piece.flat_start + piece.numel
        k = max(bisect.bisect_right(offsets, piece.flat_start) - 1, 0)
        while k < len(order) and slots[order[k]].offset < end:
            slot = slots[order[k]]
            lo, hi = max(slot.offset, piece.flat_start), min(slot.offset + slot.numel, end)
            if lo < hi:
                out.append((pi, order[k], lo - piece.flat_start, hi - piece.flat_start))
            k += 1
    return out


def runs_of_bytes(tensors: list[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of `tensors` of at most `max_bytes` each (one tensor may exceed it)."""
    out, run, size = [], [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if run and size + nbytes > max_bytes:
            out.append(run)
            run, size = [], 0
        run.append(t)
        size += nbytes
    if run:
        out.append(run)
    return out
