"""Reinforcement-learning loops with zerodp (test_rl.py): the weight stream
(`zerodp.iter_full_params`) against `full_state_dict` with the memory it adds measured, a
PEFT model's merged stream against peft's merge, the stream under tensor parallelism; the
generation context's gathers per generated token from the comm ledger; TRL's GRPOTrainer
through `with_zerodp` against GRPOTrainer under DDP, and its resume.

Every model is built from a config from seed 0 (nothing downloaded): a GPT-2 with tied
embeddings, 2 blocks, vocabulary 64, dropout off, so that a rollout's randomness is only
its sampling.
"""
from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import zerodp  # noqa: E402
from zerodp.checkpoint.tp_pieces import splits_of  # noqa: E402
from zerodp.memory.allocations import TensorAllocations  # noqa: E402

VOCAB, EOS, PAD = 64, 63, 62
STEPS = 3
GRPO_LR = 0.05


def gpt2(layers: int = 2) -> GPT2LMHeadModel:
    transformers.set_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=2, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD,
                        initializer_range=0.2)  # logits far apart: a greedy rollout is not decided by rounding
    return GPT2LMHeadModel(config)


def lora_gpt2():
    from peft import LoraConfig, get_peft_model
    base = gpt2()
    torch.manual_seed(1)  # random A and B (init_lora_weights=False): every delta is not zero
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                                           lora_dropout=0.0, init_lora_weights=False))


def _consume(stream, reference: dict, units_nbytes: int) -> dict:
    """Read the stream as a weight loader does (each tensor used, then dropped at the next),
    checking each against `reference`; the tensor memory it added, measured."""
    names, equal = [], True
    with TensorAllocations() as added:
        for name, t in stream:
            names.append(name)
            equal = equal and name in reference and t.dtype == reference[name].dtype and torch.equal(
                t, reference[name])
        t = None
    return {"names": names, "equal": equal, "peak": added.peak_nbytes, "left": added.nbytes, "unit": units_nbytes}


def stream_case(rank: int, world_size: int) -> dict:
    """Stage 3, fresh (the pool holds nothing yet: every gathered byte is new memory): the
    stream against full_state_dict, its memory against full_state_dict's; to one rank; in
    bf16; the gathers it issues; stage 1."""
    model, opt = zerodp.initialize(gpt2(), torch.optim.SGD, zerodp.Config(stage=3), lr=0.1)
    unit = max(u.full_nbytes for u in opt.stage3.units)
    with TensorAllocations() as whole:
        full = zerodp.full_state_dict(model, opt)
    out = {"full_names": sorted(full), "full_peak": whole.peak_nbytes, "unit": unit,
           "model": sum(t.numel() * t.element_size() for n, t in full.items() if n != "lm_head.weight")}
    ledger = opt.comm.ledger
    before = len(ledger.current)
    out["stream"] = _consume(zerodp.iter_full_params(model, opt, buffers=True), full, unit)
    out["gathers"] = sum(r.op == "all_gather" for r in ledger.current[before:])
    out["units"] = len(opt.stage3.units)
    tied = [t for n, t in zerodp.iter_full_params(model, opt) if n in ("transformer.wte.weight", "lm_head.weight")]
    out["tied_one_tensor"] = len(tied) == 2 and tied[0] is tied[1]
    out["to_rank_1"] = len(list(zerodp.iter_full_params(model, opt, rank=1)))
    bf16 = {k: v.to(torch.bfloat16) for k, v in full.items()}
    out["bf16"] = _consume(zerodp.iter_full_params(model, opt, dtype=torch.bfloat16, buffers=True), bf16, unit)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    out["params_only"] = sorted(n for n, _ in zerodp.iter_full_params(model, opt)) == sorted(params)
    out["vllm"] = _vllm_seam(model, opt, full)
    model1, opt1 = zerodp.initialize(gpt2(), torch.optim.SGD, zerodp.Config(stage=1), lr=0.1)
    out["stage1"] = _consume(zerodp.iter_full_params(model1, opt1, buffers=True), zerodp.full_state_dict(model1, opt1),
                             unit)
    return out


def _vllm_seam(model, opt, full: dict) -> bool:
    """TRL's vLLM weight sync (`VLLMGeneration._iter_named_params`, every rank iterates it)
    replaced by zerodp's stream on a trainer zerodp prepares: each parameter once (the tied
    head under the embedding's name), whole."""
    import types

    from zerodp.integrations.rl import install_trl_seams

    class VLLMGeneration:  # what TRL's sync calls; vLLM itself is not needed to call it
        def _iter_named_params(self):
            raise AssertionError("TRL's own weight iteration ran")

    trainer = types.SimpleNamespace(model=model, optimizer=opt, vllm_generation=VLLMGeneration(), args=None)
    install_trl_seams(trainer)
    got = list(trainer.vllm_generation._iter_named_params())
    return (sorted(n for n, _ in got) == sorted(n for n, _ in model.named_parameters())
            and all(torch.equal(t, full[n]) for n, t in got))


def peft_stream_case(rank: int, world_size: int) -> dict:
    """A PEFT model at stage 3 (LoRA on GPT-2's Conv1D projections, fan_in_fan_out): its
    stream is peft's merge_and_unload of the same model, under the base's names."""
    model, opt = zerodp.initialize(lora_gpt2(), torch.optim.SGD, zerodp.Config(stage=3), lr=0.1)
    want = lora_gpt2().merge_and_unload().state_dict()
    unit = max(u.full_nbytes for u in opt.stage3.units)
    names, worst = [], 0.0
    with TensorAllocations() as added:
        for name, t in zerodp.iter_full_params(model, opt, buffers=True):
            names.append(name)
            with added.paused():  # the check's temporaries are not the stream's
                worst = max(worst, float(((t - want[name]).abs() / (1 + want[name].abs())).max()))
        t = None
    return {"names": sorted(names), "want": sorted(want), "worst": worst, "peak": added.peak_nbytes, "unit": unit}


def parallel_stream_case(rank: int, world_size: int) -> dict:
    """N = 4 at stage 3: tensor parallelism 2 x 2 (HF Llama, tp_cases' model) and expert
    parallelism 2 (Mixtral, moe_cases' model): the stream is the one-process model, every
    tensor whole (the original, not this rank's slice or its experts)."""
    import moe_cases
    import tp_cases
    out = {}
    for kind, build, config in (("tp", lambda: tp_cases.build("llama", seed=0), {"tensor_parallel_size": 2}),
                                ("ep", lambda: moe_cases.build("mixtral"), {"expert_parallel_size": 2})):
        model, opt = zerodp.initialize(build(), torch.optim.SGD, zerodp.Config(stage=3, **config), lr=0.1)
        want = build().state_dict()
        full = zerodp.full_state_dict(model, opt)
        unit = max(u.full_nbytes for u in opt.stage3.units)  # this rank's slices of the unit
        stream = _consume(zerodp.iter_full_params(model, opt, buffers=True), want, unit)
        out[kind] = {"names": sorted(stream["names"]) == sorted(want), "equal": stream["equal"],
                     "peak": stream["peak"], "unit": unit, "split": len(splits_of(opt)),
                     "as_full_state_dict": sorted(full) == sorted(want) and all(
                         torch.equal(full[k], want[k]) for k in want)}
    return out


# -- generation ------------------------------------------------------------------------------
NEW_TOKENS = 6


def _rollout(model, opt, prompt, context=None, **kw) -> dict:
    """One rollout, in `context` if given (its gathers on entry counted with the rollout's)."""
    ledger = opt.comm.ledger
    before = len(ledger.current)
    with torch.no_grad(), context if context is not None else contextlib.nullcontext() as kept:
        on_entry = sum(r.op == "all_gather" for r in ledger.current[before:])
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                             output_scores=True, return_dict_in_generate=True, **kw)
        kept_units = list(kept.units) if kept is not None else []
    gathers = [r for r in ledger.current[before:] if r.op == "all_gather"]
    return {"tokens": out.sequences.tolist(), "scores": torch.stack(out.scores), "gathers": len(gathers),
            "on_entry": on_entry, "kept": kept_units, "gathered_numel": sum(r.numel for r in gathers)}


def generation_case(rank: int, world_size: int) -> dict:
    """Greedy and sampled rollouts of a stage-3 GPT-2: as today, in the generation context
    (every unit kept), with a budget of one block, and under DDP's layout (stage 0)."""
    out = {}
    prompt = torch.tensor([[5, 9, 2, 17], [3, 3, 8, 1]])
    model, opt = zerodp.initialize(gpt2(layers=3).eval(), torch.optim.SGD, zerodp.Config(stage=3), lr=0.1)
    units = opt.stage3.units
    out["units"], out["block"] = len(units), units[0].full_nbytes
    plain, _ = zerodp.initialize(gpt2(layers=3).eval(), torch.optim.SGD, zerodp.Config(stage=0), lr=0.1)
    for kind, kw in (("greedy", {"do_sample": False}), ("sampled", {"do_sample": True, "top_k": 0})):
        torch.manual_seed(5)
        ref = _rollout(plain, opt, prompt, **kw)
        torch.manual_seed(5)
        today = _rollout(model, opt, prompt, **kw)
        torch.manual_seed(5)
        context = zerodp.generation_context(model, opt)
        kept_run = _rollout(model, opt, prompt, context, **kw)
        out[f"{kind}_kept_units"] = len(kept_run["kept"])
        torch.manual_seed(5)
        budget = _rollout(model, opt, prompt, zerodp.generation_context(model, opt, max_gathered_bytes=out["block"]),
                          **kw)
        out[f"{kind}_budget_units"] = len(budget["kept"])
        out[kind] = {name: {"gathers": r["gathers"], "on_entry": r["on_entry"], "same_tokens": r["tokens"] == ref[
            "tokens"], "same_scores": torch.equal(r["scores"], ref["scores"])}
                     for name, r in (("today", today), ("kept", kept_run), ("budget", budget))}
        out[f"{kind}_scores"] = kept_run["scores"]
    out["all_sharded_after"] = all(u.state.value == "sharded" for u in units)
    # Memory: the pools' buffers while a block that keeps every unit is open, and after it.
    pools = list({id(u.pool): u.pool for u in units}.values())
    allocated = lambda: sum(p.allocated_nbytes for p in pools)  # noqa: E731
    in_use = lambda: allocated() - sum(b.nbytes for p in pools for b in p.free)  # noqa: E731
    before, in_use_before = allocated(), in_use()
    with zerodp.generation_context(model, opt) as kept:
        out["pool_inside"], out["kept_nbytes"] = in_use() - in_use_before, kept.nbytes
        out["model_nbytes"] = sum(u.full_nbytes for u in units)
    out["pool_after"], out["in_use_after"] = allocated() - before, in_use() - in_use_before
    # A training forward inside the block is refused before it gathers anything.
    try:
        with zerodp.generation_context(model, opt):
            model(prompt)
        out["training_forward"] = "ran"
    except RuntimeError as e:
        out["training_forward"] = str(e)
    out["sharded_after_refusal"] = all(u.state.value == "sharded" for u in units)
    loss = model(prompt, labels=prompt).loss  # and training goes on after it
    opt.backward(loss)
    opt.step()
    out["trains_after"] = bool(torch.isfinite(loss))
    # The step changed every shard: the next block gathers the new values (nothing kept from
    # the one before), as a rollout without the block does.
    stepped = _rollout(model, opt, prompt, do_sample=False)
    stepped_kept = _rollout(model, opt, prompt, zerodp.generation_context(model, opt), do_sample=False)
    out["after_step"] = {"same_as_today": torch.equal(stepped_kept["scores"], stepped["scores"]),
                         "changed": not torch.equal(stepped_kept["scores"], out["greedy_scores"])}
    return out


# -- TRL GRPO --------------------------------------------------------------------------------
def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    vocab = {f"t{i}": i for i in range(PAD)}
    vocab.update({"<pad>": PAD, "</s>": EOS})
    words = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>")


def toy_reward(completions, **kwargs) -> list:
    """How many of the completion's tokens have an even id (varied within every group, so
    every step has advantages and a gradient)."""
    return [float(sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in c.split())) for c in completions]


def _grpo(out: str, config, peft: bool = False, max_steps: int = STEPS, save: bool = False, resume=None,
          gather_for_generation: bool = True) -> dict:
    """TRL's GRPOTrainer on the GPT-2 policy, under DDP (config None) or through `with_zerodp`:
    each step's logged loss, reward, completion length and gradient norm, and the volume of
    forward all-gathers (zerodp's ledger)."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from zerodp.integrations.hf import with_zerodp

    g = torch.Generator().manual_seed(3)
    prompts = [" ".join(f"t{int(i)}" for i in torch.randint(0, PAD, (5,), generator=g)) for _ in range(16)]
    args = GRPOConfig(output_dir=out, max_steps=max_steps, per_device_train_batch_size=2, num_generations=4,
                      max_completion_length=6, optim="sgd", learning_rate=GRPO_LR, lr_scheduler_type="constant",
                      max_grad_norm=10.0, logging_steps=1, save_strategy="steps" if save else "no", save_steps=1,
                      report_to=[], disable_tqdm=True, seed=0, data_seed=0, use_cpu=True, dataloader_num_workers=0,
                      bf16=False, gradient_checkpointing=False, ds3_gather_for_generation=gather_for_generation)
    kwargs = dict(model=gpt2(), reward_funcs=toy_reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                  processing_class=_tokenizer())
    if peft:
        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                           lora_dropout=0.0)
    transformers.set_seed(1)
    trainer = GRPOTrainer(**kwargs) if config is None else with_zerodp(GRPOTrainer)(zerodp_config=config, **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    keys = ("loss", "reward", "completions/mean_length", "grad_norm")
    logs = {e["step"]: {k: float(e[k]) for k in keys} for e in trainer.state.log_history if "loss" in e}
    opt = trainer.optimizer
    zero = config is not None
    weights = zerodp.full_state_dict(trainer.model, opt) if zero else {
        k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"logs": logs, "weights": weights, "backend": type(trainer._dist).__name__,
            "forward_gathers": opt.comm.ledger.totals[("all_gather", "forward")] if zero else None}


def grpo_world(rank: int, world_size: int, root: str) -> dict:
    """GRPOTrainer under DDP and through with_zerodp at stages 1-3 (stage 3 with and without
    the generation context), with a peft_config at stage 3, and a stage-3 run saved at step
    2 and resumed from that checkpoint."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})
    path = lambda name: os.path.join(root, name)  # noqa: E731
    out = {"ddp": _grpo(path("ddp"), None), "ddp_peft": _grpo(path("ddp-peft"), None, peft=True)}
    for stage in (1, 2, 3):
        out[f"z{stage}"] = _grpo(path(f"z{stage}"), zerodp.Config(stage=stage))
    out["z3_today"] = _grpo(path("z3-today"), zerodp.Config(stage=3), gather_for_generation=False)
    out["z3_peft"] = _grpo(path("z3-peft"), zerodp.Config(stage=3), peft=True)
    _grpo(path("z3-saved"), zerodp.Config(stage=3), max_steps=2, save=True)
    out["resumed"] = _grpo(path("z3-saved"), zerodp.Config(stage=3), resume=path("z3-saved/checkpoint-2"))
    return out
