"""Cases for test_sequence_parallel.py: Hugging Face Llama (grouped-query attention) and GPT-2
from tiny configs, trained with sequence_parallel_size > 1 beside ZeRO, against one process
training the whole model on the data-parallel global batch (each sequence-parallel group's
batch, the loss averaged over the groups as DDP averages its ranks'). Every rank of a group
is given the same full-length batch."""
from __future__ import annotations

import torch
import torch.nn as nn

import zerodp
from parity import rel_diff as rel

STEPS = 3
VOCAB, SEQ, ROWS = 64, 16, 2
SGD = {"lr": 0.05, "momentum": 0.9}
ADAMW = {"lr": 1e-2}
LAYERS = 2


def llama(attn: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation=attn)
    return LlamaForCausalLM(cfg)


def gpt2(attn: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64,
                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, attn_implementation=attn)
    return GPT2LMHeadModel(cfg)


def gpt(attn: str) -> nn.Module:
    from zerodp.demo.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=LAYERS, n_head=4, n_embd=32))


MODELS = {"llama": llama, "gpt2": gpt2, "gpt": gpt}


def build(name: str, attn: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name](attn)
    if name != "gpt":
        model.config._attn_implementation = attn
    return model


def loss_of(model: nn.Module, name: str, b: dict):
    """The model's loss on batch `b` (the bundled GPT: idx and the shifted targets), and
    whether its output carried logits."""
    if name == "gpt":
        targets = torch.cat([b["labels"][:, 1:], torch.full_like(b["labels"][:, :1], -100)], dim=1)
        logits, loss = model(b["input_ids"], targets)
        return loss, logits is not None
    out = model(**b)
    return out.loss, out.logits is not None


def batch(step: int, group: int, padded: bool = False) -> dict:
    """One sequence-parallel group's batch; `padded`: the second row's last 5 tokens are
    padding (attention_mask 0, labels -100)."""
    g = torch.Generator().manual_seed(1000 * step + group)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if padded:
        mask = torch.ones_like(ids)
        mask[1, -5:] = 0
        out["labels"][1, -5:] = -100
        out["attention_mask"] = mask
    return out


def optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, **SGD)
    return torch.optim.AdamW(params, **ADAMW)


def train_reference(name, attn, opt_name, groups, padded):
    ref = build(name, attn)
    opt = optimizer(opt_name, ref.parameters())
    losses = []
    for step in range(STEPS):
        loss = sum(loss_of(ref, name, batch(step, g, padded))[0] for g in range(groups)) / groups
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return ref, losses


def parity_case(rank, world_size, name, stage, opt_name, sp, attn="sdpa", padded=False, checkpointing=False,
                tiled=False, on_host=False, tiled_mlp=False, units=(), fields=None):
    """Train `name` at `stage` with sequence_parallel_size=`sp` for STEPS steps: per step the
    loss every rank returned and the mean over the groups, at the end every parameter,
    against the reference (untiled); the all-to-alls the ledger counted per step; with
    `tiled_mlp`, the MLP tiles each layer computed. `fields`: more Config fields."""
    from zerodp.sequence_parallel.tiled_mlp import TiledMLP

    groups = world_size // sp
    ref, ref_losses = train_reference(name, attn, opt_name, groups, padded)
    model = build(name, attn)
    if checkpointing:  # Hugging Face's: each layer's forward, all-to-alls included, runs again in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = zerodp.Config(stage=stage, sequence_parallel_size=sp, tiled_loss=tiled, activations_on_host=on_host,
                        tiled_mlp=tiled_mlp, **({"unit_modules": units} if units else {}), **(fields or {}))
    model, opt = zerodp.initialize(model, lambda ps: optimizer(opt_name, ps), cfg)
    mlps = [m.forward for m in model.modules() if isinstance(m.forward, TiledMLP)]
    comm = opt.comm
    group = rank // sp
    losses, group_losses, a2a = [], [], []
    for step in range(STEPS):
        loss, has_logits = loss_of(model, name, batch(step, group, padded))
        loss.backward()
        opt.step()
        opt.zero_grad()
        records = comm.ledger.last_step
        a2a.append([(r.phase, r.axis, r.label, r.numel) for r in records if r.op == "all_to_all"])
        group_losses.append(float(loss.detach()))
        assert has_logits != tiled
        losses.append(float(comm.sum_scalar(loss.detach().reshape(1)).sum()) / world_size)
    with zerodp.gathered_parameters(model):
        want = dict(ref.named_parameters())
        errors = {n: rel(p.detach(), want[n].detach()) for n, p in model.named_parameters()}
    report = opt.memory_report()
    store = opt.tensor_parallel.checkpoints if opt.tensor_parallel is not None else None
    return {"rank": rank, "mlp_tiles": [m.tiles_run for m in mlps], "units": [u.name for u in opt.stage3.units]
            if getattr(opt, "stage3", None) is not None else [],
            "host_checkpoints": None if store is None else store.held_nbytes(),
            "host_peak": 0 if store is None else store.peak_nbytes, "checkpointing": checkpointing, "losses": losses, "group_losses": group_losses, "ref_losses": ref_losses,
            "errors": errors, "a2a": a2a, "sp_rank": comm.topology.sp_rank, "shard_size": comm.shard_size,
            "params": report.params, "numel": sum(p.numel() for p in ref.parameters())}


def refusal_case(rank, world_size):
    """What sequence parallelism refuses, each message on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = "no error"
        except Exception as e:  # noqa: BLE001
            out[key] = f"{type(e).__name__}: {e}"

    def odd_heads():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=3, num_key_value_heads=3)
        zerodp.initialize(LlamaForCausalLM(cfg), torch.optim.SGD, zerodp.Config(sequence_parallel_size=2), lr=0.1)

    def odd_kv_heads():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=1)
        zerodp.initialize(LlamaForCausalLM(cfg), torch.optim.SGD, zerodp.Config(sequence_parallel_size=2), lr=0.1)

    def not_hf():
        zerodp.initialize(nn.Sequential(nn.Linear(4, 4)), torch.optim.SGD, zerodp.Config(sequence_parallel_size=2),
                          lr=0.1)

    def odd_length():
        model, _ = zerodp.initialize(build("llama", "sdpa"), torch.optim.SGD,
                                     zerodp.Config(sequence_parallel_size=2), lr=0.1)
        ids = torch.zeros(1, SEQ - 1, dtype=torch.long)
        model(input_ids=ids, labels=ids)

    def sliding_window():
        from transformers import MistralConfig, MistralForCausalLM

        torch.manual_seed(0)
        cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                            attn_implementation="sdpa")
        zerodp.initialize(MistralForCausalLM(cfg), torch.optim.SGD, zerodp.Config(sequence_parallel_size=2), lr=0.1)

    def different_batches():
        model, _ = zerodp.initialize(build("llama", "sdpa"), torch.optim.SGD,
                                     zerodp.Config(sequence_parallel_size=2), lr=0.1)
        model(**batch(0, rank))  # sampled by the rank instead of the group

    attempt("different", different_batches)
    attempt("window", sliding_window)
    attempt("heads", odd_heads)
    attempt("kv_heads", odd_kv_heads)
    attempt("not_hf", not_hf)
    attempt("length", odd_length)
    return out


def exchange_case(rank, world_size):
    """q, k, v of different head counts (GQA) and head sizes (DeepSeek-V3's 192-wide q and k
    beside a 128-wide v; here 6 and 4) in `sequences_to_heads`' one exchange, against what each
    rank's heads of the whole sequence are (every rank's tokens gathered by torch directly),
    forward and backward; against one exchange per tensor, and with a v of another dtype."""
    import torch.distributed as dist

    from zerodp.distributed import Comm, Topology
    from zerodp.sequence_parallel import heads_to_sequence, sequence_to_heads, sequences_to_heads

    comm = Comm(topology=Topology.build(None, torch.device("cpu")).with_sequence_parallel(world_size))
    k = world_size
    g = torch.Generator().manual_seed(rank)
    shapes = {"q": (2, 4, 3, 6), "k": (2, 2, 3, 6), "v": (2, 2, 3, 4)}
    local = {n: torch.randn(shape, generator=g, requires_grad=True) for n, shape in shapes.items()}
    weights = {n: torch.randn((b, h // k, t * k, d), generator=g) for n, (b, h, t, d) in shapes.items()}

    def every_rank(x):  # x of every rank, in rank order
        parts = [torch.empty_like(x) for _ in range(k)]
        dist.all_gather(parts, x.detach().contiguous())
        return parts

    def whole(x):  # [B, H, S, D]: every rank's tokens, in rank order
        return torch.cat(every_rank(x), dim=2)

    fused = dict(zip(shapes, sequences_to_heads(comm, *local.values())))
    sum((fused[n] * weights[n]).sum() for n in shapes).backward()
    out = {"forward": 0.0, "backward": 0.0, "separate": 0.0, "round_trip": 0.0, "dtypes": 0.0}
    for n, (b, h, t, d) in shapes.items():
        mine = slice(rank * h // k, (rank + 1) * h // k)
        out["forward"] = max(out["forward"], float((fused[n] - whole(local[n])[:, mine]).abs().max()))
        # d/dx of sum(out * w): for head group j, rank j's weights at this rank's tokens.
        want = torch.cat([w[:, :, rank * t: (rank + 1) * t] for w in every_rank(weights[n])], dim=1)
        out["backward"] = max(out["backward"], float((local[n].grad - want).abs().max()))
        alone = sequence_to_heads(local[n].detach(), comm)
        out["separate"] = max(out["separate"], float((alone - fused[n].detach()).abs().max()))
        back = heads_to_sequence(alone, comm)
        out["round_trip"] = max(out["round_trip"], float((back - local[n].detach()).abs().max()))
    mixed = sequences_to_heads(comm, local["q"].detach(), local["k"].detach(), local["v"].detach().double())
    out["dtypes"] = max(float((a.double() - fused[n].detach().double()).abs().max()) for a, n in zip(mixed, shapes))
    out["mixed_dtype"] = str(mixed[2].dtype)
    return out


def tiled_memory_case(rank, world_size, stage, tiled, vocab=4096, seq=256):
    """Peak tensor memory a training step's forward and backward add, with and without the
    tiled loss, on a Llama whose vocabulary is 128x its hidden size (the logits dominate);
    and the loss and gradients, for the comparison."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerodp.memory.allocations import TensorAllocations

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model, opt = zerodp.initialize(LlamaForCausalLM(cfg), torch.optim.SGD,
                                   zerodp.Config(stage=stage, tiled_loss=tiled), lr=0.1)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    with TensorAllocations() as added:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    opt.step()
    with zerodp.gathered_parameters(model):
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"peak": added.peak_nbytes, "loss": float(out.loss.detach()), "logits_nbytes": seq * vocab * 4,
            "params": after}


def tiled_mlp_case(rank, world_size, stage, intermediate=1024, seq=256):
    """One process, one Llama layer whose MLP is 32x its hidden size wide (the intermediate
    dominates), one SGD step with and without the tiled MLP (the same initial weights and
    batch): the peak tensor memory its forward and backward add, the loss and the parameters
    after the step, and the tiles each forward ran."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerodp.memory.allocations import TensorAllocations
    from zerodp.sequence_parallel.tiled_mlp import TiledMLP

    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(7))
    out = {"intermediate_nbytes": seq * intermediate * 4}
    for tiled in (False, True):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                          tie_word_embeddings=False, attn_implementation="sdpa")
        model, opt = zerodp.initialize(LlamaForCausalLM(cfg), torch.optim.SGD,
                                       zerodp.Config(stage=stage, tiled_mlp=tiled), lr=0.1)
        with TensorAllocations() as added:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        with zerodp.gathered_parameters(model):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        tiles = [m.forward.tiles_run for m in model.modules() if isinstance(m.forward, TiledMLP)]
        out["tiled" if tiled else "plain"] = {"peak": added.peak_nbytes, "loss": float(loss.detach()),
                                              "params": params, "tiles": tiles}
    return out


def with_and_without_case(rank, world_size, name, stage, precision="bf16", micro_batches=1):
    """zerodp with sequence_parallel_size=world_size against zerodp without it on the same
    world, both in `precision`, every rank given the same batch (so that the run without
    sequence parallelism averages N copies of one batch's gradient: one process's); each
    step's batch split in `micro_batches` along its rows, accumulated."""
    runs = {}
    for sp in (world_size, 1):
        model = build(name, "sdpa")
        cfg = zerodp.Config(stage=stage, sequence_parallel_size=sp, mixed_precision=precision,
                            grad_accumulation_steps=micro_batches)
        model, opt = zerodp.initialize(model, lambda ps: optimizer("sgd", ps), cfg)
        losses = []
        for step in range(STEPS):
            full = batch(step, 0, padded=True)
            total = 0.0
            for m in range(micro_batches):
                part = {k: v.chunk(micro_batches)[m] for k, v in full.items()}
                loss = model(**part).loss / micro_batches
                loss.backward()
                total += float(loss.detach())
            opt.step()
            opt.zero_grad()
            losses.append(total)
        with zerodp.gathered_parameters(model):
            params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        runs[sp] = (losses, params)
    (losses, params), (plain_losses, plain) = runs[world_size], runs[1]
    return {"losses": losses, "plain_losses": plain_losses,
            "errors": {n: rel(p, plain[n]) for n, p in params.items()}}


def checkpoint_case(rank, world_size, path, stage):
    """Train 2 steps with sequence_parallel_size=world_size, zerodp.save; load into the model
    without sequence parallelism (same world, every rank given the same batch): the same
    parameters, and one more step of each the same."""
    runs = {}
    for sp in (world_size, 1):
        model = build("llama", "sdpa")
        cfg = zerodp.Config(stage=stage, sequence_parallel_size=sp)
        model, opt = zerodp.initialize(model, lambda ps: optimizer("adamw", ps), cfg)
        if sp > 1:
            for step in range(2):
                model(**batch(step, 0, padded=True)).loss.backward()
                opt.step()
                opt.zero_grad()
            zerodp.save(path, model, opt)
        else:
            zerodp.load(path, model, opt)
        with zerodp.gathered_parameters(model):
            loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = model(**batch(2, 0, padded=True)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        with zerodp.gathered_parameters(model):
            after = {n: p.detach().clone() for n, p in model.named_parameters()}
        runs[sp] = (loaded, float(loss.detach()), after)
    (saved, loss, after), (loaded, plain_loss, plain_after) = runs[world_size], runs[1]
    return {"load_errors": max(rel(loaded[n], p) for n, p in saved.items()), "loss": loss, "plain_loss": plain_loss,
            "errors": max(rel(after[n], p) for n, p in plain_after.items())}


def two_forwards_case(rank, world_size, stage, attn):
    """Hugging Face gradient checkpointing, two forwards of differently padded batches before
    one backward of their mean: each recomputed layer must get its own forward's mask."""
    first = batch(0, 0, padded=True)
    second = batch(1, 0)
    mask = torch.ones_like(second["input_ids"])
    mask[0, -3:] = 0
    second["labels"][0, -3:] = -100
    second["attention_mask"] = mask
    ref = build("llama", attn)
    ref_opt = optimizer("sgd", ref.parameters())
    ref_loss = (ref(**first).loss + ref(**second).loss) / 2
    ref_loss.backward()
    ref_opt.step()
    model = build("llama", attn)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, opt = zerodp.initialize(model, lambda ps: optimizer("sgd", ps),
                                   zerodp.Config(stage=stage, sequence_parallel_size=world_size))
    loss = (model(**first).loss + model(**second).loss) / 2
    loss.backward()
    opt.step()
    with zerodp.gathered_parameters(model):
        want = dict(ref.named_parameters())
        errors = {n: rel(p.detach(), want[n].detach()) for n, p in model.named_parameters()}
    return {"loss": float(loss.detach()), "ref_loss": float(ref_loss.detach()), "errors": errors}


def trainer_case(rank, world_size, root):
    """zerodp's Hugging Face Trainer with sequence_parallel_size=world_size (one group reading
    with world_size times the per-device batch, as DDP's ranks read together) against the plain
    Trainer under DDP (hf_trainer_cases' model, data and arguments: accumulation, clipping
    computed every step, an eval before the first step)."""
    import os

    import hf_trainer_cases as hf

    hf._distributed_env(rank, world_size)
    ddp = hf.run(os.path.join(root, "ddp"), evaluate=True)
    sp = hf.run(os.path.join(root, "sp"), zerodp.Config(stage=3, sequence_parallel_size=world_size), evaluate=True,
                per_device_train_batch_size=world_size * hf.BATCH, per_device_eval_batch_size=world_size * hf.BATCH)
    metrics = None
    try:
        hf.ZeroTrainer(model=hf.build_model(), args=hf.arguments(os.path.join(root, "m")),
                       zerodp_config=zerodp.Config(sequence_parallel_size=world_size),
                       train_dataset=hf.Windows(hf.SAMPLES, seed=1), compute_metrics=lambda p: {})
    except Exception as e:  # noqa: BLE001
        metrics = f"{type(e).__name__}: {e}"
    return {"ddp": ddp, "sp": sp, "numel": hf.numel(), "metrics": metrics}
