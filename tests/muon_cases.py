"""Cases for optimizers that step whole parameters (test_muon.py), one per call in the
session's worlds (worldpool.py): torch's Muon (alone, or in the Muon + AdamW recipe) and
Adafactor under zerodp against one process stepping the same torch optimizers on the
global batch.

The reference sums the ranks' gradients as one process would accumulate them, rank after
rank (`.grad` += each rank's micro-batch gradient), then divides by N: the mean gradient of
the global batch (every rank's batch has the same size). Each case returns plain numbers.
"""
from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn

import zerodp
from zerodp.memory import formula_bytes
from zerodp import split_hidden_matrices

STEPS = 4
MUON_LR, ADAMW_LR = 0.02, 1e-2
SMALL_BUCKET = 256  # bytes: 64 fp32 elements, so the recipe's AdamW group spans several buckets


class RecipeNet(nn.Module):
    """Hidden matrices 13x7 and 9x13 (91 and 117 elements: no N > 1 divides them), a norm,
    biases and a head: the Muon + AdamW recipe's split."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 9)
        self.head = nn.Linear(9, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.norm(self.fc1(x))))))


class MatNet(nn.Module):
    """Only matrices (13x7, 9x13, 5x9: 91 + 117 + 45 = 253 elements): Muon alone steps it all."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 13, bias=False)
        self.fc2 = nn.Linear(13, 9, bias=False)
        self.head = nn.Linear(9, 5, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class WholeSGD(torch.optim.SGD):
    """A user's own optimizer that declares it needs whole parameters; records the shapes
    its step is handed."""

    zerodp_whole_params = True
    seen: list = []

    def step(self, closure=None):
        WholeSGD.seen.extend(tuple(p.shape) for g in self.param_groups for p in g["params"])
        return super().step(closure)


def recipe(model):
    """The documented recipe (docs/optimizers.md): Muon for the hidden matrices, AdamW for the rest."""
    hidden, rest = split_hidden_matrices(model, exclude=("head",))
    return [torch.optim.Muon(hidden, lr=MUON_LR, momentum=0.95),
            torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.1)]


def muon_only(model):
    return [torch.optim.Muon(model.parameters(), lr=MUON_LR, momentum=0.95)]


def adafactor_only(model):
    return [torch.optim.Adafactor(model.parameters(), lr=1e-2)]


RECIPES = {"recipe": (RecipeNet, recipe), "muon": (MatNet, muon_only), "adafactor": (MatNet, adafactor_only)}


def batch(step: int, rank: int, micro: int = 0, rows: int = 4):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(rows, 7, generator=g), torch.randn(rows, 5, generator=g)


def loss_of(model, step, rank, micro, dtype):
    x, y = batch(step, rank, micro)
    return (model(x.to(dtype)).float() - y).pow(2).mean()


def reference(kind, n, dtype=torch.float32, micro=1, clip=None, steps=STEPS):
    """One process, the same torch optimizers, the global batch; under bf16 a bf16 compute
    copy and fp32 masters (the recipe zerodp follows)."""
    model_fn, make = RECIPES[kind]
    torch.manual_seed(0)
    master = model_fn()
    compute = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
    opts = make(master)
    for step in range(steps):
        for r in range(n):
            for m in range(micro):
                (loss_of(compute, step, r, m, dtype) / micro).backward()
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad = c.grad.float() / n if c is not p else c.grad.div_(n)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(master.parameters()), clip)
        for o in opts:
            o.step()
            o.zero_grad()
        compute.zero_grad()
        if compute is not master:
            with torch.no_grad():
                for p, c in zip(master.parameters(), compute.parameters()):
                    c.copy_(p)
    return master


def train(kind, cfg, rank, micro=1, clip=None, steps=STEPS):
    model_fn, make = RECIPES[kind]
    torch.manual_seed(0)
    model = model_fn()
    model, opt = zerodp.initialize(model, make(model), cfg)
    dtype = cfg.compute_dtype
    volumes = []
    for step in range(steps):
        for m in range(micro):
            opt.backward(loss_of(model, step, rank, m, dtype))
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        volumes.append(opt.comm.ledger.summary())
    return model, opt, volumes


def full_params(model, opt) -> dict:
    """Every parameter whole, fp32 (the compute values), by name."""
    if opt.config.stage == 3:
        with zerodp.gathered_parameters(model):
            return {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def diff(ours: dict, ref: nn.Module) -> float:
    theirs = dict(ref.named_parameters())
    return max(float((p - theirs[n].detach().float()).abs().max()) for n, p in ours.items())


def parity_case(rank, world_size, stage, kind, precision="fp32", micro=1, clip=None, offload=None, units=(),
                offload_dir=None, offload_params=None):
    """zerodp against the one-process reference, and what the step communicated."""
    kw = dict(stage=stage, mixed_precision=precision, bucket_bytes=SMALL_BUCKET, unit_modules=units)
    if micro > 1:
        kw["grad_accumulation_steps"] = micro
    if offload:
        kw["offload_optimizer"] = offload
    if offload_dir:
        kw["offload_dir"] = offload_dir
    if offload_params:
        kw["offload_params"] = offload_params
    cfg = zerodp.Config(**kw)
    model, opt, volumes = train(kind, cfg, rank, micro, clip)
    ref = reference(kind, world_size, cfg.compute_dtype, micro, clip)
    rep = opt.memory_report()
    return {"diff": diff(full_params(model, opt), ref), "volume": volumes[-1]["volume_numel"],
            "by_op": volumes[-1]["by_op"], "padded": rep.padded_numel, "numel": rep.numel,
            "alignment_padding": rep.alignment_padding, "owned": rep.owned_numel,
            "shapes": sorted({tuple(m.shape) for m in opt.stepper.masters()})}


def ledger_case(rank, world_size, stage):
    """MatNet under Muon, fp32: the layout's padding and each rank's owned elements, the
    step's traffic and the memory by category, to compare with a hand count."""
    cfg = zerodp.Config(stage=stage)
    model, opt, volumes = train("muon", cfg, rank, steps=2)  # the first step also counts init's broadcast
    rep = opt.memory_report()
    expect = formula_bytes(stage, rep.padded_numel, world_size, 4, 4, 0, 0)
    WholeSGD.seen.clear()
    torch.manual_seed(0)
    declared, declared_opt = zerodp.initialize(MatNet(), WholeSGD, zerodp.Config(stage=stage), lr=0.1)
    declared_opt.backward(declared(torch.ones(2, 7)).sum())
    declared_opt.step()
    return {"padded": rep.padded_numel, "numel": rep.numel, "alignment_padding": rep.alignment_padding,
            "owned": rep.owned_numel, "imbalance": rep.owned_imbalance, "by_op": volumes[-1]["by_op"],
            "got": {k: getattr(rep, k) for k in ("params", "grads", "master", "optimizer_states")},
            "formula": expect, "declared_shapes": sorted(set(WholeSGD.seen))}


def adafactor_case(rank, world_size, root):
    """Adafactor (factored second moment on whole matrices) at stage 2; saving its factored
    states is refused by name."""
    cfg = zerodp.Config(stage=2)
    model, opt, _ = train("adafactor", cfg, rank)
    ref = reference("adafactor", world_size)
    try:
        zerodp.save(os.path.join(root, "adafactor"), model, opt)
        refused = None
    except Exception as e:  # noqa: BLE001 - the message is the result
        refused = f"{type(e).__name__}: {e}"
    return {"diff": diff(full_params(model, opt), ref), "refused": refused}


# -- checkpoints: saved at N = 2, loaded at M = 1 (accumulating the same micro-batches) and 4,
# at another stage, and into one process's torch Muon ---------------------------------------
SAVE_STAGE, RESUME = 2, 3  # steps after the load


def global_rows(step, world_size, rank):
    """This rank's part of the step's 8-row global batch (at N=2: batch(step, r) for r = 0, 1)."""
    x, y = zip(*(batch(step, r) for r in range(2)))
    x, y = torch.cat(x), torch.cat(y)
    per = 8 // world_size
    return x[rank * per: (rank + 1) * per], y[rank * per: (rank + 1) * per]


def _continue(model, opt, rank, world_size, micro, first):
    for step in range(first, first + RESUME):
        x, y = global_rows(step, world_size, rank)
        for m in range(micro):
            part = slice(m * len(x) // micro, (m + 1) * len(x) // micro)
            opt.backward((model(x[part]) - y[part]).pow(2).mean())
        opt.step()
        opt.zero_grad()
    return full_params(model, opt)


def save_case(rank, world_size, root):
    """N=2, stage 2: train, save, and continue; the continuation is what every load must reach."""
    cfg = zerodp.Config(stage=SAVE_STAGE)
    model, opt, _ = train("muon", cfg, rank, steps=STEPS)
    zerodp.save(os.path.join(root, "muon"), model, opt)
    return _continue(model, opt, rank, world_size, 1, STEPS)


def resume_case(rank, world_size, root, stage):
    """Another world size and stage: load, continue. At M=1 the two micro-batches are the
    saver's two ranks' batches."""
    micro = 2 if world_size == 1 else 1
    cfg = zerodp.Config(stage=stage, grad_accumulation_steps=micro, bucket_bytes=SMALL_BUCKET)
    torch.manual_seed(1)  # other initial values: the load must replace them all
    model = MatNet()
    model, opt = zerodp.initialize(model, muon_only(model), cfg)
    zerodp.load(os.path.join(root, "muon"), model, opt)
    return _continue(model, opt, rank, world_size, micro, STEPS)


def torch_resume_case(rank, world_size, root):
    """One process, torch's own Muon: the checkpoint's weights and momentum buffers loaded
    (through zerodp.consolidate and a world-of-one optimizer state dict), then the
    reference's steps."""
    torch.manual_seed(1)
    plain = MatNet()
    plain.load_state_dict(zerodp.consolidate(os.path.join(root, "muon")))
    torch.manual_seed(1)
    holder = MatNet()
    holder, zopt = zerodp.initialize(holder, muon_only(holder), zerodp.Config(stage=0))
    zerodp.load(os.path.join(root, "muon"), holder, zopt)
    sd = zopt.state_dict()
    sd["state"] = {k: {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                       for n, v in s.items() if n != "master"} for k, s in sd["state"].items()}
    muon = torch.optim.Muon(plain.parameters(), lr=MUON_LR, momentum=0.95)
    muon.load_state_dict(sd)
    momentum_shapes = sorted(tuple(s["momentum_buffer"].shape) for s in muon.state.values())
    for step in range(STEPS, STEPS + RESUME):
        x, y = global_rows(step, 1, 0)
        for r in range(2):  # as the saver's two ranks, summed then averaged
            (plain(x[4 * r: 4 * r + 4]) - y[4 * r: 4 * r + 4]).pow(2).mean().backward()
        for p in plain.parameters():
            p.grad.div_(2)
        muon.step()
        muon.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in plain.named_parameters()},
            "momentum_shapes": momentum_shapes}


def tensor_parallel_case(rank, world_size):
    """DP x TP = 2 x 2: Muon over matrices that tensor parallelism splits is refused by name."""
    from zerodp.demo.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32))
    hidden, rest = split_hidden_matrices(model)
    try:
        zerodp.initialize(model, [torch.optim.Muon(hidden, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAMW_LR)],
                          zerodp.Config(stage=1, tensor_parallel_size=2))
    except ValueError as e:
        return str(e)
    return None


# -- the path a user takes: an HF Llama from its config, the recipe, accumulation, activation
# checkpointing and the Trainer's model.zero_grad(), against one process on the global batch.
HF_STEPS, HF_MICRO = 3, 2


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    model.gradient_checkpointing_enable()  # transformers' default kwargs
    return model


def _hf_batch(step: int, rank: int, micro: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def _recipe(model):
    hidden, rest = zerodp.split_hidden_matrices(model)
    return [torch.optim.Muon(hidden, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAMW_LR)]


def hf_user_loop(rank, world_size, stage):
    ref = _hf_llama()
    ref_opts = _recipe(ref)
    ref_losses = []
    for step in range(HF_STEPS):
        for micro in range(HF_MICRO):
            for r in range(world_size):
                loss = ref(input_ids=_hf_batch(step, r, micro), labels=_hf_batch(step, r, micro)).loss
                (loss / (world_size * HF_MICRO)).backward()
                if r == rank and micro == 0:
                    ref_losses.append(loss.item())
        for o in ref_opts:
            o.step()
        ref.zero_grad(set_to_none=True)
    model = _hf_llama()
    model, opt = zerodp.initialize(model, _recipe(model),
                                   zerodp.Config(stage=stage, grad_accumulation_steps=HF_MICRO))
    losses = []
    for step in range(HF_STEPS):
        for micro in range(HF_MICRO):
            batch = _hf_batch(step, rank, micro)
            loss = model(input_ids=batch, labels=batch).loss
            opt.backward(loss)
            if micro == 0:
                losses.append(loss.item())
        opt.step()
        model.zero_grad(set_to_none=True)  # as the Trainer clears them
    got = zerodp.full_state_dict(model, opt)
    want = ref.state_dict()
    return {"losses": losses, "ref_losses": ref_losses,
            "params": max(float(((got[k] - want[k]).abs() / (1 + want[k].abs())).max()) for k in want)}
