"""Optimizer offload to host memory (Config.offload_optimizer="host"), run inside the core
world at N = 1, 2, 4 (test_core.py reads its results)."""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

import zerodp
from core_cases import OPTIMIZERS, SMALL_BUCKET, Net, batch, loss_fn, max_rel_diff, train_reference, train_zerodp

STATE_BYTES = {"sgd": 4, "adamw": 8}  # momentum; exp_avg + exp_avg_sq (fp32)


def _params(model) -> list[torch.Tensor]:
    with zerodp.gathered_parameters(model):
        return [p.detach().clone() for p in model.parameters()]


def offload_grid(rank: int, world_size: int) -> dict:
    out = {}
    for stage in (1, 2, 3):
        for precision in ("fp32", "bf16"):
            for name, fn in OPTIMIZERS.items():
                runs = {}
                for place in ("none", "host"):
                    cfg = zerodp.Config(stage=stage, mixed_precision=precision, bucket_bytes=SMALL_BUCKET,
                                        unit_min_params=10, offload_optimizer=place)
                    model, opt, losses, _, _ = train_zerodp(Net, fn, cfg, rank)
                    runs[place] = (model, opt, losses)
                ref, ref_losses, _ = train_reference(Net, fn, runs["host"][1].config.compute_dtype, rank)
                model, opt, losses = runs["host"]
                rep = opt.memory_report()
                with zerodp.gathered_parameters(model):
                    diff = max_rel_diff(model, ref)
                out[(stage, precision, name)] = {
                    "same_as_device": all(torch.equal(a, b) for a, b in zip(_params(model),
                                                                           _params(runs["none"][0]))),
                    "losses_equal": losses == runs["none"][2], "diff": diff,
                    "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                    "host": rep.host_offloaded, "device_host": runs["none"][1].memory_report().host_offloaded,
                    "master": rep.master, "states": rep.optimizer_states,
                    "owned": sum(s.numel for s in opt.owned_slices()), "shard_numel": _shard_numel(opt),
                    "state_bytes": STATE_BYTES[name]}
    # Accumulation (2 micro-batches) and clipping, stage 2 and 3, fp32 SGD, against DDP.
    for stage in (2, 3):
        ref, _, ref_norms = train_reference(Net, OPTIMIZERS["sgd"], torch.float32, rank, clip=0.05)
        cfg = zerodp.Config(stage=stage, unit_min_params=10, grad_accumulation_steps=2, offload_optimizer="host")
        model, opt, _, norms, _ = train_zerodp(Net, OPTIMIZERS["sgd"], cfg, rank, clip=0.05, micro_batches=2)
        with zerodp.gathered_parameters(model):
            out[("accumulation", stage)] = {"diff": max_rel_diff(model, ref),
                                            "norm_gap": max(abs(a - b) / b for a, b in zip(norms, ref_norms))}
    out["checkpoint"] = checkpoint_both_ways(rank, world_size)
    return out


def _shard_numel(opt) -> int:
    """Elements of the master this rank holds (the shards' owned pieces, padding excluded)."""
    return sum(m.numel() for s in opt._all_shards() for m in s.master_tensors)


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
    root = [tempfile.mkdtemp(prefix="zerodp-offload-") if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(root, src=0)
    root = root[0]
    for saved, loaded in (("host", "none"), ("none", "host")):
        for stage in (1, 3):
            def build(place):
                torch.manual_seed(0)
                cfg = zerodp.Config(stage=stage, mixed_precision="bf16", unit_min_params=10, offload_optimizer=place)
                return zerodp.initialize(Net(), OPTIMIZERS["adamw"], cfg)
            model, opt = build(saved)
            _steps(model, opt, 2, 0, rank)
            path = os.path.join(root, f"ckpt-{saved}-{stage}-{world_size}")
            zerodp.save(path, model, opt)
            on = _steps(model, opt, 2, 2, rank)
            model2, opt2 = build(loaded)
            zerodp.load(path, model2, opt2)
            out[(saved, stage)] = {"resumed": _steps(model2, opt2, 2, 2, rank) == on}
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out
