"""torch.compile with zerodp (test_compile.py), a case per call in the session's worlds (worldpool.py).

Each case trains the same model from the same weights on the same batches eagerly and in each
compiled way, and returns per-step differences, dynamo's counts and what the compiled graphs
took as parameters; the tests assert on them in the parent process.
"""
from __future__ import annotations

import os

import torch
from torch._dynamo.utils import counters

import zerodp
from zerodp.demo.models import GPT, Block

STEPS = 3
LR = 0.05  # plain SGD: the update is lr * gradient, so a wrong gradient shows at its own scale
ROWS, SEQ, VOCAB = 2, 16, 256

# How the model is compiled (test_compile.py names them):
# whole: torch.compile(model) after initialize; blocks_before / blocks_after: block.compile()
# on each block before / after initialize; units: Config(compile_units=True).
MODES = ("whole", "blocks_before", "blocks_after", "units")


def _gpt2():
    from hf_cases import gpt2

    return gpt2()


def _halved(forward):
    """A forward set on the instance, as accelerate's hooks or a user's patch set one."""
    def patched(*args, **kwargs):
        return forward(*args, **kwargs) * 0.5
    return patched


def _halved_loss(forward):
    def patched(idx, targets=None):
        logits, loss = forward(idx, targets)
        return logits, loss * 0.5
    return patched


def build(name: str, checkpointing: str):
    """(model, its block class): the bundled GPT or Hugging Face GPT-2, tiny; `gpt_patched`:
    the GPT with a forward set on each block instance (halving its output) and on the model
    (halving the loss); `llama_deep`: a 10-layer HF Llama, `use_cache` at its default."""
    torch.manual_seed(0)
    if name in ("gpt", "gpt_patched"):
        model, block = GPT("tiny"), Block
        if name == "gpt_patched":
            for b in _blocks(model, block):
                b.forward = _halved(b.forward)
            model.forward = _halved_loss(model.forward)
    elif name == "llama_deep":
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=10, num_attention_heads=2, num_key_value_heads=2,
                                             max_position_embeddings=64, attention_dropout=0.0))
        block = LlamaDecoderLayer
    else:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        model, block = _gpt2(), GPT2Block
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    return model, block


def loss_of(name: str, model, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(5, VOCAB - 1, (ROWS, SEQ), generator=g)
    if name in ("gpt", "gpt_patched"):
        return model(ids, ids)[1]
    return model(input_ids=ids, labels=ids).loss


class _ParamInputs:
    """Wraps inductor's entry point: records the shape of every graph input that dynamo
    lifted from a parameter (its placeholder is named after it)."""

    def __init__(self):
        import torch._inductor.compile_fx as inductor_compile_fx  # in the ranks only: 2 s to import

        self.shapes: list[tuple] = []
        self._module = inductor_compile_fx
        self._orig = inductor_compile_fx.compile_fx

    def __enter__(self):
        def recording(gm, inputs, *args, **kwargs):
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            self.shapes += [tuple(t.shape) for n, t in zip(names, inputs) if "_parameters_" in n]
            return self._orig(gm, inputs, *args, **kwargs)

        self._module.compile_fx = recording
        return self

    def __exit__(self, *exc):
        self._module.compile_fx = self._orig


def _blocks(model, block):
    return [m for m in model.modules() if isinstance(m, block)]


def train(rank: int, name: str, cfg: dict, mode: str, checkpointing: str = "") -> dict:
    """STEPS SGD steps; the losses, the final full parameters, and dynamo's counts."""
    model, block = build(name, checkpointing)
    shapes = {tuple(p.shape) for p in model.parameters()}
    if mode == "blocks_before":
        for b in _blocks(model, block):
            b.compile()
    config = dict(cfg, compile_units=mode == "units")
    if config.get("stage") == 3:
        config["unit_modules"] = (block,)
    model, opt = zerodp.initialize(model, lambda ps: torch.optim.SGD(list(ps), lr=LR), zerodp.Config(**config))
    if mode == "blocks_after":
        for b in _blocks(model, block):
            b.compile()
    run = torch.compile(model) if mode == "whole" else model
    torch._dynamo.reset()
    counters.clear()
    losses, graphs = [], []
    with _ParamInputs() as seen:
        for step in range(STEPS):
            loss = loss_of(name, run, step, rank)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            graphs.append(counters["stats"]["unique_graphs"])
    with zerodp.gathered_parameters(model):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    breaks = dict(counters["graph_break"])  # reason -> how many times
    return {"losses": losses, "params": params, "graphs": graphs, "breaks": breaks,
            "param_shapes_ok": all(s in shapes for s in seen.shapes), "param_inputs": len(seen.shapes),
            "units": len(opt.stage3.units) if opt.stage3 is not None else 0,
            "blocks": len(_blocks(model, block))}


def _rel(a: dict, b: dict) -> float:
    return max(float(((a[k] - b[k]).abs() / (1 + b[k].abs())).max()) for k in b)


def parity_case(rank, world_size, name, precision, stage, checkpointing, modes):
    """Eager zerodp, then each compiled way, at one stage: per-mode differences and counts."""
    cfg = {"stage": stage, "mixed_precision": precision}
    eager = train(rank, name, cfg, "eager", checkpointing)
    out = {}
    for mode in modes:
        got = train(rank, name, cfg, mode, checkpointing)
        out[mode] = {"loss": max(abs(a - b) / (1 + abs(b)) for a, b in zip(got["losses"], eager["losses"])),
                     "params": _rel(got["params"], eager["params"]),
                     **{k: got[k] for k in ("graphs", "breaks", "param_shapes_ok", "param_inputs", "units",
                                            "blocks")}}
    return out


COMPOSE = {
    # name: the Config fields beside stage 3 and compile_units
    "offload": {"offload_optimizer": "host", "offload_params": "host"},
    "zeropp": {"hpz": True, "quantize_weights": True, "quantize_grads": "int8"},
    "activations_on_host": {"activations_on_host": True},
}


def compose_case(rank, world_size, variant):
    """compile_units beside offload, ZeRO++ or Pa+cpu: the compiled run against the same
    Config run eagerly."""
    if variant == "zeropp":  # two nodes of one rank: hpZ and qgZ's two levels both act
        os.environ.update({"LOCAL_WORLD_SIZE": "1", "RANK": str(rank), "GROUP_RANK": str(rank)})
    cfg = {"stage": 3, **COMPOSE[variant]}
    checkpointing = "non_reentrant" if variant == "activations_on_host" else ""
    eager = train(rank, "gpt", cfg, "eager", checkpointing)
    got = train(rank, "gpt", cfg, "units", checkpointing)
    return {"loss": max(abs(a - b) / (1 + abs(b)) for a, b in zip(got["losses"], eager["losses"])),
            "params": _rel(got["params"], eager["params"]), "graphs": got["graphs"],
            "param_shapes_ok": got["param_shapes_ok"], "param_inputs": got["param_inputs"]}
