"""Fine-tunes as people run them (test_finetune.py): a PEFT LoRA model over a frozen Llama
base, trained with zerodp, against one process stepping the same torch optimizer on the
global batch; the frozen base sharded at stage 3 (its ledger against a hand count and a
census of the storages the parameters point into); the natural save calls (PeftModel's and
a plain HF model's own `save_pretrained`, called on every rank with is_main_process); TRL's
SFTTrainer and DPOTrainer through `with_zerodp` against the same trainers under DDP, and their resume.

Everything is built from configs from seed 0 (nothing downloaded). LoRA on every attention
and MLP projection with random (not zero) B, so every adapter has a gradient from step 0,
and `modules_to_save=["lm_head"]`: a trainable copy of the head beside its frozen original,
in the root unit with the frozen embedding. The vocabulary (251) divides no world size.
"""
from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

import zerodp  # noqa: E402

VOCAB, SEQ, ROWS, STEPS = 251, 16, 2, 3
SGD_LR, ADAMW_LR, MAX_NORM = 0.1, 1e-3, 0.05
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(dtype=torch.float32, checkpointing=None) -> LlamaForCausalLM:
    transformers.set_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        model.enable_input_require_grads()  # the frozen embedding's output must carry gradients into the blocks
    return model.to(dtype)


def lora_config(modules_to_save: bool = True) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False,
                      modules_to_save=["lm_head"] if modules_to_save else None)


def lora_model(dtype=torch.float32, checkpointing=None) -> PeftModel:
    """A bf16 base gets fp32 adapters (peft's autocast_adapter_dtype), the usual QLoRA-free
    recipe; without a trainable copy of the head, which would be bf16 (zerodp refuses a
    trainable parameter in neither fp32 nor the compute dtype)."""
    base = base_model(dtype, checkpointing)
    torch.manual_seed(1)  # the adapters' random init, the same on every rank and in the reference
    return get_peft_model(base, lora_config(modules_to_save=dtype == torch.float32))


def ids(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def loss_of(model, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def optimizer_of(name: str):
    return (torch.optim.SGD, {"lr": SGD_LR}) if name == "sgd" else (torch.optim.AdamW,
                                                                      {"lr": ADAMW_LR, "weight_decay": 0.01})


VARIANTS = {  # name: (base dtype, activation checkpointing, accumulation, clipping)
    "plain": (torch.float32, None, 1, False),
    "clip_accum": (torch.float32, None, 2, True),
    "bf16_base": (torch.bfloat16, None, 1, False),
    "ckpt_reentrant": (torch.float32, True, 1, False),
    "ckpt_nonreentrant": (torch.float32, False, 1, False),
}


def _reference(world_size: int, rank: int, opt_name: str, variant: str) -> dict:
    """One process on the global batch: each rank's batch's mean loss, averaged over the
    ranks (and micro-batches), as DDP averages its ranks' gradients."""
    dtype, ckpt, accumulation, clip = VARIANTS[variant]
    model = lora_model(dtype, ckpt)
    trainable = [p for p in model.parameters() if p.requires_grad]
    cls, kwargs = optimizer_of(opt_name)
    opt = cls(trainable, **kwargs)
    losses = []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        for micro in range(accumulation):
            for r in range(world_size):
                loss = loss_of(model, ids(step, r, micro))
                (loss / (world_size * accumulation)).backward()
                if r == rank and micro == 0:
                    losses.append(loss.item())
        if clip:
            torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM)
        opt.step()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _zerodp(world_size: int, rank: int, stage: int, opt_name: str, variant: str):
    dtype, ckpt, accumulation, clip = VARIANTS[variant]
    model = lora_model(dtype, ckpt)
    cls, kwargs = optimizer_of(opt_name)
    model, opt = zerodp.initialize(model, cls, zerodp.Config(stage=stage, grad_accumulation_steps=accumulation),
                                   **kwargs)
    losses = []
    for step in range(STEPS):
        for micro in range(accumulation):
            loss = loss_of(model, ids(step, rank, micro))
            opt.backward(loss)  # divided by the accumulation steps
            if micro == 0:
                losses.append(loss.item())
        if clip:
            opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        model.zero_grad(set_to_none=True)  # as the Trainer clears them
    return model, opt, losses


def _moved(trained: dict, names: set, dtype) -> float:
    """How far training moved the trainable parameters from their initial values (largest element)."""
    initial = lora_model(dtype).state_dict()
    return max(float((trained[k].float() - initial[k].float()).abs().max()) for k in names)


def lora_parity(rank: int, world_size: int, stage: int, opt_name: str, variant: str) -> dict:
    ref = _reference(world_size, rank, opt_name, variant)
    model, opt, losses = _zerodp(world_size, rank, stage, opt_name, variant)
    state = zerodp.full_state_dict(model, opt)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    want = ref["state"]

    def rel(k):
        a, b = state[k].float(), want[k].float()
        return float(((a - b).abs() / (1 + b.abs())).max())

    report = opt.memory_report()
    return {"losses": losses, "ref_losses": ref["losses"],
            "trainable": max(rel(k) for k in trainable),
            "frozen_equal": all(torch.equal(state[k], want[k]) for k in want if k not in trainable),
            "keys": sorted(state) == sorted(want),
            "moved": _moved(want, trainable, VARIANTS[variant][0]),
            "frozen_bytes": report.frozen_params,
            "frozen_dtypes": sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})}


# -- the ledger --------------------------------------------------------------------------------
def _units_by_hand(model) -> dict:
    """Frozen and trainable element counts per stage-3 unit, from the model's own names:
    each decoder layer is a unit (Llama's `_no_split_modules`), and so is the untied input
    embedding; the rest (final norm, head and its trainable copy) is the root's."""
    counts: dict = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        unit = (".".join(parts[:parts.index("layers") + 2]) if "layers" in parts else
                "embed_tokens" if "embed_tokens" in parts else "<root>")
        key = (unit, "frozen" if not p.requires_grad else "trainable")
        counts[key] = counts.get(key, 0) + p.numel()
    return counts


def ledger(rank: int, world_size: int) -> dict:
    """Stage 3, bf16 mixed precision, AdamW: the frozen base (fp32, computed in bf16) sharded.
    Expected, by hand: per unit, ceil(frozen elements / N) bf16 elements, and for the
    trainable ones ceil(n / N) x (2 bf16 param + 2 bf16 grad + 4 master + 8 Adam) bytes."""
    model = lora_model()
    counts = _units_by_hand(model)
    model, opt = zerodp.initialize(model, torch.optim.AdamW, zerodp.Config(stage=3, mixed_precision="bf16"), lr=1e-3)
    loss_of(model, ids(0, rank)).backward()
    opt.step()
    report = opt.memory_report()
    gathered = {phase: sorted({r.label for r in opt.comm.ledger.last_step if r.op == "all_gather" and r.phase == phase})
                for phase in ("forward", "backward")}
    # Independent of the engine's ledger: the storages the frozen parameters point into.
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters() if not p.requires_grad}
    n = world_size
    frozen_total = sum(v for (u, kind), v in counts.items() if kind == "frozen")
    trainable_total = sum(v for (u, kind), v in counts.items() if kind == "trainable")
    return {"frozen": report.frozen_params, "census": sum(storages.values()),
            "frozen_by_hand": 2 * sum(math.ceil(v / n) for (u, kind), v in counts.items() if kind == "frozen"),
            # + 2: the one-element bf16 handle every trainable `.grad` shows between backward and
            # the step (schedule/presence.py: the gradients live in the units' shards).
            "trainable_by_hand": 16 * sum(math.ceil(v / n) for (u, kind), v in counts.items()
                                          if kind == "trainable") + 2,
            "trainable_state": report.params + report.grads + report.master + report.optimizer_states,
            "model_state": report.model_state, "frozen_total": frozen_total, "trainable_total": trainable_total,
            "units": len(opt.stage3.units), "unit_names": [u.name for u in opt.stage3.units], "gathered": gathered}


def ledger_replicated(rank: int, world_size: int, stage: int) -> dict:
    """Stages 1-2 keep the frozen base whole on every rank, as the paper defines them."""
    model = lora_model()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    model, opt = zerodp.initialize(model, torch.optim.AdamW, zerodp.Config(stage=stage, mixed_precision="bf16"),
                                   lr=1e-3)
    return {"frozen": opt.memory_report().frozen_params, "by_hand": 2 * frozen}


# -- saving ------------------------------------------------------------------------------------
def _trained(world_size: int, rank: int):
    model, opt, _ = _zerodp(world_size, rank, 3, "sgd", "plain")
    return model, opt


def peft_saves(rank: int, world_size: int, root: str) -> dict:
    """PeftModel.save_pretrained as the Trainer and accelerate call it, on every rank with
    is_main_process; the adapters against the reference's own save, and loaded back by
    PeftModel.from_pretrained into a plain base in one process."""
    model, opt = _trained(world_size, rank)
    ours = os.path.join(root, "adapters")
    model.save_pretrained(ours, is_main_process=rank == 0)
    zerodp.save_pretrained(model, os.path.join(root, "adapters-zerodp"), opt)  # the Trainer's call: state_dict given
    if rank != 0:
        return {}
    ref = lora_model()
    want = _reference(world_size, rank, "sgd", "plain")["state"]
    ref.load_state_dict(want)
    ref.save_pretrained(os.path.join(root, "reference"))
    got, expected = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in
                     (ours, os.path.join(root, "reference")))
    via_zerodp = load_file(os.path.join(root, "adapters-zerodp", "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(base_model(), ours)
    batch = ids(99, 0)
    with torch.no_grad():
        out, ref_out = loaded(input_ids=batch).logits, ref(input_ids=batch).logits
    return {"keys": sorted(got) == sorted(expected), "n_keys": len(got),
            "adapters": max(float(((got[k] - expected[k]).abs() / (1 + expected[k].abs())).max()) for k in expected),
            "same_as_zerodp_save": sorted(via_zerodp) == sorted(got) and all(torch.equal(via_zerodp[k], got[k])
                                                                             for k in got),
            "empty": [k for k, v in got.items() if v.numel() == 0],
            "logits": float(((out - ref_out).abs() / (1 + ref_out.abs())).max())}


def hf_save_pretrained(rank: int, world_size: int, root: str) -> dict:
    """A plain HF GPT-2 (tied head, a vocabulary of 1001 over N ranks) at stage 3: its own
    save_pretrained, called on every rank with is_main_process, writes what from_pretrained
    loads."""
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1001, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model, opt = zerodp.initialize(model, torch.optim.SGD, zerodp.Config(stage=3), lr=0.1)
    batch = torch.randint(0, 1001, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    out = os.path.join(root, "gpt2")
    model.save_pretrained(out, is_main_process=rank == 0)
    full = zerodp.full_state_dict(model, opt)
    if rank != 0:
        return {}
    loaded = GPT2LMHeadModel.from_pretrained(out)
    state = loaded.state_dict()
    return {"equal": all(torch.equal(state[k], full[k]) for k in full),
            "tied": loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()}


def frozen_checkpoint(rank: int, world_size: int, root: str) -> dict:
    """A stage-3 LoRA checkpoint (frozen base written as each rank's runs) reloaded at stage 3
    into a differently initialised model, bitwise."""
    model, opt = _trained(world_size, rank)
    path = zerodp.save(os.path.join(root, "ckpt"), model, opt)
    before = zerodp.full_state_dict(model, opt)
    transformers.set_seed(5)
    other = get_peft_model(LlamaForCausalLM(base_model().config), lora_config())
    other, other_opt = zerodp.initialize(other, torch.optim.SGD, zerodp.Config(stage=3), lr=SGD_LR)
    zerodp.load(path, other, other_opt)
    after = zerodp.full_state_dict(other, other_opt)
    return {"equal": sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)}


# -- TRL -----------------------------------------------------------------------------------------
def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    vocab = {f"t{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<pad>": VOCAB - 2, "</s>": VOCAB - 1})
    words = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = Whitespace()  # DPO's text columns: "t3 t17 ..."
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>")


DPO_BETA = 0.1
DPO_COMPLETION = 5  # tokens of each chosen and rejected answer (EOS added by TRL)


def _trl(kind: str, out: str, config, resume=None, max_steps: int = STEPS, save: bool = False) -> dict:
    """TRL's SFTTrainer ("sft") or DPOTrainer ("dpo": the reference is the base with the
    adapters off, as TRL does given a peft_config; "dpo_ref": the whole model trained beside
    a reference model of its own, which stays outside zerodp) on the test Llama, under DDP
    (config None) or through `with_zerodp`: the logged loss of each step."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from zerodp.integrations.hf import with_zerodp

    g = torch.Generator().manual_seed(3)
    if kind == "sft":
        cls, config_cls, extra = SFTTrainer, SFTConfig, {"packing": False}
        data = Dataset.from_dict({"input_ids": torch.randint(0, VOCAB - 2, (8, SEQ), generator=g).tolist()})
    else:
        cls, config_cls, extra = DPOTrainer, DPOConfig, {"beta": DPO_BETA}

        def text(n):
            return " ".join(f"t{int(i)}" for i in torch.randint(0, VOCAB - 2, (n,), generator=g))
        # TRL tokenizes prompt + completion as one string: each completion starts with its space.
        data = Dataset.from_dict({"prompt": [text(6) for _ in range(8)],
                                  "chosen": [" " + text(DPO_COMPLETION) for _ in range(8)],
                                  "rejected": [" " + text(DPO_COMPLETION) for _ in range(8)]})
    args = config_cls(output_dir=out, max_steps=max_steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=10.0,
                      logging_steps=1, save_strategy="steps" if save else "no", save_steps=1, report_to=[],
                      disable_tqdm=True, seed=0, data_seed=0, use_cpu=True, dataloader_num_workers=0,
                      bf16=False, **extra)  # TRL's default bf16=True: autocast under DDP, bf16 weights here
    kwargs = dict(model=base_model(), args=args, train_dataset=data, processing_class=_tokenizer())
    kwargs.update(ref_model=base_model()) if kind == "dpo_ref" else kwargs.update(peft_config=lora_config())
    transformers.set_seed(1)
    trainer = cls(**kwargs) if config is None else with_zerodp(cls)(zerodp_config=config, **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return {e["step"]: float(e["loss"]) for e in trainer.state.log_history if "loss" in e}


def trl_world(rank: int, world_size: int, root: str, kind: str) -> dict:
    """The trainer under DDP and through with_zerodp at stage 3, and a zerodp run saved at
    step 2 and resumed from that checkpoint."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})
    out = {"ddp": _trl(kind, os.path.join(root, "ddp"), None),
           "zerodp": _trl(kind, os.path.join(root, "z3"), zerodp.Config(stage=3))}
    _trl(kind, os.path.join(root, "z3-saved"), zerodp.Config(stage=3), max_steps=2, save=True)
    out["resumed"] = _trl(kind, os.path.join(root, "z3-saved"), zerodp.Config(stage=3),
                          resume=os.path.join(root, "z3-saved", "checkpoint-2"))
    return out


def merged(rank: int, world_size: int, root: str) -> dict:
    """The adapters merged into the base one unit at a time (zerodp.integrations.peft)
    against peft's merge_and_unload of the reference, and saved for from_pretrained."""
    from zerodp.integrations.peft import merged_state_dict, save_merged
    model, opt = _trained(world_size, rank)
    got = merged_state_dict(model, opt)
    out = os.path.join(root, "merged")
    save_merged(model, out, opt)
    if rank != 0:
        return {"empty": got == {}}
    ref = lora_model()
    ref.load_state_dict(_reference(world_size, rank, "sgd", "plain")["state"])
    want = ref.merge_and_unload().state_dict()
    loaded = LlamaForCausalLM.from_pretrained(out).state_dict()
    return {"keys": sorted(got) == sorted(want), "loaded_keys": sorted(loaded) == sorted(want),
            "values": max(float(((got[k] - want[k]).abs() / (1 + want[k].abs())).max()) for k in want),
            "loaded_equal": all(torch.equal(loaded[k], got[k]) for k in want)}


def born_sharded_frozen(rank: int, world_size: int) -> dict:
    """Built under zerodp.init with its embedding and first block frozen: each unit
    (frozen parts included) is materialised and sharded in turn, never the whole model (its
    initial values are the modules' reset_parameters, not HF's _init_weights: a pretrained
    base is loaded next); load_pretrained then fills the frozen parameters, each rank reading
    only its runs."""
    def build():
        torch.manual_seed(0)
        model = LlamaForCausalLM(base_model().config)
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[0].requires_grad_(False)
        return model
    cfg = zerodp.Config(stage=3)
    with zerodp.init(cfg):
        meta = build()
    on_meta = all(p.is_meta for p in meta.parameters())
    model, opt = zerodp.initialize(meta, torch.optim.SGD, cfg, lr=0.1)
    transformers.set_seed(7)
    other = LlamaForCausalLM(base_model().config).state_dict()
    zerodp.load_pretrained(model, other, opt)
    after = zerodp.full_state_dict(model, opt)
    return {"on_meta": on_meta, "frozen_sharded": opt.memory_report().frozen_params > 0,
            "loaded": all(torch.equal(after[k], other[k]) for k in other)}


class _InPlaceBlock(torch.nn.Module):
    """A block that adds to its input in place, around a frozen layer."""

    def __init__(self):
        super().__init__()
        self.frozen, self.trained = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        x += self.trained(torch.tanh(self.frozen(x)))
        return x


def paths_trainers_take(rank: int, world_size: int, root: str) -> dict:
    """What trainers call besides forward and backward, at stage 3: a PEFT model's generate
    (eval, online trainers), its save with the embedding layers (LoRA on embed_tokens), a
    merge refused by name where it would be wrong (DoRA), a block updating its input in place."""
    from zerodp.integrations.peft import merged_state_dict
    out = {}
    model, opt = _trained(world_size, rank)
    prompt = ids(50, 0)[:1, :4]
    ref = lora_model()
    ref.load_state_dict(_reference(world_size, rank, "sgd", "plain")["state"])
    with torch.no_grad():
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        out["generate"] = model.generate(input_ids=prompt, **kwargs).tolist() == ref.generate(input_ids=prompt,
                                                                                                **kwargs).tolist()
    # LoRA on the embedding: peft saves the (frozen) base embedding beside the adapters.
    base = base_model()
    torch.manual_seed(1)
    emb = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"], lora_dropout=0.0))
    expected = emb.base_model.model.model.embed_tokens.base_layer.weight.detach().clone()
    emb, emb_opt = zerodp.initialize(emb, torch.optim.SGD, zerodp.Config(stage=3), lr=0.0)
    emb.save_pretrained(os.path.join(root, "emb"), is_main_process=rank == 0, save_embedding_layers=True)
    if rank == 0:
        saved = load_file(os.path.join(root, "emb", "adapter_model.safetensors"))
        out["embedding_saved"] = any(torch.equal(v, expected) for v in saved.values())
    try:
        merged_state_dict(emb, emb_opt)
        out["merge_refused"] = False
    except ValueError as e:
        out["merge_refused"] = "embeddings" in str(e)
    # A block that updates its input in place, at stage 3, against one process.
    def blocks():
        torch.manual_seed(3)
        return torch.nn.Sequential(_InPlaceBlock(), _InPlaceBlock())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    plain = blocks()
    whole = torch.cat([torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(world_size)])
    plain(whole.requires_grad_().clone()).square().mean().backward()
    net, net_opt = zerodp.initialize(blocks(), torch.optim.SGD, zerodp.Config(stage=3, unit_modules=(_InPlaceBlock,)),
                                     lr=0.1)
    net_opt.backward(net(x.clone()).square().mean())
    net_opt.step()
    want = {n: p.detach() - 0.1 * p.grad for n, p in plain.named_parameters() if p.requires_grad}
    got = zerodp.full_state_dict(net, net_opt)
    out["in_place"] = max(float((got[n] - w).abs().max()) for n, w in want.items())
    return out
