"""Cases of test_checkpoint_defects.py that need several ranks, one per call in the
session's worlds (worldpool.py). Each returns plain values the test asserts on."""
from __future__ import annotations

import math
import os
import shutil

import torch
from checkpoint_cases import diffs, error_of, full_state, snapshot
from checkpoint_integrity_cases import TwoLayers, edit_json
from compat_model import TiedNet, loss_at

import zerodp
from zerodp.checkpoint.reader import Reader, open_checkpoint
from zerodp.demo.models import GPT, GPTConfig

STEPS = 2  # before the save, and after it
DEEP = "[" * 100_000  # JSON nested deeper than Python's recursion limit


# -- models and optimizers ------------------------------------------------------------------------
def gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16))


def gpt_loss(model, step: int) -> torch.Tensor:
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 + step))
    return model(x, x)[1]


def muon_recipe(model):
    """docs/optimizers.md's recipe: Muon for the hidden matrices, AdamW for the rest."""
    hidden, rest = zerodp.split_hidden_matrices(model)
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-4)]


def _weights_and_rest(model) -> tuple[list, list]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]


def sgd_mixed(model):
    """Momentum on the weights, none on norms and biases: the latter have no momentum_buffer."""
    weights, rest = _weights_and_rest(model)
    return torch.optim.SGD([{"params": weights, "momentum": 0.9}, {"params": rest, "momentum": 0.0}], lr=0.05)


def adamw_amsgrad_one_group(model):
    """max_exp_avg_sq in the weights' group only."""
    weights, rest = _weights_and_rest(model)
    return torch.optim.AdamW([{"params": weights, "amsgrad": True}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, weight_decay=0.1)


OPTIMIZERS = {"sgd_mixed": sgd_mixed, "adamw_amsgrad_one_group": adamw_amsgrad_one_group}


def saved_arrays(path: str) -> dict:
    """Every master and optimizer state a checkpoint holds, by parameter, whole (one process)."""
    path, meta, files = open_checkpoint(path)
    out = {}
    with Reader(path, files) as reader:
        for name, info in meta["params"].items():
            numel = math.prod(info["shape"])
            for kind in ["master"] + [f"state/{k}" for k in info.get("states", meta["state_keys"])]:
                out[(kind, name)] = reader.read_runs(kind, name, info, [(0, 0, numel)] if numel else [], numel,
                                                     torch.float32)
    return out


# -- 1: the Muon + AdamW recipe ------------------------------------------------------------------
def _train(model, opt, steps: int, first: int, loss_fn) -> None:
    for step in range(first, first + steps):
        opt.backward(loss_fn(model, step))
        opt.step()
        opt.zero_grad()


def muon_recipe_case(rank, world_size, root: str, save_stage: int, load_stages: tuple) -> dict:
    """Saved at `save_stage`; loaded into fresh models at each of `load_stages` (same world
    size), each saved again; at the save's stage, STEPS more steps after the load."""
    torch.manual_seed(0)
    model = gpt()
    model, opt = zerodp.initialize(model, muon_recipe(model), zerodp.Config(stage=save_stage))
    _train(model, opt, STEPS, 0, gpt_loss)
    path = zerodp.save(os.path.join(root, "saved"), model, opt)
    out = {"path": path, "at_save": full_state(model), "loads": {}}
    _train(model, opt, STEPS, STEPS, gpt_loss)
    out["uninterrupted"] = full_state(model)
    for stage in load_stages:
        torch.manual_seed(1)  # other initial weights: the load must replace them all
        model = gpt()
        model, opt = zerodp.initialize(model, muon_recipe(model), zerodp.Config(stage=stage))
        zerodp.load(path, model, opt)
        res = {"loaded": full_state(model),
               "resaved": zerodp.save(os.path.join(root, f"resaved_stage{stage}"), model, opt)}
        if stage == save_stage:
            _train(model, opt, STEPS, STEPS, gpt_loss)
            res["continued"] = full_state(model)
        out["loads"][stage] = res
    return out


# -- 2: param groups whose optimizer states differ ---------------------------------------------
def mixed_states_case(rank, world_size, root: str, opt_name: str, stage: int) -> dict:
    """Save after STEPS steps, then STEPS more: the uninterrupted run. A fresh run (other
    initial weights) loads the checkpoint and takes the same STEPS steps."""
    cfg = zerodp.Config(stage=stage, bucket_bytes=1024)
    torch.manual_seed(0)
    model = TiedNet()
    model, opt = zerodp.initialize(model, OPTIMIZERS[opt_name](model), cfg)
    _train(model, opt, STEPS, 0, loss_at)
    path = zerodp.save(os.path.join(root, f"{opt_name}_stage{stage}"), model, opt)
    _train(model, opt, STEPS, STEPS, loss_at)
    uninterrupted = full_state(model)
    torch.manual_seed(1)
    fresh = TiedNet()
    fresh, fresh_opt = zerodp.initialize(fresh, OPTIMIZERS[opt_name](fresh), cfg)
    error = error_of(lambda: zerodp.load(path, fresh, fresh_opt))
    if error is not None:
        return {"error": error}
    _train(fresh, fresh_opt, STEPS, STEPS, loss_at)
    return {"error": None, "path": path, "uninterrupted": uninterrupted, "resumed": full_state(fresh)}


# -- 3: tampered tensor-parallel checkpoints ---------------------------------------------------
def _split_parts_changed(meta: dict) -> None:
    # fc.weight [16, 8], split along dim 0 in 2: 2 parts still cut 16 rows evenly.
    meta["params"]["fc.weight"]["split"]["parts"] = 2


def _piece_at_another_rank(meta: dict) -> None:
    # Tensor-parallel rank 0's piece pointed at rank 1's file, which holds a tensor of the
    # same name and size: tensor-parallel rank 1's slice.
    pieces = meta["params"]["fc.weight"]["pieces"]
    assert pieces[0][0] == 0 and pieces[0][3] == 0, pieces
    pieces[0][0] = 1


TAMPERS = {"split_parts_changed": _split_parts_changed, "piece_at_another_rank": _piece_at_another_rank}


def tampered_tp_case(rank, world_size, root: str, stage: int) -> dict:
    """DP x TP = 1 x 2: a good save, tampered copies made by rank 0 (metadata.json edited,
    COMPLETE rehashed), then every rank loads each: errors, and what the load changed."""
    torch.manual_seed(0)
    model, opt = zerodp.initialize(TwoLayers(), torch.optim.AdamW, zerodp.Config(
        stage=stage, tensor_parallel_size=2), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    opt.backward(model(x))
    opt.step()
    good = zerodp.save(os.path.join(root, "good"), model, opt)
    if rank == 0:
        for case, change in TAMPERS.items():
            shutil.copytree(good, os.path.join(root, case))
            edit_json(os.path.join(root, case), "metadata.json", change)
    torch.distributed.barrier()
    opt.backward(model(x))
    opt.step()
    out = {}
    for case in TAMPERS:
        before = snapshot(model, opt)
        out[case] = {"path": os.path.join(root, case),
                     "error": error_of(lambda case=case: zerodp.load(os.path.join(root, case), model, opt)),
                     "changed": diffs(before, snapshot(model, opt))}
    out["good"] = error_of(lambda: zerodp.load(good, model, opt))
    return out


# -- 4: a malformed marker beside a save with keep_last -------------------------------------------
def tidying_beside_malformed_json_case(rank, world_size, root: str) -> dict:
    """A planted COMPLETE nested too deeply, then a save with keep_last; a leftover whose
    OWNER is nested too deeply, then a save that removes stale leftovers."""
    torch.manual_seed(0)
    model, opt = zerodp.initialize(TiedNet(), torch.optim.AdamW, zerodp.Config(stage=1, bucket_bytes=1024), lr=1e-2)
    _train(model, opt, 1, 0, loss_at)
    if rank == 0:
        planted = os.path.join(root, "planted")
        os.makedirs(planted)
        with open(os.path.join(planted, "COMPLETE"), "w") as f:
            f.write(DEEP)
    torch.distributed.barrier()
    out = {"keep_last": error_of(lambda: zerodp.save(os.path.join(root, "step_1"), model, opt, keep_last=1))}
    out["after_keep_last"] = sorted(os.listdir(root))
    torch.distributed.barrier()  # every rank has listed before rank 0 plants the leftover
    if rank == 0:
        leftover = os.path.join(root, "step_1.tmp-0123456789ab")
        os.makedirs(leftover)
        with open(os.path.join(leftover, "OWNER"), "w") as f:
            f.write(DEEP)
    torch.distributed.barrier()
    out["stale_owner"] = error_of(lambda: zerodp.save(os.path.join(root, "step_2"), model, opt))
    out["after_stale_owner"] = sorted(os.listdir(root))
    return out


# -- save's arguments must agree ---------------------------------------------------------------
def disagreeing_arguments_case(rank, world_size, root: str) -> dict:
    torch.manual_seed(0)
    model, opt = zerodp.initialize(TiedNet(), torch.optim.AdamW, zerodp.Config(stage=1, bucket_bytes=1024), lr=1e-2)
    _train(model, opt, 1, 0, loss_at)
    out = {"keep_last": error_of(lambda: zerodp.save(os.path.join(root, "a"), model, opt, keep_last=2 + rank)),
           "asynchronous": error_of(lambda: zerodp.save(os.path.join(root, "b"), model, opt,
                                                        asynchronous=rank == 0))}
    torch.distributed.barrier()
    out["listing"] = sorted(os.listdir(root))
    torch.distributed.barrier()  # every rank has listed before any starts the next save's staging
    # The ranks are still paired: a save with agreeing arguments works.
    out["agreeing"] = error_of(lambda: zerodp.save(os.path.join(root, "c"), model, opt, keep_last=2))
    return out
