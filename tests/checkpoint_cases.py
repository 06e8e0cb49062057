"""Checkpoint cases, run inside one spawned world per world size (see test_checkpoint.py).

The worlds run in order 1 -> 4 -> 2 -> 1 over one shared directory, so each can load what
an earlier one saved at another world size. Each case returns plain values (tensors on
CPU at most); the tests assert on them in the parent process.
"""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import zerodp
from zerodp.checkpoint import files as ckpt_files
from zerodp.checkpoint import format as ckpt_format
from zerodp.checkpoint import reader as ckpt_reader
from zerodp.demo.models import GPT, Block, GPTConfig

TRAIN = 3  # steps before the save, and after it
SMALL_BUCKET = 4096  # bytes: the model spans several buckets


# GPT('tiny') without biases. With a bias, the key projection's bias has a gradient that is
# zero in exact arithmetic (softmax is invariant to adding a constant to every score), so
# its computed gradient is pure rounding noise, which Adam normalises into full-size
# steps: two world sizes then drift apart by ~1e-4 there, checkpoint or not.
TINY = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=False)


class LM(nn.Module):
    """A tiny GPT (tied embedding and head) plus a frozen parameter, a buffer and dropout:
    everything a checkpoint must carry besides the trainable parameters."""

    def __init__(self, dropout: float = 0.0, cfg=TINY):
        super().__init__()
        self.gpt = GPT(cfg)
        vocab = self.gpt.config.vocab_size
        self.out_bias = nn.Parameter(torch.randn(vocab) * 0.01, requires_grad=False)
        self.register_buffer("temperature", torch.tensor(0.75))
        self.drop = nn.Dropout(dropout)

    def forward(self, idx, targets):
        logits, _ = self.gpt(idx)
        logits = self.drop(logits) / self.temperature + self.out_bias
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def config(stage, **kw):
    """The cases' Config: small buckets for stages 0-2, one unit per transformer Block at stage 3."""
    return zerodp.Config(stage=stage, bucket_bytes=SMALL_BUCKET, unit_modules=(Block,) if stage == 3 else (), **kw)


def adamw_groups(params):
    params = list(params)
    return torch.optim.AdamW([
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 3e-3},
    ], lr=1e-3)


def sgd(params):
    return torch.optim.SGD(list(params), lr=0.01, momentum=0.9)


def rng_batch(step, rank, world_size):
    """Drawn from the global torch, python and numpy RNGs: the same after a resume only if
    the checkpoint restored all three."""
    t = random.randint(8, 16)
    idx = (torch.randint(0, 256, (2, t + 1)) + int(np.random.randint(0, 256))) % 256
    return idx[:, :-1], idx[:, 1:]


def fixed_batch(step, rank, world_size):
    """One global batch of 4 sequences per step, split across ranks: every world size
    trains on the same data, so runs at different world sizes agree."""
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 256, (4, 17), generator=g)
    rows = slice(rank * 4 // world_size, (rank + 1) * 4 // world_size)
    return idx[rows, :-1].contiguous(), idx[rows, 1:].contiguous()


def train(model, opt, steps, batch_fn, first_step=0, sched=None):
    rank, ws = opt.comm.rank, opt.comm.world_size
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = batch_fn(step, rank, ws)
        loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return losses


def seed_rngs(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def full_state(model):
    """The model's full state_dict on every rank (stage 3 holds 1-D shards of trainable
    parameters outside a gather; the gather is a no-op at stages 0-2)."""
    with zerodp.gathered_parameters(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def snapshot(model, opt):
    """Everything load may change, on this rank."""
    slices = opt.owned_slices()
    return {
        "model": full_state(model),
        "master": {(s.name, s.start): s.master.clone() for s in slices},
        "states": {(s.name, s.start, k): v.clone() for s in slices for k, v in s.states.items()},
        "scalars": opt.scalar_states(), "scaler": opt.scaler.state_dict(), "step": opt.step_count,
        "hyper": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
    }


def same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def diffs(a: dict, b: dict) -> list:
    """Keys of two snapshots whose values differ."""
    return [k for k in a if not same(a[k], b.get(k))]


def max_abs(a: dict, b: dict) -> float:
    """Largest elementwise |a - b| over floating tensors, compared in fp32."""
    worst = 0.0
    for k, v in a.items():
        if v.is_floating_point():
            worst = max(worst, float((v.float() - b[k].float()).abs().max()))
    return worst


def sgd_continuation(weights: dict, stage: int) -> dict:
    """TRAIN steps of plain SGD with momentum (sgd(): lr 0.01, momentum 0.9) from `weights`,
    at this world's size and `stage`: the strict, scale-sensitive comparison of a resharded
    run (see tolerances.CKPT_SGD_TOL); AdamW's continuation has no small derived bound."""
    torch.manual_seed(321)  # replaced by `weights` whole
    model, opt = zerodp.initialize(LM(), sgd, config(stage))
    zerodp.load_pretrained(model, weights, opt)
    train(model, opt, TRAIN, fixed_batch, first_step=TRAIN)
    return full_state(model)


def max_rel(a: dict, b: dict) -> float:
    """Largest ||a-b|| / ||b|| over floating tensors, compared in fp32."""
    worst = 0.0
    for k, v in a.items():
        if v.is_floating_point():
            w = b[k].float()
            worst = max(worst, float((v.float() - w).norm() / w.norm().clamp_min(1e-12)))
    return worst


def saved_arrays(path) -> dict:
    """Every element range of every master and optimizer state in a checkpoint, assembled
    per parameter: what a checkpoint holds, independently of how it was sharded."""
    path, meta, files = ckpt_reader.open_checkpoint(path)
    out = {}
    with ckpt_reader.Reader(path, files) as reader:
        for name, info in meta["params"].items():
            numel = int(np.prod(info["shape"]))
            for kind in ["master"] + [f"state/{k}" for k in meta["state_keys"]]:
                out[(kind, name)] = reader.read_runs(kind, name, info, [(0, 0, numel)], numel, torch.float32)
    return out, meta


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the tests assert on type and message
        return f"{type(e).__name__}: {e}"
    return None


def barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# -- resharding: save at one world size/stage, continue at another ---------------------------
def save_for_reshard(root, tag, stage, rank):
    """Train, save, train on: the uninterrupted run the loaders compare against."""
    torch.manual_seed(0)
    model, opt = zerodp.initialize(LM(), adamw_groups, config(stage))
    train(model, opt, TRAIN, fixed_batch)
    path = zerodp.save(os.path.join(root, tag, f"step{TRAIN}"), model, opt, data_position=TRAIN)
    at_save = full_state(model)
    train(model, opt, TRAIN, fixed_batch, first_step=TRAIN)
    return {"path": path, "at_save": at_save, "end": full_state(model), "sgd_end": sgd_continuation(at_save, stage)}


def resume_from(root, saved_path, stage, tag):
    """Load another world's or stage's checkpoint, check it round-trips exactly, train on."""
    torch.manual_seed(123)  # a different initialisation: everything must come from the checkpoint
    model, opt = zerodp.initialize(LM(), adamw_groups, config(stage))
    extra = zerodp.load(saved_path, model, opt)
    after_load = full_state(model)
    again = zerodp.save(os.path.join(root, "roundtrip", tag), model, opt)
    arrays_then, meta_then = saved_arrays(saved_path)
    arrays_now, meta_now = saved_arrays(again)
    train(model, opt, TRAIN, fixed_batch, first_step=TRAIN)
    return {"extra": extra, "after_load": after_load, "end": full_state(model),
            "sgd_end": sgd_continuation(after_load, stage), "roundtrip_equal": same(arrays_then, arrays_now),
            "roundtrip_meta_equal": all(meta_then[k] == meta_now[k] for k in
                                        ("step", "scalar_states", "param_groups", "state_keys"))
            and stored_keys(meta_then) == stored_keys(meta_now)}


def stored_keys(meta):
    """The state dict's keys and names; a frozen parameter is "frozen" (sharded) in a stage-3
    checkpoint and "replicated" in a stage 0-2 one, the same tensor either way."""
    return [[key, "replicated" if kind == "frozen" else kind, src] for key, kind, src in meta["state_dict_keys"]]


def world_one_first(rank, world_size, root):
    return {"r1": save_for_reshard(root, "r1", 2, rank), "r1s3": save_for_reshard(root, "r1s3", 3, rank)}


def world_four(rank, world_size, root):
    return {"from1": resume_from(root, os.path.join(root, "r1", f"step{TRAIN}"), 2, "4_from1"),
            "from1s3": resume_from(root, os.path.join(root, "r1s3", f"step{TRAIN}"), 3, "4_from1s3"),
            "r4": save_for_reshard(root, "r4", 2, rank)}


def world_one_last(rank, world_size, root):
    return {"from2": resume_from(root, os.path.join(root, "r2s2", f"step{TRAIN}"), 1, "1_from2")}


# -- bitwise resume at the same world size and stage -----------------------------------------
def bitwise_resume(root, stage, precision, rank):
    cfg = config(stage, mixed_precision=precision,
                 **({"initial_loss_scale": 1024.0, "loss_scale_growth_interval": 2} if precision == "fp16" else {}))
    path = os.path.join(root, f"bitwise_s{stage}_{precision}")

    def fresh(seed):
        torch.manual_seed(seed)
        model, opt = zerodp.initialize(LM(dropout=0.1), adamw_groups, cfg)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, opt, sched

    model, opt, sched = fresh(0)
    seed_rngs(10 + rank)
    train(model, opt, TRAIN, rng_batch, sched=sched)
    zerodp.save(path, model, opt, sched=sched.state_dict(), data_position=TRAIN)
    losses = train(model, opt, TRAIN, rng_batch, sched=sched)
    recorded = snapshot(model, opt)

    seed_rngs(999)  # a fresh process: other RNG states, other initial weights
    model, opt, sched = fresh(1)
    extra = zerodp.load(path, model, opt)
    sched.load_state_dict(extra["sched"])
    resumed_losses = train(model, opt, TRAIN, rng_batch, sched=sched)
    resumed = snapshot(model, opt)
    return {"losses": losses, "resumed_losses": resumed_losses, "diffs": diffs(recorded, resumed),
            "data_position": extra["data_position"], "scale": recorded["scaler"]["scale"]}


# -- a save that fails part-way ---------------------------------------------------------------
def crash_during_save(root, rank):
    cfg = zerodp.Config(stage=2, bucket_bytes=SMALL_BUCKET)
    torch.manual_seed(0)
    model, opt = zerodp.initialize(LM(), adamw_groups, cfg)
    train(model, opt, TRAIN, fixed_batch)
    good = zerodp.save(os.path.join(root, "crash", "step3"), model, opt)
    at_good = snapshot(model, opt)
    train(model, opt, 1, fixed_batch, first_step=TRAIN)
    out = {}

    # Rank 1 dies of a full disk half-way through writing its shard.
    real_write = ckpt_files.write_safetensors

    def half_write(file, tensors):
        real_write(file, tensors)
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)
        raise OSError(28, "No space left on device")

    if rank == 1:
        ckpt_files.write_safetensors = half_write
    try:
        out["rank1_fails"] = error_of(lambda: zerodp.save(os.path.join(root, "crash", "step4"), model, opt))
    finally:
        ckpt_files.write_safetensors = real_write
    barrier()
    out["after_rank1_fails"] = {"latest": zerodp.latest(os.path.join(root, "crash")),
                                "listing": sorted(os.listdir(os.path.join(root, "crash")))}
    # Every rank has looked before rank 0 starts the next save: without this barrier a slow
    # rank 1 lists rank 0's next save in progress (its .staging-/.tmp- directory).
    barrier()

    # Rank 0 fails writing COMPLETE (a full disk at the last moment), to a new path and to
    # the path of the previous checkpoint: nothing partial is left, the previous one stays.
    real_write_json = ckpt_files.write_json

    def no_marker(file, obj):
        if os.path.basename(file).startswith(ckpt_format.COMPLETE):
            raise OSError(28, "No space left on device")
        return real_write_json(file, obj)

    if rank == 0:
        ckpt_files.write_json = no_marker
    try:
        out["rank0_fails"] = error_of(lambda: zerodp.save(os.path.join(root, "crash", "step5"), model, opt))
        out["rank0_fails_overwrite"] = error_of(lambda: zerodp.save(good, model, opt))
    finally:
        ckpt_files.write_json = real_write_json
    barrier()
    out["after_rank0_fails"] = {"latest": zerodp.latest(os.path.join(root, "crash")),
                                "listing": sorted(os.listdir(os.path.join(root, "crash")))}
    out["load_incomplete"] = error_of(lambda: zerodp.load(os.path.join(root, "crash", "step5"), model, opt))
    # The previous checkpoint still loads, exactly.
    zerodp.load(good, model, opt)
    out["good_path"] = good
    out["reloaded_diffs"] = [k for k in diffs(at_good, snapshot(model, opt)) if k != "rng"]
    return out


# -- bad input: a clear error and nothing changed ------------------------------------------------
def _damaged_copies(root, good):
    """Rank 0 makes one damaged copy of `good` per kind of damage."""
    bad = os.path.join(root, "bad")
    cases = {}

    def copy(name):
        dst = os.path.join(bad, name)
        shutil.copytree(good, dst)
        cases[name] = dst
        return dst

    os.remove(os.path.join(copy("missing_shard"), "rank1.safetensors"))
    f = os.path.join(copy("truncated_shard"), "rank0.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    f = os.path.join(copy("corrupt_shard"), "rank1.safetensors")
    with open(f, "r+b") as fh:  # same size, one byte of tensor data flipped
        fh.seek(os.path.getsize(f) - 7)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))
    os.remove(os.path.join(copy("incomplete"), ckpt_format.COMPLETE))
    not_ckpt = os.path.join(bad, "not_a_checkpoint")
    os.makedirs(not_ckpt)
    open(os.path.join(not_ckpt, "notes.txt"), "w").close()
    cases["not_a_checkpoint"] = not_ckpt
    cases["a_file"] = os.path.join(not_ckpt, "notes.txt")
    cases["nonexistent"] = os.path.join(bad, "nope")
    return cases


def _bad_sources(root, rank):
    """A good stage-2 bf16 checkpoint, damaged copies of it, checkpoints of another model
    and of another optimizer, and bad full state_dicts; the same files on every rank."""
    cfg = config(2, mixed_precision="bf16")
    torch.manual_seed(0)
    model, opt = zerodp.initialize(LM(), adamw_groups, cfg)
    train(model, opt, TRAIN, fixed_batch)
    good = zerodp.save(os.path.join(root, "bad_src", "good"), model, opt)
    torch.manual_seed(0)
    other_cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=16)
    other, other_opt = zerodp.initialize(LM(cfg=other_cfg), adamw_groups, cfg)
    other_path = zerodp.save(os.path.join(root, "bad_src", "other_model"), other, other_opt)
    torch.manual_seed(0)
    m_sgd, o_sgd = zerodp.initialize(LM(), sgd, cfg)
    train(m_sgd, o_sgd, 1, fixed_batch)
    sgd_path = zerodp.save(os.path.join(root, "bad_src", "sgd"), m_sgd, o_sgd)
    if rank == 0:
        cases = _damaged_copies(root, good)
    barrier()
    if rank != 0:
        cases = {k: os.path.join(root, "bad", k) for k in ("missing_shard", "truncated_shard", "corrupt_shard",
                                                           "incomplete", "not_a_checkpoint", "nope")}
        cases["a_file"] = os.path.join(root, "bad", "not_a_checkpoint", "notes.txt")
        cases["nonexistent"] = cases.pop("nope")
    cases["other_model"] = other_path
    cases["other_optimizer"] = sgd_path
    full = zerodp.consolidate(good)
    pretrained_cases = {
        "pretrained_missing": {k: v for k, v in full.items() if k != "gpt.transformer.ln_f.weight"},
        "pretrained_shape": dict(full, **{"gpt.transformer.wpe.weight": torch.zeros(3, 3)}),
        "pretrained_unexpected": dict(full, extra_head=torch.zeros(2)),
        "pretrained_no_file": os.path.join(root, "bad", "none.safetensors"),
    }
    return model, opt, good, cases, pretrained_cases


def _try_bad(model, opt, good, cases, pretrained_cases):
    """Each bad input's error and what it changed (nothing, if load validates first)."""
    out = {}
    for name, path in cases.items():
        before = snapshot(model, opt)
        err = error_of(lambda path=path: zerodp.load(path, model, opt))
        out[name] = {"error": err, "changed": diffs(before, snapshot(model, opt))}
    for name, source in pretrained_cases.items():
        before = snapshot(model, opt)
        err = error_of(lambda source=source: zerodp.load_pretrained(model, source, opt))
        out[name] = {"error": err, "changed": diffs(before, snapshot(model, opt))}
    # The good checkpoint still loads after all that.
    out["good_loads"] = error_of(lambda: zerodp.load(good, model, opt))
    return out


def bad_inputs(root, rank):
    """Bad input into a stage-2 model and into a stage-3 one, each moved away from the
    checkpoint's values first."""
    model, opt, good, cases, pretrained_cases = _bad_sources(root, rank)
    train(model, opt, 1, fixed_batch, first_step=TRAIN)
    out = {2: _try_bad(model, opt, good, cases, pretrained_cases)}
    torch.manual_seed(0)
    model, opt = zerodp.initialize(LM(), adamw_groups, config(3, mixed_precision="bf16"))
    train(model, opt, TRAIN + 1, fixed_batch)
    out[3] = _try_bad(model, opt, good, cases, pretrained_cases)
    return out


# -- full state_dicts: consolidate, export, load_pretrained ------------------------------------
def pretrained(root, rank):
    out = {}
    # A plain GPT('tiny') trained in bf16: the parent consolidates it into an unwrapped model.
    torch.manual_seed(0)
    gpt, opt = zerodp.initialize(GPT("tiny"), adamw_groups, config(2, mixed_precision="bf16"))
    for step in range(2):
        x, y = fixed_batch(step, rank, opt.comm.world_size)
        _, loss = gpt(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    path = zerodp.save(os.path.join(root, "gpt_bf16"), gpt, opt)
    out["gpt_bf16"] = {"path": path, "state": full_state(gpt),
                       "master": {(s.name, s.start): s.master.clone() for s in opt.owned_slices()}}
    # load_pretrained from a dict (stage 1, bf16; stage 3, bf16) and from an exported file (stage 2, fp32).
    src = os.path.join(root, "r2s2", f"step{TRAIN}")
    full = zerodp.consolidate(src)
    exported = os.path.join(root, "export", "lm.safetensors")
    if rank == 0:
        zerodp.export(src, exported)
    barrier()
    for tag, stage, precision, source in (("dict_s1_bf16", 1, "bf16", full), ("file_s2_fp32", 2, "fp32", exported),
                                          ("dict_s3_bf16", 3, "bf16", full)):
        torch.manual_seed(7)
        model, o = zerodp.initialize(LM(), adamw_groups, config(stage, mixed_precision=precision))
        zerodp.load_pretrained(model, source, o)
        dtype = o.config.compute_dtype
        got = full_state(model)
        out[tag] = {"equal": all(torch.equal(got[k], full[k].to(dtype)) for k in full),
                    "master_equal": all(torch.equal(s.master, full_flat(full, s)) for s in o.owned_slices()),
                    "keys": sorted(got) == sorted(full),
                    "trains": train(model, o, 1, fixed_batch)[0]}
    return out


def full_flat(full, s):
    return full[s.name].reshape(-1)[s.start: s.start + s.numel].float()


def world_two(rank, world_size, root):
    out = {}
    # Resharding: 4 -> 2 (and stage 2 -> 1), then stage changes at the same world size.
    out["from4"] = resume_from(root, os.path.join(root, "r4", f"step{TRAIN}"), 1, "2_from4")
    for stage in (0, 1, 2, 3):
        out[f"r2s{stage}"] = save_for_reshard(root, f"r2s{stage}", stage, rank)
    for src, dst in ((1, 2), (2, 1), (0, 2), (2, 0), (2, 3), (3, 2)):
        out[f"s{src}_to_s{dst}"] = resume_from(root, out[f"r2s{src}"]["path"], dst, f"2_s{src}_to_s{dst}")
    for stage in (1, 2, 3):
        for precision in ("bf16", "fp16"):
            out[("bitwise", stage, precision)] = bitwise_resume(root, stage, precision, rank)
    out["crash"] = crash_during_save(root, rank)
    out["bad"] = bad_inputs(root, rank)
    out["pretrained"] = pretrained(root, rank)
    return out


def save_repeatedly(path, times, seed):
    """One single-process job saving `times` checkpoints to `path` (see the test of two
    jobs saving to one path at once)."""
    import torch.nn as nn

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model, opt = zerodp.initialize(nn.Linear(8, 8), torch.optim.AdamW, zerodp.Config(stage=2), lr=1e-3)
    errors = []
    for _ in range(times):
        try:
            zerodp.save(path, model, opt)
        except Exception as e:  # noqa: BLE001  (counted by the test)
            errors.append(f"{type(e).__name__}: {e}")
    return errors
