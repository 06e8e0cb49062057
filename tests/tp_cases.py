"""Tensor parallelism with ZeRO at world size 4 (DP x TP = 2 x 2 and 1 x 4), a case per test in
the session's world of 4 (test_tensor_parallel.py): parity with a single-process model on the
same global batch at every step, Pa and Pa+cpu bitwise, the activation ledger and the tp
axis's collectives, bad input."""
from __future__ import annotations

import torch

import zerodp
from tp_slices import error_of
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
        from transformers import LlamaConfig, LlamaForCausalLM  # ~5 s to import: only where a Llama is built

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


# One process's run on the global batch, kept by the rank-0 process of the world that computed
# it (the session's worlds live as long as the session): several tests compare with the same
# one, and each reference costs as much as a zerodp run.
_REFERENCES: dict = {}


def reference(kind: str, opt_name: str, dp: int, lr=None, clip=CLIP) -> dict:
    """One process, the whole global batch, torch's optimizer, clipped as zerodp clips; with
    each step's clipped gradients, which the rounding bounds are computed from, and each
    step's parameters ("steps"). Computed once per process for the same arguments."""
    key = (kind, opt_name, dp, lr, clip)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(kind, opt_name, dp, lr, clip)
    return _REFERENCES[key]


def _reference(kind: str, opt_name: str, dp: int, lr, clip) -> dict:
    model = build(kind)
    cls, kwargs = make_optimizer(opt_name)
    opt = cls(model.parameters(), **{**kwargs, **({"lr": lr} if lr is not None else {})})
    losses, grads, steps = [], [], []
    for step in range(STEPS):
        loss = loss_of(kind, model, global_batch(step, dp))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "params": steps[-1], "steps": steps,
            "grads": grads, "grad_max": [max(float(g.abs().max()) for g in step.values()) for step in grads],
            "numel": sum(p.numel() for p in model.parameters())}


def local_params(model) -> dict:
    with zerodp.gathered_parameters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(kind: str, opt_name: str, dp: int, tp: int, stage: int, rank: int, reentrant=False, every_step=False,
          **fields) -> dict:
    """zerodp at DP x TP = dp x tp; `every_step`: this rank's parameters after each step too
    ("steps"), for the per-step parity checks."""
    # Every rank starts from weights of its own: training starts from rank 0's, as with DDP.
    model = build(kind, reentrant, seed=rank)
    cls, kwargs = make_optimizer(opt_name)
    cfg = zerodp.Config(stage=stage, tensor_parallel_size=tp, **({"unit_min_params": 1000} if stage == 3 else {}),
                        **fields)
    model, opt = zerodp.initialize(model, cls, cfg, **kwargs)
    dp_rank = rank // tp
    losses, ledger, steps = [], None, []
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
        if every_step and step < STEPS - 1:
            steps.append(local_params(model))
    params = local_params(model)
    out = {"losses": losses, "params": params, "ledger": ledger}
    if every_step:
        out["steps"] = steps + [params]
    return out


# -- the cases (test_tensor_parallel.py sends one per test) -----------------------------------
def parity_case(rank: int, world_size: int, kind: str, dp: int, tp: int, stage: int, opt_name: str) -> dict:
    """zerodp at dp x tp, the parameters after every step; rank 0 adds the one-process
    reference on the same global batch."""
    assert world_size == dp * tp, (world_size, dp, tp)
    ref = reference(kind, opt_name, dp) if rank == 0 else None
    out = train(kind, opt_name, dp, tp, stage, rank, every_step=True)
    return {**out, "ref": ref}


def reference_case(rank: int, world_size: int, kind: str, opt_name: str, dp: int) -> dict | None:
    """The one-process reference (rank 0; the others return None)."""
    return reference(kind, opt_name, dp) if rank == 0 else None


def pa_case(rank: int, world_size: int, kind: str, reentrant: bool) -> dict:
    """Stage 3 at 2 x 2, SGD, without Pa, with Pa and with Pa+cpu (PA)."""
    return {name: train(kind, "sgd", 2, 2, 3, rank, reentrant, **fields) for name, fields in PA.items()}


def pa_1x4_case(rank: int, world_size: int) -> dict:
    """The GPT at stage 2 on 1 x 4, with Pa and without."""
    return {"pa_1x4": train("gpt", "sgd", 1, 4, 2, rank, False, partition_activations=True),
            "none_1x4": train("gpt", "sgd", 1, 4, 2, rank, False)}


USER_PATH_LR = 1e-3


def user_path_case(rank: int, world_size: int) -> dict:
    """The user path without and with Pa+cpu, each step's parameters; rank 0 adds the fp32
    one-process reference."""
    ref = reference("llama", "adamw", 2, lr=USER_PATH_LR, clip=1.0) if rank == 0 else None
    return {"plain": user_path(rank), "pa_cpu": user_path(rank, **PA["pa_cpu"]), "ref": ref}


def user_path(rank: int, **fields) -> dict:
    """A Hugging Face Llama with its own gradient checkpointing (HF's defaults), bf16, two
    micro-batches per step, clipping, stage 3 at DP x TP = 2 x 2."""
    model = build("llama", seed=rank)
    model.gradient_checkpointing_enable()  # HF's defaults, not this file's use_reentrant choice
    cfg = zerodp.Config(stage=3, mixed_precision="bf16", grad_accumulation_steps=2, tensor_parallel_size=2, **fields)
    model, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=USER_PATH_LR, weight_decay=0.1)
    dp_rank, losses, steps = rank // 2, [], []
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
        steps.append(local_params(model))
    return {"losses": losses, "params": steps[-1], "steps": steps}


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


def _bad_tp_3_of_4(rank: int) -> str:
    return error_of(lambda: zerodp.initialize(build("gpt"), torch.optim.SGD, zerodp.Config(tensor_parallel_size=3),
                                              lr=0.1))


def _bad_no_plan(rank: int) -> str:
    return error_of(lambda: zerodp.initialize(torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.optim.SGD,
                                              BAD_CFG, lr=0.1))


def _bad_meta(rank: int) -> str:
    with zerodp.init(BAD_CFG):
        meta = GPT(GPT_CFG)
    return error_of(lambda: zerodp.initialize(meta, torch.optim.SGD, BAD_CFG, lr=0.1))


def _bad_heads_3_over_2(rank: int) -> str:
    odd = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=3, n_embd=24)
    return error_of(lambda: zerodp.initialize(GPT(odd), torch.optim.SGD, BAD_CFG, lr=0.1))


def _bad_gqa_kv_2_over_4(rank: int) -> str:
    return error_of(lambda: zerodp.initialize(build("llama_gqa"), torch.optim.SGD,
                                              zerodp.Config(stage=3, tensor_parallel_size=4), lr=0.1))


def _bad_gemma_scaled_embedding(rank: int) -> str:
    from transformers import GemmaConfig, GemmaForCausalLM

    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16))
    return error_of(lambda: zerodp.initialize(gemma, torch.optim.SGD, BAD_CFG, lr=0.1))


def _bad_debug_gpt(rank: int) -> str:
    # Config.debug: unsplit parameters' gradients must agree across tensor-parallel ranks.
    return error_of(lambda: train("gpt", "sgd", 2, 2, 3, rank, debug=True))


def _bad_debug_gate(rank: int) -> str:
    gated, gated_opt = zerodp.initialize(GatedMLP(), torch.optim.SGD, zerodp.Config(
        stage=2, tensor_parallel_size=2, debug=True), lr=0.1)
    gated_opt.backward(gated(torch.randn(3, 8, generator=torch.Generator().manual_seed(rank // 2))).square().mean())
    return error_of(gated_opt.step)


def _bad_pa_without_checkpointing(rank: int) -> str:
    bare, _ = zerodp.initialize(GPT(GPT_CFG), torch.optim.SGD, zerodp.Config(
        tensor_parallel_size=2, partition_activations=True), lr=0.1)  # no layer checkpointed
    ids = global_batch(0, 1)
    return error_of(lambda: bare(ids[:, :-1], ids[:, 1:]))


BAD_CFG = zerodp.Config(stage=3, tensor_parallel_size=2)
# Each raises on every rank, before any collective could leave a rank waiting.
BAD_INPUTS = {"tp_3_of_4": _bad_tp_3_of_4, "no_plan": _bad_no_plan, "meta": _bad_meta,
              "heads_3_over_2": _bad_heads_3_over_2, "gqa_kv_2_over_4": _bad_gqa_kv_2_over_4,
              "gemma_scaled_embedding": _bad_gemma_scaled_embedding,
              "pa_without_checkpointing": _bad_pa_without_checkpointing, "debug_gpt": _bad_debug_gpt,
              "debug_gate": _bad_debug_gate}


def bad_input_case(rank: int, world_size: int, name: str) -> str:
    """The error one bad input raises on this rank ("no error" if none)."""
    return BAD_INPUTS[name](rank)
