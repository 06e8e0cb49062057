"""The optimizer's memory ledger: [Note: measured ledger] in memory/ledger.py."""
from __future__ import annotations

from ..memory.ledger import CATEGORIES, Census, MemoryReport, is_elementwise_state, walk_tensors

__all__ = ["measure"]


def measure(opt) -> MemoryReport:
    """Bytes a ZeroOptimizer's rank holds, counted from its storages, by category and by
    placement (device, host, disk)."""
    census, stepper = Census(), opt.stepper
    storages = [s.storage for s in stepper.all_shards()]
    held_by = [st.held_tensors() for st in storages]
    census.claim("params", (t for held in held_by for t in held["params"]))
    census.claim("master", (m for s in stepper.all_shards() for m in s.master_tensors))
    census.claim("grads", (t for held in held_by for t in held["grads"]))
    census.claim("grads", (m.grad for s in stepper.all_shards() for m in s.master_tensors))
    census.claim("grads", (b for s in stepper.all_shards() for b in s.grad_staging))
    census.claim("optimizer_states", (v for p, state in stepper.inner.state.items()
                                      for v in state.values() if is_elementwise_state(v, p)))
    census.claim("optimizer_states", stepper.state_buffers.buffers.values())  # allocated ahead (disk)
    census.claim("secondary_params", (t for held in held_by for t in held.get("secondary_params", ())))
    secondary = getattr(opt.grad_sync, "secondary_pool", None)
    census.claim("secondary_params", secondary.allocated if secondary is not None else ())
    store = opt.tensor_parallel.checkpoints if opt.tensor_parallel is not None else None
    checkpoints = store.held_tensors() if store is not None else {"device": [], "host": []}
    census.claim("activation_checkpoints", checkpoints["device"] + checkpoints["host"])
    census.claim("frozen_params", opt.frozen_tensors())
    pool = getattr(opt.grad_sync, "pool", None)
    census.claim("comm_buffers", pool.allocated if pool is not None else ())
    for holder, t in walk_tensors(opt):
        census.claim(holder, [t])
    held = census.by_owner()
    layouts = {id(st.layout): st.layout for st in storages}.values()
    # What the placement keeps off the device, in host memory or in files ([Note: master
    # placement] in master.py), counted from the same storages.
    offloaded = Census()
    for st in storages:  # Config.offload_params: the shards themselves
        for kind, tensors in st.offloaded_tensors().items():
            offloaded.claim(kind, tensors)
    for unit in (opt.stage3.units if opt.stage3 is not None else []):  # frozen-only units are in no storage
        for kind, tensors in unit.offloaded_tensors().items():
            offloaded.claim(kind, tensors)
    if stepper.placement.offloaded:
        kept = [*(m for s in stepper.all_shards() for m in s.master_tensors),
                *(b for s in stepper.all_shards() for b in s.grad_staging),
                *(v for p, state in stepper.inner.state.items() for v in state.values()
                  if is_elementwise_state(v, p)), *stepper.state_buffers.buffers.values()]
        offloaded.claim(stepper.placement.kind, (t for t in kept if stepper.placement.owns(t)))
    offloaded.claim("activations_host", checkpoints["host"])
    by_place = offloaded.by_owner()
    experts = _expert_bytes(opt, storages)
    return MemoryReport(**experts,
        host_offloaded=by_place.get("host", 0), disk_offloaded=by_place.get("disk", 0),
        **{c: held.pop(c, 0) for c in CATEGORIES},
        numel=sum(lay.numel for lay in layouts), padded_numel=sum(lay.padded_numel for lay in layouts),
        world_size=opt.comm.shard_size, stage=opt.config.stage,  # the N states are divided by
        activation_checkpoints_on_host=by_place.get("activations_host", 0),
        activation_checkpoints_peak=store.peak_nbytes if store is not None else 0,
        logits_peak=opt.tensor_parallel.logits_peak_nbytes if opt.tensor_parallel is not None else 0,
        gathered_params_peak=opt.stage3.gathered_peak_nbytes if opt.stage3 is not None else 0,
        alignment_padding=sum(lay.alignment_padding for lay in layouts),
        owned_numel=tuple(sum(lay.owned_numel(r) for lay in layouts) for r in range(opt.comm.shard_size))
        if opt.config.stage >= 1 else (),
        other=sum(held.values()), other_by_owner=tuple(sorted(held.items())))



def _expert_bytes(opt, storages: list) -> dict:
    """The expert banks' share of the categories: their storages' parameters and gradients,
    and the masters and optimizer states of their shards (docs/moe.md, "What each rank holds")."""
    ep = getattr(opt, "expert_parallel", None)
    if ep is None:
        return {}
    ids = ep.param_ids

    def bank(storage) -> bool:
        params = getattr(storage, "params", None)
        if params is None:
            params = getattr(getattr(storage, "unit", None), "params", None) or []
        return bool(params) and all(id(p) in ids for p in params)

    banks = [st for st in storages if bank(st)]
    shards = [s for s in opt.stepper.all_shards() if bank(s.storage)]
    held = [st.held_tensors() for st in banks]
    census = Census()
    census.claim("params", (t for h in held for t in h["params"]))
    census.claim("grads", (t for h in held for t in h["grads"]))
    census.claim("grads", (m.grad for s in shards for m in s.master_tensors))
    census.claim("master", (m for s in shards for m in s.master_tensors))
    masters = {id(m) for s in shards for m in s.master_tensors}
    census.claim("optimizer_states", (v for p, state in opt.stepper.inner.state.items() if id(p) in masters
                                      for v in state.values() if is_elementwise_state(v, p)))
    by = census.by_owner()
    return {"expert_params": by.get("params", 0), "expert_grads": by.get("grads", 0),
            "expert_master": by.get("master", 0), "expert_optimizer_states": by.get("optimizer_states", 0),
            "expert_numel": sum(lay.numel for lay in {id(st.layout): st.layout for st in banks}.values()),
            "expert_world_size": ep.expert_comm.shard_size}
