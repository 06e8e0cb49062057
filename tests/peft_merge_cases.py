"""peft's in-place merges called on a PEFT model trained with zerodp (test_peft_merge.py).

A tiny GPT-2 (its attention and MLP are Conv1D: peft merges them transposed) with LoRA on
c_attn, c_proj and c_fc, random B so every delta is nonzero, trained one SGD step under
zerodp; then each of peft's merge methods is called as a user would call it, on every rank.
Each call must raise before changing any weight: the logits of a fixed batch and the full
state dict are compared before and after.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import zerodp  # noqa: E402

VOCAB, SEQ, ROWS, LR = 97, 8, 2, 0.1
# Each way peft changes the base weights in place, as a user calls it.
CALLS = {
    "merge_adapter": lambda m: m.merge_adapter(),
    "unmerge_adapter": lambda m: m.unmerge_adapter(),
    "unload": lambda m: m.unload(),
    "merge_and_unload": lambda m: m.merge_and_unload(),
    "tuner.merge_and_unload": lambda m: m.base_model.merge_and_unload(),
    "layer.merge": lambda m: m.base_model.model.transformer.h[0].attn.c_attn.merge(),
}


def lora_gpt2():
    transformers.set_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    torch.manual_seed(1)  # the adapters' random init, the same on every rank and in the reference
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"],
                                           lora_dropout=0.0, init_lora_weights=False, fan_in_fan_out=True))


def batch(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(rank))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch(99)).logits.detach().clone()


def in_place_merges(rank: int, world_size: int, stage: int) -> dict:
    """For each call: whether it raised (and what), and whether the logits and the full
    state dict stayed bitwise the same."""
    model, opt = zerodp.initialize(lora_gpt2(), torch.optim.SGD, zerodp.Config(stage=stage), lr=LR)
    ids = batch(rank)
    opt.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    model.zero_grad(set_to_none=True)
    out = {}
    for name, call in CALLS.items():
        logits, state = _logits(model), zerodp.full_state_dict(model, opt, rank0_only=False)
        entry: dict = {"error": None}
        try:
            call(model)
        except Exception as e:  # noqa: BLE001 - the refusal is what the test reads
            entry["error"] = f"{type(e).__name__}: {e}"
        try:
            entry["logits_equal"] = torch.equal(_logits(model), logits)
            after = zerodp.full_state_dict(model, opt, rank0_only=False)
            entry["state_equal"] = sorted(after) == sorted(state) and all(torch.equal(after[k], state[k])
                                                                          for k in state)
        except Exception as e:  # noqa: BLE001 - a model left unusable is a failure the test reports
            entry["logits_equal"] = entry["state_equal"] = False
            entry["after_error"] = f"{type(e).__name__}: {e}"
        out[name] = entry
        # A model changed on any rank ends the calls on every rank (the ranks' collectives
        # must stay paired): the remaining calls would start from another model.
        unchanged = entry["error"] is not None and entry["state_equal"] and entry["logits_equal"]
        everywhere = [None] * world_size
        dist.all_gather_object(everywhere, unchanged)
        if not all(everywhere):
            break
    # Still trainable as before: one more step runs.
    opt.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    return out
