"""The world of 2 ranks of test_checkpoint_integrity.py, and the forger's helpers it shares."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
from checkpoint_cases import diffs, error_of, snapshot
from compat_model import TiedNet, config, loss_at

import zerodp


def trained(seed: int, steps: int):
    """TiedNet in bf16 at stage 2, AdamW: masters, compute weights, states, a buffer, tied names."""
    torch.manual_seed(seed)
    model, opt = zerodp.initialize(TiedNet(), torch.optim.AdamW, config(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        opt.backward(loss_at(model, step))
        opt.step()
        opt.zero_grad()
    return model, opt


def rehash(ckpt: str, name: str, listed_as: str | None = None) -> None:
    """What a forger does after changing a file: list its true size and sha256 in COMPLETE."""
    marker = os.path.join(ckpt, "COMPLETE")
    with open(marker) as f:
        complete = json.load(f)
    complete["files"][listed_as or name] = forged_digest(os.path.join(ckpt, name))
    with open(marker, "w") as f:
        json.dump(complete, f)


def forged_digest(file: str) -> dict:
    """Size and sha256 of what `file` leads to (a link followed, as a forger's tools do)."""
    with open(file, "rb") as f:
        data = f.read()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def edit_json(ckpt: str, name: str, change) -> None:
    file = os.path.join(ckpt, name)
    with open(file) as f:
        obj = json.load(f)
    change(obj)
    with open(file, "w") as f:
        json.dump(obj, f)  # allow_nan: NaN is written as JSON's NaN, as a forger may
    rehash(ckpt, name)


# -- every rank: a world of 2 ---------------------------------------------------------------------
def two_ranks(rank: int, world_size: int, root: str) -> dict:
    out = {}
    torch.manual_seed(0)
    model, opt = zerodp.initialize(TiedNet(), torch.optim.AdamW, config(), lr=1e-2)
    opt.backward(loss_at(model, 0))
    opt.step()
    opt.zero_grad()
    run = os.path.join(root, "run")
    if rank == 0:
        os.makedirs(run)
        with open(os.path.join(run, "train.log"), "w") as f:
            f.write("mine\n")
    torch.distributed.barrier()
    out["save_onto_run"] = error_of(lambda: zerodp.save(run, model, opt))
    out["run_listing"] = sorted(os.listdir(run))
    good = zerodp.save(os.path.join(root, "good"), model, opt)
    torch.distributed.barrier()
    out["good_listing"] = sorted(os.listdir(good))
    tampered = {}
    if rank == 0:  # rank 1's files, read by rank 1 alone: rank 0 must refuse too
        for case in ("rng", "link", "lr"):
            ckpt = os.path.join(root, case)
            shutil.copytree(good, ckpt)
            tampered[case] = ckpt
        edit_json(tampered["rng"], "rank1.json", lambda obj: obj["rng"].update(torch="AAAA"))
        link = os.path.join(tampered["link"], "rank1.safetensors")
        os.replace(link, os.path.join(root, "outside.safetensors"))
        os.symlink(os.path.join(root, "outside.safetensors"), link)
        edit_json(tampered["lr"], "metadata.json", lambda meta: meta["param_groups"][0].update(lr="0.1; rm -rf /"))
    torch.distributed.barrier()
    opt.backward(loss_at(model, 1))
    opt.step()
    opt.zero_grad()
    for case in ("rng", "link", "lr"):
        before = snapshot(model, opt)
        out[case] = {"error": error_of(lambda case=case: zerodp.load(os.path.join(root, case), model, opt)),
                     "changed": diffs(before, snapshot(model, opt))}
    out["tp"] = tensor_parallel(rank, root)
    return out


class TwoLayers(torch.nn.Module):
    tensor_parallel_plan = {"fc": "colwise", "proj": "rowwise"}

    def __init__(self):
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.proj(torch.relu(self.fc(x))).square().mean()


def tensor_parallel(rank: int, root: str) -> dict:
    """Under tensor parallelism: a save, a step, and the load puts back what was saved
    (full_state_dict whole, in the plain model's shapes); another model's checkpoint is
    refused on every rank; the DCP state dicts (`model.state_dict()`, `optimizer.state_dict()`)
    hold the plain model's shapes, as one process has them."""
    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model, opt = zerodp.initialize(TwoLayers(), torch.optim.AdamW, zerodp.Config(
            stage=stage, tensor_parallel_size=2), lr=1e-2)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        opt.backward(model(x))
        opt.step()
        saved = zerodp.full_state_dict(model, opt)
        path = zerodp.save(os.path.join(root, f"tp{stage}"), model, opt)
        opt.backward(model(x))
        opt.step()
        res = {"other_model": error_of(lambda: zerodp.load(os.path.join(root, "good"), model, opt)),
               "shapes": {k: list(v.shape) for k, v in saved.items()},
               "plain_shapes": {k: list(v.shape) for k, v in TwoLayers().state_dict().items()}}
        zerodp.load(path, model, opt)
        res["round_trip"] = all(torch.equal(v, saved[k]) for k, v in zerodp.full_state_dict(model, opt).items())
        res["state_dict_shapes"] = {k: list(v.shape) for k, v in model.state_dict().items()}
        res["optimizer_state_shapes"] = sorted({tuple(v.shape) for entry in opt.state_dict()["state"].values()
                                                for v in entry.values() if v.dim() > 0})
        out[stage] = res
    return out
