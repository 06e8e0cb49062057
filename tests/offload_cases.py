"""Optimizer offload to host memory (Config.offload_optimizer="host"), run inside the core
world at N = 1, 2, 4 (test_core.py reads its results)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp
from checkpoint_cases import error_of
from core_cases import (OPTIMIZERS, SMALL_BUCKET, STEPS, Net, batch, loss_fn, max_rel_diff, mlp_loss, train_reference,
                        train_zerodp)

STATE_BYTES = {"sgd": 4, "adamw": 8}  # momentum; exp_avg + exp_avg_sq (fp32)


def _params(model) -> list[torch.Tensor]:
    with zerodp.gathered_parameters(model):
        return [p.detach().clone() for p in model.parameters()]


def units_of(stage: int) -> dict:
    """Small units at stage 3 (the Config refuses the field elsewhere)."""
    return {"unit_min_params": 10} if stage == 3 else {}


def disk_dir(kind: str, directory: str) -> dict:
    """The offload directory, for a disk placement only (the Config refuses it elsewhere)."""
    return {"offload_dir": directory} if kind == "disk" else {}


def shared_tmp(rank: int, world_size: int) -> str:
    """A fresh directory, the same on every rank."""
    root = [tempfile.mkdtemp(prefix="zerodp-offload-") if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(root, src=0)
    return root[0]


def offload_grid(world_size: int) -> list:
    """The whole grid at N = 1 and 2; at N = 4, where it costs most, plain SGD (the
    scale-sensitive one) at every stage in fp32 and AdamW at stage 3 in bf16."""
    if world_size == 4:
        return [(st, "fp32", "sgd") for st in (1, 2, 3)] + [(3, "bf16", "adamw")]
    return [(st, pr, nm) for st in (1, 2, 3) for pr in ("fp32", "bf16") for nm in OPTIMIZERS]


@contextlib.contextmanager
def scratch(rank: int, world_size: int):
    """A directory shared by the ranks for one case, removed after it on every path."""
    root = shared_tmp(rank, world_size)
    try:
        yield root
    finally:
        if world_size > 1:
            dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def placements_case(rank: int, world_size: int, stage: int, precision: str, name: str) -> dict:
    """One stage x dtype x optimizer on every placement, against the device run and DDP."""
    with scratch(rank, world_size) as root:
        return _placements(rank, root, stage, precision, name)


def _placements(rank: int, root: str, stage: int, precision: str, name: str) -> dict:
    out = {}
    fn = OPTIMIZERS[name]
    runs = {}
    # Stage 3 also with the parameter and gradient shards beside the optimizer states.
    places = ("none", "host", "disk") + (("host+params", "disk+params") if stage == 3 else ())
    for place in places:
        kind = place.split("+")[0]
        cfg = zerodp.Config(stage=stage, mixed_precision=precision, bucket_bytes=SMALL_BUCKET,
                            offload_optimizer=kind, offload_params=kind if place.endswith("+params") else "none",
                            **units_of(stage), **disk_dir(kind, os.path.join(root, f"{stage}{precision}{name}{place}")))
        if kind == "disk":
            os.makedirs(cfg.offload_dir, exist_ok=True)
        model, opt, losses, _, _ = train_zerodp(Net, fn, cfg, rank)
        runs[place] = (model, opt, losses, opt.memory_report())
    ref, ref_losses, _ = train_reference(Net, fn, runs["host"][1].config.compute_dtype, rank)
    device_params = _params(runs["none"][0])
    for place in places[1:]:
        model, opt, losses, rep = runs[place]
        files = getattr(opt.stepper.placement, "files", None)
        with zerodp.gathered_parameters(model):
            diff = max_rel_diff(model, ref)
        out[place] = {
            "same_as_device": all(torch.equal(a, b) for a, b in zip(_params(model), device_params)),
            "losses_equal": losses == runs["none"][2], "diff": diff,
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "host": rep.host_offloaded, "disk": rep.disk_offloaded,
            "device_offloaded": runs["none"][3].host_offloaded + runs["none"][3].disk_offloaded,
            "master": rep.master, "states": rep.optimizer_states, "shard_numel": _shard_numel(opt),
            "state_bytes": STATE_BYTES[name], "model_state": rep.model_state,
            "padded_shard": rep.padded_numel // rep.world_size,
            "units": len(opt.stage3.units) if opt.stage3 is not None else 0,
            # [Note: gradient streaming]: every host buffer filled during backward, every step.
            "streamed": opt.streamer.streamed_pieces,
            "staged_pieces": STEPS * sum(len(s.grad_staging) for s in opt.stepper.all_shards()),
            # What the files take on disk, from the kernel's side: their sizes.
            "file_bytes": sum(os.fstat(fd).st_size for *_, fd in files.regions) if files is not None else 0}
    return out


ACCUMULATION_GRID = [(2, 2, "host"), (3, 3, "disk"), ("3+params", 3, "disk")]


def accumulation_case(rank: int, world_size: int, key, stage: int, place: str) -> dict:
    """Accumulation (2 micro-batches) and clipping, fp32 SGD, against DDP: host at stage 2, disk
    at 3, and at 3 with the shards on disk too, reducing once per window (the boundary's
    reduction adds to a gradient shard that zero_grad left to be overwritten)."""
    with scratch(rank, world_size) as root:
        ref, _, ref_norms = train_reference(Net, OPTIMIZERS["sgd"], torch.float32, rank, clip=0.05)
        directory = os.path.join(root, f"accumulation{key}")
        os.makedirs(directory, exist_ok=True)
        params = key == "3+params"
        cfg = zerodp.Config(stage=stage, grad_accumulation_steps=2, offload_optimizer=place,
                            offload_params="disk" if params else "none", **units_of(stage),
                            **disk_dir(place if not params else "disk", directory),
                            reduce_each_micro_batch=not params or stage < 2)
        model, opt, _, norms, _ = train_zerodp(Net, OPTIMIZERS["sgd"], cfg, rank, clip=0.05, micro_batches=2)
        with zerodp.gathered_parameters(model):
            return {"diff": max_rel_diff(model, ref),
                    "norm_gap": max(abs(a - b) / b for a, b in zip(norms, ref_norms))}


def bad_dir_case(rank: int, world_size: int) -> dict:
    with scratch(rank, world_size) as root:
        return bad_offload_dirs(rank, root)


def bad_offload_dirs(rank: int, root: str) -> dict:
    """A missing, a read-only, a full and a shared offload_dir: a clear error on every rank at
    initialize, before any step. Only rank 1's disk is full."""
    def build(directory, params="none"):
        cfg = zerodp.Config(stage=3, unit_min_params=10, offload_optimizer="disk", offload_params=params,
                            offload_dir=directory)
        return zerodp.initialize(Net(), OPTIMIZERS["adamw"], cfg)
    out = {}
    good = os.path.join(root, "good")
    os.makedirs(good, exist_ok=True)
    out["missing"] = error_of(lambda: build(os.path.join(root, "nowhere")))
    read_only = os.path.join(root, "read-only")
    os.makedirs(read_only, exist_ok=True)
    os.chmod(read_only, 0o500)
    out["read_only"] = error_of(lambda: build(read_only)) if os.geteuid() != 0 else "root ignores permissions"
    os.chmod(read_only, 0o700)
    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")
    os.posix_fallocate = full if rank == 1 else real
    try:
        out["full"] = error_of(lambda: build(os.path.join(root, "good")))
        # The parameter shards' files are reserved before any unit is built.
        out["full_params"] = error_of(lambda: build(os.path.join(root, "good"), params="disk"))
    finally:
        os.posix_fallocate = real
    kept = build(os.path.join(root, "good"))  # held: a second run on the same directory
    out["shared"] = error_of(lambda: build(os.path.join(root, "good")))
    out["kept_alive"] = kept is not None
    return out


def train_delayed_reference(opt_fn, rank: int, after: int):
    """Config.delayed_update_after's definition ([Note: delayed parameter update]) on torch
    DDP: step t computes with p_t = m_t up to step `after`, m_(t-1) after it, and updates
    m_(t+1) = U(m_t, grad L_t(p_t)). Returns (the masters m_T, the parameters p_T, losses)."""
    torch.manual_seed(0)
    master = Net()
    lagging = DDP(copy.deepcopy(master))
    opt = opt_fn(master.parameters())
    losses = []
    for step in range(STEPS):
        loss = mlp_loss(lagging, step, rank)
        loss.backward()
        for m, p in zip(master.parameters(), lagging.module.parameters()):
            m.grad = p.grad.clone()
        before = [m.detach().clone() for m in master.parameters()]
        opt.step()
        opt.zero_grad()
        lagging.module.zero_grad()
        with torch.no_grad():
            for p, m in zip(lagging.module.parameters(), master.parameters() if step < after else before):
                p.copy_(m)
        losses.append(float(loss.detach()))
    return master, lagging.module, losses


def delayed_update_cases(rank: int, world_size: int) -> dict:
    """The delayed update against its definition, its parameters one update behind their
    masters until a checkpoint (or the ledger) settles it, and unlike the synchronous run."""
    out = {}
    for stage, name, after in ((1, "sgd", 0), (2, "adamw", 2), (3, "sgd", 1), (3, "adamw", 0)):
        fn = OPTIMIZERS[name]
        master, lagging, ref_losses = train_delayed_reference(fn, rank, after)
        cfg = zerodp.Config(stage=stage, bucket_bytes=SMALL_BUCKET, offload_optimizer="host",
                            delayed_update_after=after, **units_of(stage))
        model, opt, losses, _, _ = train_zerodp(Net, fn, cfg, rank)
        pending = opt.stepper.pending
        with zerodp.gathered_parameters(model):
            before_settle = max_rel_diff(model, lagging)
        opt.settle()
        with zerodp.gathered_parameters(model):
            after_settle = max_rel_diff(model, master)
        sync, _, sync_losses, _, _ = train_zerodp(Net, fn, dataclasses.replace(cfg, delayed_update_after=None), rank)
        out[(stage, name, after)] = {
            "pending": pending, "lagging_diff": before_settle, "master_diff": after_settle,
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "differs_from_sync": max(abs(a - b) for a, b in zip(losses, sync_losses))}
    if world_size == 2:
        out["failed_update"] = failed_delayed_update(rank)
    return out


class FlakySGD(torch.optim.SGD):
    """SGD whose step raises once `fail` is set (on one rank)."""

    fail = False

    def step(self, closure=None):
        if FlakySGD.fail:
            raise RuntimeError("injected failure in the update")
        return super().step(closure)


def failed_delayed_update(rank: int) -> str:
    """A delayed update that raises on rank 1 only: the next step raises on every rank."""
    cfg = zerodp.Config(stage=2, offload_optimizer="host", delayed_update_after=0)
    model, opt = zerodp.initialize(Net(), FlakySGD, cfg, lr=0.1)
    FlakySGD.fail = rank == 1
    try:
        for step in range(2):
            x, y = batch(step, rank)
            opt.backward(loss_fn(model(x), y))
            error = error_of(opt.step)
            opt.zero_grad()
    finally:
        FlakySGD.fail = False
    return error


def _shard_numel(opt) -> int:
    """Elements of the master this rank holds (the shards' owned pieces, padding excluded)."""
    return sum(m.numel() for s in opt.stepper.all_shards() for m in s.master_tensors)


def _steps(model, opt, steps, start, rank) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        loss = loss_fn(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def checkpoint_both_ways(rank: int, world_size: int) -> dict:
    """Saved with offload, resumed without it, and the reverse: the same losses, bit for bit,
    as going on uninterrupted."""
    out = {}
    root = shared_tmp(rank, world_size)
    pairs = [(pair, stage) for pair in (("host", "none"), ("none", "host"), ("disk", "none"), ("none", "disk"))
             for stage in (1, 3)] + [(("disk+params", "none"), 3), (("none", "host+params"), 3)]
    for (saved, loaded), stage in pairs:
        def build(place):
            torch.manual_seed(0)
            directory = os.path.join(root, f"{saved}-{loaded}-{stage}-{place}")
            os.makedirs(directory, exist_ok=True)
            kind = place.split("+")[0]
            cfg = zerodp.Config(stage=stage, mixed_precision="bf16", offload_optimizer=kind,
                                offload_params=kind if place.endswith("+params") else "none",
                                **units_of(stage), **disk_dir(kind, directory))
            return zerodp.initialize(Net(), OPTIMIZERS["adamw"], cfg)
        model, opt = build(saved)
        _steps(model, opt, 2, 0, rank)
        path = os.path.join(root, f"ckpt-{saved}-{loaded}-{stage}-{world_size}")
        zerodp.save(path, model, opt)
        on = _steps(model, opt, 2, 2, rank)
        model2, opt2 = build(loaded)
        zerodp.load(path, model2, opt2)
        out[(saved, loaded, stage)] = {"resumed": _steps(model2, opt2, 2, 2, rank) == on}
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out
