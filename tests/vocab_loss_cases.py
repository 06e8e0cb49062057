"""The vocabulary-parallel cross-entropy (test_vocab_parallel_loss.py) in a world of 2 at
DP x TP = 1 x 2: the function against torch's cross_entropy on the whole logits, and the
bundled GPT and a Hugging Face Llama trained through their own loss path with the logits
kept split, against the same run with the logits gathered."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import zerodp
from tp_cases import BATCH, GPT_CFG, build, global_batch
from zerodp.tensor_parallel import keep_logits_split, vocab_parallel_cross_entropy
from zerodp.tensor_parallel.loss import LABEL

TOKENS, VOCAB, IGNORE = 37, 64, -100


def _comm(rank: int):
    """A Comm with the tp axis: the one a tensor-parallel model is initialized with."""
    _, opt = zerodp.initialize(build("gpt", seed=rank), torch.optim.SGD, zerodp.Config(stage=0, tensor_parallel_size=2),
                               lr=0.1)
    return opt.comm


def function_case(rank: int, world_size: int) -> dict:
    comm = _comm(rank)
    g = torch.Generator().manual_seed(7)
    full = 5 * torch.randn(TOKENS, VOCAB, generator=g)  # spread: softmax far from uniform
    target = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    target[::5] = IGNORE
    upstream = torch.rand(TOKENS, generator=g)
    tp, r = comm.topology.tp_size, comm.topology.tp_rank
    width = VOCAB // tp
    out = {}
    for reduction in ("mean", "sum", "none"):
        ref_in = full.clone().requires_grad_()
        ref = F.cross_entropy(ref_in, target, ignore_index=IGNORE, reduction=reduction)
        mine_in = full[:, r * width:(r + 1) * width].clone().requires_grad_()
        before = len(comm.ledger.current)
        mine = vocab_parallel_cross_entropy(mine_in, target, comm, ignore_index=IGNORE, reduction=reduction)
        records = [(x.op, x.numel, x.axis, x.label) for x in comm.ledger.current[before:]]
        (ref * upstream if reduction == "none" else ref).sum().backward()
        (mine * upstream if reduction == "none" else mine).sum().backward()
        out[reduction] = {"ref": ref.detach(), "mine": mine.detach(), "mine_grad": mine_in.grad,
                          "ref_grad": ref_in.grad[:, r * width:(r + 1) * width], "records": records}
    none_kept = torch.full((4,), IGNORE)
    out["all_ignored"] = (F.cross_entropy(full[:4], none_kept, ignore_index=IGNORE),
                          vocab_parallel_cross_entropy(full[:4, r * width:(r + 1) * width], none_kept, comm))
    return out


def _saved_bytes(fn) -> tuple:
    """What fn() keeps for backward (bytes of the tensors autograd saves, each storage once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = fn()
    return value, sum(seen.values())


def model_case(rank: int, world_size: int, kind: str) -> dict:
    """Two SGD steps at stage 1, gathered then split; each step's loss and the parameters
    after; the bytes kept for backward by the first forward of each."""
    out = {}
    for mode in ("gathered", "split"):
        model = build(kind, seed=rank)
        model.gradient_checkpointing_disable() if kind != "gpt" else None
        model, opt = zerodp.initialize(model, torch.optim.SGD, zerodp.Config(stage=1, tensor_parallel_size=2),
                                       lr=0.5, momentum=0.9)
        if mode == "split":
            keep_logits_split(model)
        losses, saved, grad_max = [], None, []
        for step in range(2):
            ids = global_batch(step, 1)[:BATCH]
            if kind == "gpt":
                def run():
                    return model(ids[:, :-1], ids[:, 1:])
            else:
                labels = ids.clone()
                labels[:, ::3] = IGNORE  # the Hugging Face convention for tokens without a loss
                def run():
                    o = model(input_ids=ids, labels=labels)
                    return o.logits, o.loss
            (logits, loss), nbytes = _saved_bytes(run)
            if step == 0:
                saved, out[f"{mode}_logits_shape"] = nbytes, tuple(logits.shape)
            opt.backward(loss)
            # The largest gradient element (an inf-norm that clips nothing), for the rounding bound.
            grad_max.append(float(opt.clip_grad_norm_(float("inf"), norm_type=float("inf"))))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with zerodp.gathered_parameters(model):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[mode] = {"losses": losses, "params": params, "saved_bytes": saved, "grad_max": grad_max,
                     "logits_peak": opt.memory_report().logits_peak}
    return out
