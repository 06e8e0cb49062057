"""ZeRO-R's partitioned activation checkpoints: Pa and Pa+cpu (arXiv 1910.02054 §6.1).

[Note: partitioned activation checkpoints]
A checkpointed layer keeps only its inputs from forward to backward, and under tensor
parallelism those inputs (the residual stream) are the same on every tensor-parallel rank:
N_m copies of each. zerodp takes the layer's checkpoint inputs where torch.utils.checkpoint
saves them, through `torch.autograd.graph.saved_tensors_hooks` set around the layer's
checkpointing function (the Hugging Face convention `_gradient_checkpointing_func`, which
`GPT.gradient_checkpointing_enable` follows too). With either `use_reentrant` mode the only
tensors saved under those hooks are the inputs: reentrant checkpointing runs the layer under
no_grad and saves its inputs once it returns; non-reentrant saves them before it installs its
own hooks for the layer's interior.

- Pa keeps the rank's 1/N_m slice of each input (ceil(numel / N_m) elements, the last slice
  zero-padded) and, when backward recomputes the layer, all-gathers the slices over the ``tp``
  axis through `zerodp.comm` (counted: N_m x the slice per checkpoint) and returns the whole
  input, bit for bit what was saved.
- Pa+cpu keeps the slice (or, without Pa, the whole input) in host memory, pinned on CUDA;
  unpacking one checkpoint starts copying back the one backward will need next (the newest one
  saved before it and not used yet), on a copy stream of its own on CUDA, so the copy overlaps
  the recomputation of this one.

With hooks set, autograd no longer checks that a saved tensor was not changed in place after
it was saved; a whole input kept on the device is checked here instead (a partitioned or
host copy is a copy, unaffected).

The store counts what it holds, from the tensors themselves: the memory ledger's activation
categories (device and host), and their peak since `reset_peak()`. Tensors that are not
floating point, or live on another device than the comm's, are kept whole and counted.
"""
from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch
import torch.nn as nn

from ..config import ConfigError
from ..distributed import Comm
from ..memory.placement import Placement

__all__ = ["CheckpointStore"]


class _Kept:
    """One saved checkpoint input, as the store keeps it."""

    __slots__ = ("shape", "numel", "tensor", "partitioned", "on_host", "version", "ready", "used", "__weakref__")

    def __init__(self, shape, numel: int, tensor: torch.Tensor, partitioned: bool, on_host: bool, version: int):
        self.shape, self.numel, self.tensor = shape, numel, tensor
        self.partitioned, self.on_host, self.version = partitioned, on_host, version
        self.ready: Optional[torch.Tensor] = None  # on the device again, copied ahead of its unpack
        self.used = False


class CheckpointStore:
    """Saved-tensor hooks for checkpointed layers (Pa with `partition`, Pa+cpu with `on_host`)."""

    def __init__(self, comm: Comm, partition: bool, on_host: bool):
        self.comm, self.partition, self.on_host = comm, partition, on_host
        self.size, self.rank = comm.topology.tp_size, comm.topology.tp_rank
        self.device = comm.device
        self._live: "weakref.WeakValueDictionary[int, _Kept]" = weakref.WeakValueDictionary()
        self._by_source: dict[int, tuple] = {}  # id(tensor saved) -> (weakref to it, to its _Kept)
        self._order = 0
        self.peak_nbytes = 0  # device and host together, at the moment they peaked
        self._wrappers: "weakref.WeakSet" = weakref.WeakSet()
        self._layers: list = []
        self._copy_stream = None  # CUDA: Pa+cpu's copies back to the device

    # -- the hooks -------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Kept:
        data = t.detach()
        # A tensor several layers take as input (a rotary table, a mask) is kept once: while
        # that very tensor lives, its storage cannot have been reused for another.
        seen = self._by_source.get(id(t))
        twin = seen[1]() if seen is not None and seen[0]() is t else None
        if twin is not None and twin.version == t._version:
            item = _Kept(twin.shape, twin.numel, twin.tensor, twin.partitioned, twin.on_host, twin.version)
            self._remember(item, t)
            return item
        keep_whole = not data.is_floating_point() or data.device != self.device or data.numel() == 0
        partitioned = self.partition and not keep_whole
        if partitioned:
            flat = data.reshape(-1)
            per = -(-flat.numel() // self.size)
            lo, hi = min(self.rank * per, flat.numel()), min((self.rank + 1) * per, flat.numel())
            kept = torch.zeros(per, dtype=data.dtype, device=data.device)
            kept[: hi - lo].copy_(flat[lo:hi])
        else:
            kept = data
        on_host = self.on_host and not keep_whole
        if on_host:
            host = Placement("host", pinned=self.device.type == "cuda").staging(kept.shape, kept.dtype)
            kept = host.copy_(kept, non_blocking=True)
        item = _Kept(data.shape, data.numel(), kept, partitioned, on_host, t._version)
        self._remember(item, t)
        return item

    def _remember(self, item: _Kept, source: torch.Tensor) -> None:
        self._order += 1
        self._live[self._order] = item
        self._by_source = {k: v for k, v in self._by_source.items() if v[0]() is not None and v[1]() is not None}
        self._by_source[id(source)] = (weakref.ref(source), weakref.ref(item))
        self.peak_nbytes = max(self.peak_nbytes, sum(self.held_nbytes().values()))

    def unpack(self, item: _Kept) -> torch.Tensor:
        if not item.partitioned and not item.on_host and item.tensor._version != item.version:
            raise RuntimeError("the input of a checkpointed layer was modified in place after the layer's forward "
                               "saved it, so its recomputation would see other values: clone it before changing it")
        self._prefetch_before(item)
        kept = self._take(item) if item.on_host else item.tensor
        if not item.partitioned:
            return kept
        full = torch.empty(kept.numel() * self.size, dtype=kept.dtype, device=kept.device)
        self.comm.collectives("tp").all_gather(full, kept, "backward", label="activation checkpoint")
        return full[: item.numel].view(item.shape)

    def _fetch(self, item: _Kept) -> None:
        """Start copying a host-held checkpoint back to the device (on a CPU run host and device
        are one memory; the copy still happens, as on CUDA)."""
        if self.device.type == "cuda":
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the copy to the host is done
            with torch.cuda.stream(self._copy_stream):
                item.ready = item.tensor.to(self.device, non_blocking=True)
        else:
            item.ready = item.tensor.to(self.device, copy=True)

    def _take(self, item: _Kept) -> torch.Tensor:
        if item.ready is None:
            self._fetch(item)
        ready, item.ready, item.used = item.ready, None, True
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._copy_stream)
            ready.record_stream(current)
        return ready

    def _prefetch_before(self, item: _Kept) -> None:
        """Pa+cpu: start copying back the newest checkpoint saved before `item` that backward
        has not used yet (it needs it next), to overlap this one's recomputation."""
        if not self.on_host:
            return
        mine = next((k for k, v in self._live.items() if v is item), None)
        waiting = [v for k, v in self._live.items()
                   if mine is not None and k < mine and v.on_host and not v.used and v.ready is None]
        if waiting:
            self._fetch(waiting[-1])

    # -- checkpointing functions ------------------------------------------------------
    def wrap(self, checkpoint_fn):
        """`checkpoint_fn` (torch.utils.checkpoint.checkpoint or a partial of it) with this
        store's hooks around it."""
        store = self

        @functools.wraps(checkpoint_fn)
        def partitioned(function, *args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
                return checkpoint_fn(function, *args, **kwargs)
        self._wrappers.add(partitioned)
        return partitioned

    def install(self, model: nn.Module) -> None:
        """Wrap the checkpointing function of every layer that has one now, and of those that
        get one later (`gradient_checkpointing_enable()` after initialize), before each forward."""
        self._layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        self.wrap_layers()
        model.register_forward_pre_hook(lambda module, args: self.wrap_layers(module))

    def wrap_layers(self, model: Optional[nn.Module] = None) -> None:
        wrapped = 0
        for layer in self._layers:
            fn = getattr(layer, "_gradient_checkpointing_func", None)
            if fn is not None and fn not in self._wrappers:
                layer._gradient_checkpointing_func = self.wrap(fn)
            wrapped += bool(fn is not None and getattr(layer, "gradient_checkpointing", False))
        asked = self.partition or self.on_host
        if asked and not wrapped and model is not None and model.training and torch.is_grad_enabled():
            raise ConfigError("Config.partition_activations / activations_on_host keep the inputs of checkpointed "
                              "layers, but no layer of the model is checkpointed: call "
                              "model.gradient_checkpointing_enable() (a Hugging Face model, or zerodp's GPT)")

    # -- the ledger -------------------------------------------------------------------
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors kept now, by place ("device", "host"); copies on their way back to the
        device count on the device."""
        out: dict[str, list[torch.Tensor]] = {"device": [], "host": []}
        for item in list(self._live.values()):
            out["host" if item.on_host else "device"].append(item.tensor)
            if item.ready is not None:
                out["device"].append(item.ready)
        return out

    def held_nbytes(self) -> dict[str, int]:
        return {place: sum(t.numel() * t.element_size() for t in {id(t): t for t in ts}.values())
                for place, ts in self.held_tensors().items()}

    def reset_peak(self) -> None:
        self.peak_nbytes = sum(self.held_nbytes().values())
