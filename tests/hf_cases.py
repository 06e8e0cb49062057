"""Hugging Face client models (GPT-2, Llama, BERT) trained with zerodp against torch DDP.

A case per test in the session's worlds (test_hf_models.py, worldpool.py). Every model is
built from a tiny config, so nothing is downloaded. Each case returns plain numbers; the
tests assert on them in the parent process. Runs against DDP are traced at every step
(parity.StepTrace, hybrid_cases.traced_run); the DDP run of a model is memoized in the worker (`reference`).
"""
from __future__ import annotations

import os

# Built from configs only: never reach for the Hub (set before transformers is imported).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM)
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

import zerodp  # noqa: E402
from core_cases import max_rel_diff, train_reference, train_zerodp  # noqa: E402
from hybrid_cases import as_two_nodes, traced_run  # noqa: E402
from parity import StepTrace  # noqa: E402
from stage3_cases import full_params, rel  # noqa: E402

STEPS = 3
VOCAB = 256
SEQ = 16
ROWS = 2
MASK_ID = 4  # BERT: the id written over the positions it has to predict
PROMPT_LEN, NEW_TOKENS = 6, 5

# Dropout: every probability is set to 0 in the configs and the models stay in training
# mode (as a DDP user trains them). With dropout on, each mask depends on the global RNG
# stream at the moment the layer runs, so any extra random draw on one side (a deepcopy,
# an initialisation path) would change the masks and make the two runs differ for a
# reason that says nothing about the engine; eval() would also disable it, but would
# compare a mode nobody trains in. Everything else is HF's default (GPT-2 and BERT tie
# their output head to the input embedding; Llama does not).


def gpt2() -> nn.Module:
    # bos/eos inside the 256-token vocabulary (GPT-2's default 50256 is not).
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, n_inner=64,
                                      attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))


def llama() -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        attention_dropout=0.0))


def bert() -> nn.Module:
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _ids(step: int, rank: int) -> tuple[torch.Generator, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # per-rank batch, seeded by (step, rank)
    return g, torch.randint(5, VOCAB - 1, (ROWS, SEQ), generator=g)


def causal_loss(model, step, rank, dtype=torch.float32):
    _, ids = _ids(step, rank)
    return model(input_ids=ids, labels=ids).loss  # HF shifts the labels itself


def mlm_loss(model, step, rank, dtype=torch.float32):
    g, ids = _ids(step, rank)
    pick = torch.rand(ids.shape, generator=g) < 0.3
    pick[:, 0] = True  # at least one position to predict in every row
    labels = torch.where(pick, ids, torch.full_like(ids, -100))
    inputs = torch.where(pick, torch.full_like(ids, MASK_ID), ids)
    return model(input_ids=inputs, attention_mask=torch.ones_like(ids), labels=labels).loss


MODELS = {
    # name: (builder, loss, its block class for Config.unit_modules)
    "gpt2": (gpt2, causal_loss, GPT2Block),
    "llama": (llama, causal_loss, LlamaDecoderLayer),
    "bert": (bert, mlm_loss, BertLayer),
}

# Size-based automatic units, on a model whose `_no_split_modules` hint is removed: 4000 is
# below one block's parameter count (GPT-2 and BERT 8.5k, Llama 10.3k at these sizes) and
# above every linear layer inside a block (at most 3.2k), so the policy has to climb from
# the leaf layers to the attention and MLP submodules, pass over the ModuleLists (never
# called, so never units), and meet the 8k-element embeddings and output heads.
UNIT_MIN_PARAMS = 4000


LR = 1e-3


def adamw(params):
    return torch.optim.AdamW(list(params), lr=LR, weight_decay=0.01)


def sgd(params):
    # No momentum, no decay: the update is lr * gradient, so a gradient that is not divided
    # by N (summed instead of averaged) moves every parameter N times too far. AdamW would
    # hide that, being invariant to the scale of the gradient.
    return torch.optim.SGD(list(params), lr=0.1)


def sgd_times(n):
    return lambda params: torch.optim.SGD(list(params), lr=0.1 * n)


def no_hint(builder):
    def build():
        model = builder()
        model._no_split_modules = None  # no HF hint: zerodp falls back to unit_min_params
        return model
    return build


def _ref_params(ref: nn.Module) -> dict:
    return {n: p.detach().float().clone() for n, p in ref.named_parameters()}


def _checksum(params: dict) -> float:
    return float(sum(float(v.double().sum()) for v in params.values()))


def _loss_diff(losses, ref_losses) -> float:
    """Largest |a-b| / (1 + |b|) over the steps' losses (about log(256) = 5.5 here)."""
    assert len(losses) == len(ref_losses) == STEPS
    return max(abs(a - b) / (1 + abs(b)) for a, b in zip(losses, ref_losses))


def _update_rel(got: dict, want: dict, init: dict) -> float:
    """||zerodp - DDP|| / ||DDP - initial|| over all elements: the error as a fraction of
    what training moved. The elementwise bound cannot see a lost gradient in bf16 (Adam
    moves an element by at most lr a step either way, as much as rounding noise can), but
    this norm can: a whole unit left unchanged would make it O(1)."""
    num = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in want)
    den = sum(float((want[n] - init[n]).double().pow(2).sum()) for n in want)
    return (num / den) ** 0.5


def _units_of(opt) -> dict:
    units = opt.stage3.units
    return {"names": [u.name for u in units],
            "types": [type(u.module).__name__ for u in units],
            "all_run": all(type(u.module).forward is not nn.Module.forward for u in units),
            "nonempty": sum(1 for u in units[:-1] if not u.empty)}


def _initial(builder, dtype) -> dict:
    """Every rank's starting point (rank 0's values, seed 0), rounded as training starts."""
    torch.manual_seed(0)
    return {n: p.detach().to(dtype).float() for n, p in builder().named_parameters()}


OPTS = {"adamw": adamw, "sgd": sgd}


# This worker's DDP runs, by (rank, model, precision, optimizer): the worlds live for the
# session (worldpool.py), and one DDP run of a model serves every stage and unit choice of
# the grid and the user path, as it did when they ran in one world. Every rank runs the same
# cases in the same order, so every rank has the same keys (DDP's construction is collective).
_REFERENCES: dict = {}


def reference(rank: int, name: str, precision: str, opt_name: str = "adamw") -> dict:
    key = (rank, name, precision, opt_name)
    if key not in _REFERENCES:
        builder, loss_of, _ = MODELS[name]
        dtype = zerodp.Config(mixed_precision=precision).compute_dtype
        trace = StepTrace()
        ref, losses, _ = train_reference(builder, OPTS[opt_name], dtype, rank, steps=STEPS, loss_of=loss_of,
                                         trace=trace)
        _REFERENCES[key] = {"module": ref, "losses": losses, "trace": trace, "params": _ref_params(ref),
                            "init": _initial(builder, dtype)}
    return _REFERENCES[key]


def _params_of(model, stage: int) -> dict:
    return full_params(model) if stage == 3 else _ref_params(model)


def _run(builder, loss_of, opt_fn, cfg, rank, ref):
    dtypes = set()

    def loss_and_dtype(model, step, rank):
        loss = loss_of(model, step, rank)
        dtypes.add(str(loss.dtype).replace("torch.", ""))  # BERT's MLM loss stays bf16; GPT-2's, Llama's are fp32
        return loss

    model, opt, losses, _, trace = traced_run(builder, opt_fn, cfg, rank, steps=STEPS, loss_of=loss_and_dtype)
    want = ref["params"]
    got = _params_of(model, cfg.stage)
    if cfg.stage == 3:
        r = {"params": rel(got, want), "units": _units_of(opt)}
    else:
        r = {"params": max_rel_diff(model, ref["module"])}
    r.update(per_step=trace.compare(ref["trace"]), loss=_loss_diff(losses, ref["losses"]), losses=losses,
             ref_losses=ref["losses"], checksum=_checksum(got), update_rel=_update_rel(got, want, ref["init"]),
             loss_dtype=",".join(sorted(dtypes)))
    return model, opt, r


def _generate(model, prompt) -> list:
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    model.train()
    return out[0].tolist()


def grid(world_size: int) -> list:
    """(model, precision, stage, variant) of every parity case at this world size: stages 1
    and 2 ("flat"), stage 3 with automatic units, the block class named, and size-based
    units; plus plain SGD at stage 3 on GPT-2. bf16 at N <= 2 only (its tolerance argument
    is the same at N=4; fp32 covers N=4)."""
    cells = []
    for name in MODELS:
        for precision in ("fp32", "bf16") if world_size <= 2 else ("fp32",):
            cells += [(name, precision, 1, "flat"), (name, precision, 2, "flat"), (name, precision, 3, "auto"),
                      (name, precision, 3, "named"), (name, precision, 3, "size")]
    return cells + [("gpt2", "fp32", 3, "sgd")]


def parity_case(rank, world_size, name, precision, stage, variant):
    """One model, precision, stage and unit choice against DDP (AdamW), at every step; the
    "sgd" variant is plain SGD at stage 3, sensitive to the scale of the reduced gradient."""
    builder, loss_of, block = MODELS[name]
    opt_name = "sgd" if variant == "sgd" else "adamw"
    ref = reference(rank, name, precision, opt_name)
    if stage < 3:
        cfg = zerodp.Config(stage=stage, mixed_precision=precision)
    elif variant == "named":
        cfg = zerodp.Config(stage=3, mixed_precision=precision, unit_modules=(block,))
    elif variant == "size":
        cfg = zerodp.Config(stage=3, mixed_precision=precision, unit_min_params=UNIT_MIN_PARAMS)
        builder = no_hint(builder)
    else:  # "auto", "sgd"
        cfg = zerodp.Config(stage=3, mixed_precision=precision)
    model, _, r = _run(builder, loss_of, OPTS[opt_name], cfg, rank, ref)
    if variant == "auto" and precision == "fp32" and name != "bert":
        # Greedy decoding is discontinuous (an argmax), so it is compared only
        # where the two models differ by reduction order alone (fp32, ~1e-7).
        prompt = torch.randint(5, VOCAB - 1, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
        r["generated"] = _generate(model, prompt)
        r["ref_generated"] = _generate(ref["module"], prompt)
    if variant == "sgd":
        # What a gradient summed over the N ranks instead of averaged would give: SGD at N x lr.
        summed, *_ = train_reference(builder, sgd_times(world_size), torch.float32, rank, steps=STEPS,
                                     loss_of=loss_of)
        r["summed_vs_ref"] = max_rel_diff(summed, ref["module"])
    return r


def causal_loss_micro(model, step, rank, dtype=torch.float32, micro=0, micro_batches=1):
    """causal_loss on micro-batch `micro` of `micro_batches` (rows of the step's batch); every
    row has SEQ - 1 predicted tokens, so the mean of the micro-batch means is the batch's."""
    _, ids = _ids(step, rank)
    ids = ids[micro::micro_batches]
    return model(input_ids=ids, labels=ids).loss


def with_checkpointing(builder):
    def build():
        model = builder()
        model.gradient_checkpointing_enable()  # HF's defaults, as a user turns it on
        return model
    return build


USER_MODELS = ("gpt2", "llama")


def user_grid(world_size: int) -> list:
    """(model, precision, stage) of the user path; bf16 as the parity grid: N <= 2."""
    return [(name, precision, stage) for name in USER_MODELS
            for precision in (("fp32", "bf16") if world_size <= 2 else ("fp32",)) for stage in (2, 3)]


def user_path_case(rank, world_size, name, precision, stage):
    """What a user of an HF causal LM turns on together: the model's own gradient
    checkpointing (HF defaults), gradient accumulation over 2 micro-batches, automatic
    units; against DDP on the whole batch without checkpointing (recomputation gives the
    same values), at every step."""
    builder = MODELS[name][0]
    ref = reference(rank, name, precision)
    cfg = zerodp.Config(stage=stage, mixed_precision=precision, grad_accumulation_steps=2)
    model, opt, losses, _, trace = traced_run(with_checkpointing(builder), adamw, cfg, rank, steps=STEPS,
                                              micro_batches=2, loss_of=causal_loss_micro)
    # train_zerodp adds up the micro-batches' mean losses: their mean is the batch's loss.
    trace.losses = [loss / 2 for loss in trace.losses]
    got = full_params(model)
    want = ref["params"]
    return {"params": rel(got, want), "update_rel": _update_rel(got, want, ref["init"]),
            "per_step": trace.compare(ref["trace"]),
            "rel_losses": [abs(a - b) / (1 + abs(b)) for a, b in zip(trace.losses, ref["losses"])],
            "checkpointing": model.is_gradient_checkpointing,
            "units": _units_of(opt)["names"] if stage == 3 else None,
            "memory": {"other": dict(opt.memory_report().other_by_owner)}}


# The user path of user_path_case (GPT-2 from a config, automatic units, HF's gradient
# checkpointing, 2 micro-batches, bf16, stage 3) with hpZ, with all three ZeRO++ parts (4 ranks
# as 2 nodes x 2) and with the optimizer (and stage 3's shards) offloaded to host and to disk.
ZEROPP_OFFLOAD = {"plain": {}, "hpz": {"hpz": True},
                  "zeropp": {"hpz": True, "quantize_weights": True, "quantize_grads": "int8"},
                  "host": {"offload_optimizer": "host"},
                  "disk": {"offload_optimizer": "disk", "offload_dir": "disk"},
                  "params_host": {"offload_optimizer": "host", "offload_params": "host"},
                  "params_disk": {"offload_optimizer": "disk", "offload_params": "disk", "offload_dir": "params_disk"}}
# This worker's runs that other variants are compared with (plain, hpz), by (rank, variant).
_USER_RUNS: dict = {}


def _user_run(rank, variant, root):
    key = (rank, variant)
    if key in _USER_RUNS:
        return _USER_RUNS[key]
    fields = dict(ZEROPP_OFFLOAD[variant])
    if "offload_dir" in fields:
        fields["offload_dir"] = os.path.join(root, fields["offload_dir"])
        os.makedirs(fields["offload_dir"], exist_ok=True)
    cfg = zerodp.Config(stage=3, mixed_precision="bf16", grad_accumulation_steps=2, **fields)
    model, opt, losses, _, volumes = train_zerodp(with_checkpointing(gpt2), adamw, cfg, rank, steps=STEPS,
                                                  micro_batches=2, loss_of=causal_loss_micro)
    run = {"params": full_params(model), "losses": losses, "by_link": volumes[-1]["nbytes_by_link"],
           "checkpointing": model.is_gradient_checkpointing}
    if variant in ("plain", "hpz"):
        _USER_RUNS[key] = run
    return run


def zeropp_offload_case(rank, world_size, variant, root):
    """One variant of ZEROPP_OFFLOAD against the same run without it (plain), at 4 ranks as
    2 nodes x 2; `root` is a directory every rank sees, for the disk offloads."""
    as_two_nodes(rank)
    plain = _user_run(rank, "plain", root)
    run = _user_run(rank, variant, root)
    out = {"same_params": all(torch.equal(run["params"][k], plain["params"][k]) for k in plain["params"]),
           "loss_gap": max(abs(a - b) / b for a, b in zip(run["losses"], plain["losses"])),
           "by_link": run["by_link"], "checkpointing": run["checkpointing"], "plain_by_link": plain["by_link"]}
    if variant == "zeropp":
        out["hpz_by_link"] = _user_run(rank, "hpz", root)["by_link"]
    return out
