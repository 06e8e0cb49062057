"""Tensor parallelism with ZeRO at world size 4 (DP x TP = 2 x 2 and 1 x 4), inside one spawned
world (test_tensor_parallel.py): parity with a single-process model on the same global batch,
Pa and Pa+cpu bitwise, the activation ledger and the tp axis's collectives."""
from __future__ import annotations

import torch
from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM

import zerodp
from tp_slices import (diffs_to_reference, error_of, expected_slice,  # noqa: F401 - tests import them from here
                       max_diff_to_reference)
from zerodp.demo.models import GPT, GPTConfig

STEPS = 3
BATCH, SEQ, VOCAB = 2, 16, 64  # per data-parallel rank
GPT_CFG = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)
LAYOUTS = ((2, 2), (1, 4))  # (data-parallel, tensor-parallel)
PA = {"none": {}, "pa": {"partition_activations": True},
      "pa_cpu": {"partition_activations": True, "activations_on_host": True}}


def build(kind: str, reentrant: bool = False, seed: int = 0) -> torch.nn.Module:
    """The model of `kind` ("gpt", "llama", or "llama_gqa": 4 query heads sharing 2 key/value
    heads), its blocks checkpointed."""
    torch.manual_seed(seed)
    if kind == "gpt":
        model = GPT(GPT_CFG)
    else:
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2 if kind == "llama_gqa" else 4,
                          max_position_embeddings=SEQ, attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model.train()


def loss_of(kind: str, model, ids: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return model(ids[:, :-1], ids[:, 1:])[1]
    return model(input_ids=ids, labels=ids).loss


def global_batch(step: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (dp * BATCH, SEQ + 1), generator=g)


OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}),  # scale-sensitive: a wrong scale shows
              "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})}
CLIP = 0.5
# The parity grid: plain SGD at every stage (the strict check), AdamW where its state is sharded
# as SGD's momentum is not (stage 1: the optimizer state; 3: everything).
RUNS = tuple((stage, "sgd") for stage in range(4)) + ((1, "adamw"), (3, "adamw"))


def make_optimizer(name: str):
    return OPTIMIZERS[name]


def reference(kind: str, opt_name: str, dp: int, lr=None, clip=CLIP) -> dict:
    """One process, the whole global batch, torch's optimizer, clipped as zerodp clips; with
    each step's clipped gradients, which the rounding bounds are computed from."""
    model = build(kind)
    cls, kwargs = make_optimizer(opt_name)
    opt = cls(model.parameters(), **{**kwargs, **({"lr": lr} if lr is not None else {})})
    losses, grads = [], []
    for step in range(STEPS):
        loss = loss_of(kind, model, global_batch(step, dp))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": grads, "grad_max": [max(float(g.abs().max()) for g in step.values()) for step in grads],
            "numel": sum(p.numel() for p in model.parameters())}


def local_params(model) -> dict:
    with zerodp.gathered_parameters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(kind: str, opt_name: str, dp: int, tp: int, stage: int, rank: int, reentrant=False, **fields) -> dict:
    # Every rank starts from weights of its own: training starts from rank 0's, as with DDP.
    model = build(kind, reentrant, seed=rank)
    cls, kwargs = make_optimizer(opt_name)
    cfg = zerodp.Config(stage=stage, tensor_parallel_size=tp, **({"unit_min_params": 1000} if stage == 3 else {}),
                        **fields)
    model, opt = zerodp.initialize(model, cls, cfg, **kwargs)
    dp_rank = rank // tp
    losses, ledger = [], None
    for step in range(STEPS):
        ids = global_batch(step, dp)[dp_rank * BATCH:(dp_rank + 1) * BATCH]
        loss = loss_of(kind, model, ids)
        if step == 0:
            ledger = {"held": opt.memory_report().activation_checkpoints,
                      "on_host": opt.memory_report().activation_checkpoints_on_host}
        opt.backward(loss)
        if step == 0:
            ledger["records"] = [(r.op, r.numel, r.nbytes, r.phase, r.axis, r.label)
                                 for r in opt.comm.ledger.current]
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": local_params(model), "ledger": ledger}


def tp_world(rank: int, world_size: int) -> dict:
    out = {"rank": rank}
    refs = {}
    for kind in ("gpt", "llama"):
        for dp, tp in LAYOUTS:
            for stage, opt_name in RUNS:
                key = (kind, opt_name, dp)
                if key not in refs and rank == 0:
                    refs[key] = reference(kind, opt_name, dp)
                out[(kind, dp, tp, stage, opt_name)] = train(kind, opt_name, dp, tp, stage, rank)
    if rank == 0:
        refs[("llama_gqa", "sgd", 2)] = reference("llama_gqa", "sgd", 2)
    out[("llama_gqa", 2, 2, 3, "sgd")] = train("llama_gqa", "sgd", 2, 2, 3, rank)
    out["refs"] = refs
    # Pa and Pa+cpu: the same bits as without, with either use_reentrant mode.
    for kind in ("gpt", "llama"):
        for reentrant in (False, True):
            for name, fields in PA.items():
                out[("pa", kind, reentrant, name)] = train(kind, "sgd", 2, 2, 3, rank, reentrant, **fields)
    out[("pa", "gpt", False, "pa_1x4")] = train("gpt", "sgd", 1, 4, 2, rank, False, partition_activations=True)
    out[("pa", "gpt", False, "none_1x4")] = train("gpt", "sgd", 1, 4, 2, rank, False)
    out["errors"] = bad_input(rank)
    out["user_path"] = {name: user_path(rank, **fields) for name, fields in
                        (("plain", {}), ("pa_cpu", PA["pa_cpu"]))}
    if rank == 0:
        out["user_path_ref"] = reference("llama", "adamw", 2, lr=USER_PATH_LR, clip=1.0)
    return out


USER_PATH_LR = 1e-3


def user_path(rank: int, **fields) -> dict:
    """A Hugging Face Llama with its own gradient checkpointing (HF's defaults), bf16, two
    micro-batches per step, clipping, stage 3 at DP x TP = 2 x 2."""
    model = build("llama", seed=rank)
    model.gradient_checkpointing_enable()  # HF's defaults, not this file's use_reentrant choice
    cfg = zerodp.Config(stage=3, mixed_precision="bf16", grad_accumulation_steps=2, tensor_parallel_size=2, **fields)
    model, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=USER_PATH_LR, weight_decay=0.1)
    dp_rank, losses = rank // 2, []
    for step in range(STEPS):
        ids = global_batch(step, 2)[dp_rank * BATCH:(dp_rank + 1) * BATCH]
        total = 0.0
        for micro in range(BATCH):  # one sequence per micro-batch
            loss = model(input_ids=ids[micro:micro + 1], labels=ids[micro:micro + 1]).loss
            opt.backward(loss)
            total += loss.item() / BATCH
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "params": local_params(model)}


class GatedMLP(torch.nn.Module):
    """A scalar gate on the column-parallel layer's split output: a parameter the plan does
    not split that sees split activations, so each rank holds a part of its gradient."""

    tensor_parallel_plan = {"fc": "colwise", "proj": "rowwise"}

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.proj = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.gate = torch.nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x):
        return self.proj(torch.relu(self.fc(x)) * self.gate)


def bad_input(rank: int) -> dict:
    """Each raises on every rank, before any collective could leave a rank waiting."""
    cfg = zerodp.Config(stage=3, tensor_parallel_size=2)
    out = {"tp_3_of_4": error_of(lambda: zerodp.initialize(build("gpt"), torch.optim.SGD,
                                                           zerodp.Config(tensor_parallel_size=3), lr=0.1)),
           "no_plan": error_of(lambda: zerodp.initialize(torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.optim.SGD,
                                                         cfg, lr=0.1))}
    with zerodp.init(cfg):
        meta = GPT(GPT_CFG)
    out["meta"] = error_of(lambda: zerodp.initialize(meta, torch.optim.SGD, cfg, lr=0.1))
    odd = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=3, n_embd=24)
    out["heads_3_over_2"] = error_of(lambda: zerodp.initialize(GPT(odd), torch.optim.SGD, cfg, lr=0.1))
    out["gqa_kv_2_over_4"] = error_of(lambda: zerodp.initialize(build("llama_gqa"), torch.optim.SGD,
                                                                 zerodp.Config(stage=3, tensor_parallel_size=4), lr=0.1))
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16))
    out["gemma_scaled_embedding"] = error_of(lambda: zerodp.initialize(gemma, torch.optim.SGD, cfg, lr=0.1))
    model, opt = zerodp.initialize(build("gpt"), torch.optim.SGD, cfg, lr=0.1)
    out["save"] = error_of(lambda: zerodp.save("/nonexistent/tp-ckpt", model, opt))
    out["state_dict"] = error_of(lambda: opt.state_dict())
    # Config.debug: unsplit parameters' gradients must agree across tensor-parallel ranks.
    out["debug_gpt"] = error_of(lambda: train("gpt", "sgd", 2, 2, 3, rank, debug=True))
    gated, gated_opt = zerodp.initialize(GatedMLP(), torch.optim.SGD, zerodp.Config(
        stage=2, tensor_parallel_size=2, debug=True), lr=0.1)
    gated_opt.backward(gated(torch.randn(3, 8, generator=torch.Generator().manual_seed(rank // 2))).square().mean())
    out["debug_gate"] = error_of(gated_opt.step)
    bare, _ = zerodp.initialize(GPT(GPT_CFG), torch.optim.SGD, zerodp.Config(
        tensor_parallel_size=2, partition_activations=True), lr=0.1)  # no layer checkpointed
    ids = global_batch(0, 1)
    out["pa_without_checkpointing"] = error_of(lambda: bare(ids[:, :-1], ids[:, 1:]))
    return out
