"""A DDP training script as users write it, run under DDP and under zerodp with only the DDP
line changed (test_ddp_script.py).

`train` follows nanoGPT's train.py (karpathy/nanoGPT): the model builds its weight-decay
param groups before wrapping (`configure_optimizers`), accumulation turns DDP's sync off with
`model.require_backward_grad_sync` for every micro-batch but the last, the loop divides its
loss by the accumulation steps itself, clips with torch's `clip_grad_norm_` over the model's
parameters, steps through a (disabled) GradScaler, sets the learning rate on the param groups
each iteration, evaluates and checkpoints every `eval_interval` iterations, and resumes by
loading the checkpoint into the plain model and optimizer before wrapping. Its model is
nanoGPT's GPT in miniature (tied embedding and head, causal attention, GELU MLP). Two lines
differ from the original, for every implementation alike: the checkpoint is taken with DCP's
`get_state_dict(..., full_state_dict=True, cpu_offload=True)` on every rank and saved on the
master (docs/migrating.md), and the resume loads it with `set_state_dict`.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 64, 16, 32, 2, 2


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.c_proj = nn.Linear(4 * EMBD, EMBD)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(EMBD), CausalSelfAttention(), nn.LayerNorm(EMBD), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(VOCAB, EMBD), wpe=nn.Embedding(BLOCK, EMBD),
                                              h=nn.ModuleList([Block() for _ in range(LAYERS)]),
                                              ln_f=nn.LayerNorm(EMBD)))
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, kind="adamw"):
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        nodecay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
        if kind == "sgd":  # the scale-sensitive variant: SGD moves by the gradient itself
            return torch.optim.SGD(groups, lr=learning_rate, momentum=0.9)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


def train(rank: int, impl: str, stage: int, kind: str, out_dir: str, max_iters: int, resume: bool) -> dict:
    """nanoGPT's train.py loop; `impl` is "ddp" or "zerodp" (the one line that differs)."""
    gradient_accumulation_steps, batch_size, grad_clip = 2, 2, 1.0
    learning_rate = 6e-4 * 50 if kind == "adamw" else 0.05
    warmup_iters, lr_decay_iters, min_lr = 2, max_iters, learning_rate / 10
    eval_interval, eval_iters = 3, 2
    master_process, seed_offset = rank == 0, rank
    torch.manual_seed(1337 + seed_offset)  # as nanoGPT: each rank's init differs; the wrap broadcasts rank 0's
    data = torch.Generator().manual_seed(4242 + seed_offset)

    def get_batch(split):
        g = data if split == "train" else torch.Generator().manual_seed(7 + seed_offset)
        x = torch.randint(VOCAB, (batch_size, BLOCK), generator=g)
        return x, torch.roll(x, -1, dims=1)

    iter_num, checkpoint = 0, None
    model = GPT()
    optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95), kind)
    if resume:
        checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu", weights_only=False)
        set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        iter_num = checkpoint["iter_num"]
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    if impl == "ddp":
        model = DDP(model)
    else:
        config = zerodp.Config(stage=stage, unit_modules=(Block,) if stage == 3 else ())
        model, optimizer = zerodp.initialize(model, optimizer, config)  # was: model = DDP(model)

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                X, Y = get_batch(split)
                _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it):
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    record = {"losses": [], "norms": [], "evals": []}
    X, Y = get_batch("train")
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0:
            # nanoGPT evaluates on the master only; at stage 3 every rank's forward gathers, so
            # every rank evaluates (docs/migrating.md); at stages 0-2 the master alone does.
            if master_process or stage == 3:
                record["evals"].append({k: float(v) for k, v in estimate_loss().items()})
            if 0 < iter_num < max_iters and not resume:  # the resume test starts from iteration 3
                model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(
                    full_state_dict=True, cpu_offload=True))
                if master_process:
                    torch.save({"model": model_sd, "optimizer": optim_sd, "iter_num": iter_num},
                               os.path.join(out_dir, "ckpt.pt"))
        if iter_num >= max_iters:
            break
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            record["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        record["losses"].append(loss.item() * gradient_accumulation_steps)
        iter_num += 1
    full, _ = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    record["final"] = {k: v.clone() for k, v in full.items()} if master_process else {}
    return record


def sample(out_dir: str) -> torch.Tensor:
    """nanoGPT's sample.py: the checkpoint into a plain model in this process, greedy tokens."""
    checkpoint = torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu", weights_only=False)
    model = GPT()
    model.load_state_dict(checkpoint["model"])
    model.eval()
    idx = torch.zeros((1, 1), dtype=torch.long)
    with torch.no_grad():
        for _ in range(BLOCK - 1):
            logits, _ = model(idx)
            idx = torch.cat((idx, logits[:, -1, :].argmax(-1, keepdim=True)), dim=1)
        logits, _ = model(idx)
    return logits


def script_case(rank: int, world: int, stage: int, kind: str, root: str) -> dict:
    """The script under DDP and under zerodp: a run to iteration 6 that checkpoints at 3, a
    resumed run from 3 to 6, and a sample from the checkpoint in a plain model."""
    out = {}
    for impl in ("ddp", "zerodp"):
        out_dir = os.path.join(root, f"{impl}-s{stage}-{kind}")
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
        dist.barrier()
        whole = train(rank, impl, stage, kind, out_dir, 6, resume=False)
        dist.barrier()
        resumed = train(rank, impl, stage, kind, out_dir, 6, resume=True)
        out[impl] = {"whole": whole, "resumed": resumed, "sample": sample(out_dir) if rank == 0 else None}
    return out


def unreached_case(rank: int, world: int, stage: int, kind: str) -> dict:
    """optimizer.zero_grad(set_to_none=False) with a parameter no backward ever reaches: as
    torch's, it keeps no gradient and is not stepped (weight decay and momentum would move it)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x).square().mean()

    out = {}
    for impl in ("ddp", "zerodp"):
        torch.manual_seed(0)
        model = Net()
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1) if kind == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1))
        before = model.unused.weight.detach().clone()
        if impl == "ddp":
            model = DDP(model, find_unused_parameters=True)
            net = model.module
        else:
            model, opt = zerodp.initialize(model, opt, zerodp.Config(stage=stage, unit_modules=(nn.Linear,) if stage == 3
                                                                     else ()))
            net = model
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            model(torch.full((2, 4), float(rank + step + 1))).backward()
            opt.step()
        weight = (zerodp.full_state_dict(model, opt)["unused.weight"] if impl == "zerodp" and stage == 3
                  else net.unused.weight.detach().clone())
        out[impl] = {"moved": float((weight - before).abs().max()), "grad_is_none": net.unused.weight.grad is None}
    return out


def utilities_case(rank: int, world: int, stage: int, precision: str) -> dict:
    """torch's gradient utilities on the model's parameters after an accumulated backward,
    under DDP and under zerodp: what each returns, the gradients the step then uses (read back
    as the parameters SGD moves by lr 1), and what reading a sharded p.grad otherwise does."""
    out = {}
    for impl in ("ddp", "zerodp"):
        torch.manual_seed(0)
        model = GPT()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        if impl == "ddp":
            model = DDP(model)
        else:
            config = zerodp.Config(stage=stage, unit_modules=(Block,) if stage == 3 else (),
                                   mixed_precision=precision,
                                   # a fixed scale whose scaled loss (~4 x 1024) fp16 holds
                                   loss_scale=1024.0 if precision == "fp16" else "dynamic")
            model, opt = zerodp.initialize(model, opt, config)
        data = torch.Generator().manual_seed(rank)
        x = torch.randint(VOCAB, (2, BLOCK), generator=data)
        # fp16 needs the loss scale (optimizer.backward); DDP's reference trains in fp32.
        backward = opt.backward if precision == "fp16" and impl == "zerodp" else (lambda loss: loss.backward())
        with model.no_sync():
            backward(model(x, x)[1])
        backward(model(x.flip(1), x)[1])
        params = list(model.parameters())
        got = {"total_2": float(torch.nn.utils.get_total_norm([p.grad for p in params])),
               "total_inf": float(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type="inf")),
               "total_3_foreach": float(torch.nn.utils.get_total_norm([p.grad for p in params], 3.0, foreach=True)),
               "per_param": [float(p.grad.norm()) for p in params],
               "clip": float(torch.nn.utils.clip_grad_norm_(params, 0.5)),
               "after_clip": float(torch.nn.utils.get_total_norm([p.grad for p in params]))}
        torch.nn.utils.clip_grad_value_(params, 0.01)
        got["after_value_clip_inf"] = float(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type="inf"))
        if impl == "zerodp" and stage >= 1:
            try:
                params[0].grad.clone()
                got["read"] = "no error"
            except RuntimeError as e:
                got["read"] = str(e)
        def weights():
            if impl == "zerodp" and stage == 3:
                return {n: v.float().clone() for n, v in zerodp.full_state_dict(model, opt).items()}
            return {n: p.detach().float().clone() for n, p in (model.module if impl == "ddp" else model).named_parameters()}

        before = weights()
        opt.step()
        after = weights()
        got["stepped_by"] = {n: before[n] - after[n] for n in (model.module if impl == "ddp" else model).state_dict()
                             if n in before}
        out[impl] = got
    return out
