"""Cases for test_moe.py: Hugging Face MoE models (Mixtral, Qwen3-MoE) from tiny configs,
trained with expert parallelism beside ZeRO, against one process training the unsplit model
on the global batch (every rank's batch, the loss averaged over the N ranks as DDP's is).

Each rank runs the reference itself (the model is tiny), so it compares its own view: the
parameters the plan does not split whole, its expert banks against its experts' rows of
the reference's banks ([Note: expert split] in zerodp/expert_parallel/plan.py)."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

import zerodp
from parity import rel_diff as rel

STEPS = 3
VOCAB, SEQ, ROWS = 64, 8, 2
EXPERTS, TOP_K = 4, 2
SGD = {"lr": 0.05, "momentum": 0.9}
ADAMW = {"lr": 1e-2}
AUX = 0.02  # the load-balancing loss's weight: part of every loss below


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=EXPERTS,
                        num_experts_per_tok=TOP_K, max_position_embeddings=32, output_router_logits=True,
                        router_aux_loss_coef=AUX, tie_word_embeddings=False)
    return MixtralForCausalLM(cfg)


def qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
                         max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=AUX,
                         tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg)


MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]()
    model.config._attn_implementation = "eager"
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    assert out.aux_loss is not None  # the load-balancing loss is in `loss`
    return out.loss


def optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, **SGD)
    return torch.optim.AdamW(params, **ADAMW)


def train_reference(name: str, opt_name: str, world_size: int, steps: int = STEPS,
                    micro_batches: int = 1) -> tuple[nn.Module, list]:
    """One process, the unsplit model, every rank's batch: DDP's objective, the mean of the
    N ranks' losses (of each rank's micro-batches, as its accumulation averages them)."""
    ref = build(name)
    opt = optimizer(opt_name, ref.parameters())
    losses = []
    for step in range(steps):
        loss = sum(loss_of(ref, part) for r in range(world_size)
                   for part in batch(step, r).chunk(micro_batches)) / (world_size * micro_batches)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return ref, losses


def own_view(model: nn.Module, ref: nn.Module, ep_size: int, ep_rank: int, banks: set) -> dict:
    """Largest per-element error of each of this rank's parameters against the reference's
    (its experts' rows for a bank)."""
    want = dict(ref.named_parameters())
    out = {}
    for n, p in model.named_parameters():
        w = want[n].detach()
        if n in banks:
            w = w.chunk(ep_size, dim=0)[ep_rank]
        assert p.shape == w.shape, (n, tuple(p.shape), tuple(w.shape))
        out[n] = rel(p.detach(), w)
    return out


def parity_case(rank, world_size, name, stage, opt_name, ep_size, micro_batches=1):
    """Train `name` at `stage` with expert_parallel_size=`ep_size` for STEPS steps; per step
    the mean loss over the ranks, at the end every parameter, against the reference; and
    the all-to-alls the ledger counted."""
    ref, ref_losses = train_reference(name, opt_name, world_size, micro_batches=micro_batches)
    model = build(name)
    initial_banks = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n}
    cfg = zerodp.Config(stage=stage, expert_parallel_size=ep_size, grad_accumulation_steps=micro_batches)
    model, opt = zerodp.initialize(model, lambda ps: optimizer(opt_name, ps), cfg)
    ep = opt.expert_parallel
    banks = set(ep.splits)
    comm = opt.comm
    losses, a2a = [], []
    for step in range(STEPS):
        ids = batch(step, rank)
        total = torch.zeros(())
        for m in range(micro_batches):
            part = ids.chunk(micro_batches)[m]
            loss = loss_of(model, part) / micro_batches
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        records = comm.ledger.last_step
        a2a.append([(r.op, r.phase, r.axis, r.label, r.numel) for r in records if r.op == "all_to_all"])
        losses.append(float(comm.sum_scalar(total)) / world_size)
    ep_rank = comm.topology.ep_rank
    with zerodp.gathered_parameters(model):
        errors = own_view(model, ref, ep_size, ep_rank, banks)
        # What training moved the banks by, against the reference's: a gradient scaled wrong
        # (reduced over the wrong ranks) is off by O(1) here, however small the steps.
        want = {n: p.detach().chunk(ep_size, dim=0)[ep_rank] for n, p in ref.named_parameters() if n in banks}
        got = {n: p.detach().clone() for n, p in model.named_parameters() if n in banks}
    init = {n: initial_banks[n].chunk(ep_size, dim=0)[ep_rank] for n in banks}
    num = sum(float((got[n] - want[n]).double().pow(2).sum()) for n in banks)
    den = sum(float((want[n] - init[n]).double().pow(2).sum()) for n in banks)
    report = opt.memory_report()
    memory = {k: getattr(report, k) for k in ("expert_params", "expert_grads", "expert_master",
                                               "expert_optimizer_states", "expert_numel", "expert_world_size",
                                               "params", "optimizer_states", "stage")}
    memory["bank_numel"] = sum(p.numel() for n, p in build(name).named_parameters() if n in banks)
    return {"losses": losses, "ref_losses": ref_losses, "errors": errors, "a2a": a2a, "banks": sorted(banks),
            "memory": memory,
            "bank_update_rel": (num / den) ** 0.5,
            "ep_rank": comm.topology.ep_rank, "rank": comm.rank,
            "bank_shapes": {n: tuple(initial_banks[n].shape) for n in banks},
            "units": [u.name for u in opt.stage3.units] if opt.stage3 is not None else None}


def bf16_case(rank, world_size, name, stage):
    """bf16 compute: the same run without and with expert parallelism (zerodp both, the
    same stage and world), every step's loss and this rank's view of the parameters."""
    runs = {}
    for ep_size in (1, 2):
        model = build(name)
        cfg = zerodp.Config(stage=stage, expert_parallel_size=ep_size, mixed_precision="bf16")
        model, opt = zerodp.initialize(model, lambda ps: optimizer("sgd", ps), cfg)
        losses = []
        for step in range(STEPS):
            loss = loss_of(model, batch(step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(opt.comm.sum_scalar(loss.detach().float())) / world_size)
        ep_rank = opt.comm.topology.ep_rank
        with zerodp.gathered_parameters(model):
            params = {n: (p.detach().float().chunk(2, dim=0)[rank % 2] if ep_size == 1 and ".experts." in n
                          else p.detach().float()).clone() for n, p in model.named_parameters()}
        runs[ep_size] = (losses, params, ep_rank)
    (plain_losses, plain, _), (losses, split, ep_rank) = runs[1], runs[2]
    assert ep_rank == rank % 2
    return {"losses": losses, "plain_losses": plain_losses, "errors": {n: rel(split[n], plain[n]) for n in plain}}


# -- checkpoints across expert-parallel layouts ---------------------------------------------
SAVED_STEPS, SAVER_WORLD = 2, 4


def _train_steps(model, opt, world_size: int, rank: int, steps: range) -> list:
    """Steps of SAVER_WORLD's global batch at any world size: each rank runs its share of the
    saver's ranks' batches as micro-batches (each one's loss over their count), so the
    gradient is the saver's mean over its ranks whatever the layout (the load-balancing loss
    is computed per batch, as each saver rank computed it)."""
    per = SAVER_WORLD // world_size
    losses = []
    for step in steps:
        total = torch.zeros(())
        for m in range(per):
            loss = loss_of(model, batch(step, rank * per + m)) / per
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(float(opt.comm.sum_scalar(total)) / world_size if world_size > 1 else float(total))
    return losses


def save_case(rank, world_size, name, stage, ep_size, path):
    """Train SAVED_STEPS steps at this layout, save, then one step more: its loss is what any
    layout that loads the checkpoint must reach."""
    model = build(name)
    cfg = zerodp.Config(stage=stage, expert_parallel_size=ep_size)
    model, opt = zerodp.initialize(model, lambda ps: optimizer("sgd", ps), cfg)
    _train_steps(model, opt, world_size, rank, range(SAVED_STEPS))
    zerodp.save(path, model, opt)
    zerodp.save_pretrained(model, path + "-hf", opt)  # what from_pretrained reads
    # The whole model, each bank gathered over its expert-parallel group, against the reference.
    full = zerodp.full_state_dict(model, opt)
    ref, _ = train_reference(name, "sgd", SAVER_WORLD, steps=SAVED_STEPS)
    whole = {n: rel(full[n], p.detach()) for n, p in ref.named_parameters()}
    shapes = all(tuple(full[n].shape) == tuple(p.shape) for n, p in ref.named_parameters())
    # torch's own state dicts: the banks as DTensors of the whole bank's shape ([Note: row shards]).
    own = {n: v.full_tensor() if hasattr(v, "full_tensor") else v for n, v in model.state_dict().items()}
    own_vs_full = max(rel(own[n], full[n]) for n in full)
    return {"next_loss": _train_steps(model, opt, world_size, rank, range(SAVED_STEPS, SAVED_STEPS + 1))[0],
            "full_state": whole, "full_shapes": shapes, "own_vs_full": own_vs_full}


def load_case(rank, world_size, name, stage, ep_size, path):
    """Load at this layout (grad_accumulation_steps: the saver's batches as micro-batches);
    this rank's view of every parameter against the reference trained SAVED_STEPS steps,
    and the next step's loss."""
    model = build(name)
    per = SAVER_WORLD // world_size
    cfg = zerodp.Config(stage=stage, expert_parallel_size=ep_size, grad_accumulation_steps=per)
    model, opt = zerodp.initialize(model, lambda ps: optimizer("sgd", ps), cfg)
    zerodp.load(path, model, opt)
    ref, _ = train_reference(name, "sgd", SAVER_WORLD, steps=SAVED_STEPS)
    banks = set(opt.expert_parallel.splits) if opt.expert_parallel is not None else set()
    with zerodp.gathered_parameters(model):
        errors = own_view(model, ref, ep_size, opt.comm.topology.ep_rank, banks)
    next_loss = _train_steps(model, opt, world_size, rank, range(SAVED_STEPS, SAVED_STEPS + 1))[0]
    out = {"errors": errors, "next_loss": next_loss}
    if rank == 0:  # the checkpoint in one process, no process group: the model's own names and shapes
        full = zerodp.consolidate(path)
        want = dict(ref.named_parameters())
        out["consolidated"] = {n: rel(full[n], want[n].detach()) for n in want}
        out["consolidated_shapes"] = all(tuple(full[n].shape) == tuple(want[n].shape) for n in want)
        pretrained = dict(type(ref).from_pretrained(path + "-hf").named_parameters())
        out["from_pretrained"] = {n: rel(pretrained[n].detach(), want[n].detach()) for n in want}
    return out


# -- torch.distributed.checkpoint of torch's state dicts under expert parallelism ---------
def dcp_save_case(rank, world_size, stage, ep_size, path):
    """Train SAVED_STEPS steps at this layout, save `get_state_dict`'s model and optimizer
    state dicts through torch DCP, then two steps more: the losses a layout that loads
    them must reach (the second one moved by the restored momentum). Also the banks'
    placements and mesh, and every bank's DTensor whole against zerodp.full_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = build("mixtral")
    cfg = zerodp.Config(stage=stage, expert_parallel_size=ep_size)
    model, opt = zerodp.initialize(model, lambda ps: optimizer("sgd", ps), cfg)
    _train_steps(model, opt, world_size, rank, range(SAVED_STEPS))
    msd, osd = get_state_dict(model, opt)
    banks = sorted(opt.expert_parallel.splits)
    layout = {n: (tuple(msd[n].device_mesh.mesh_dim_names), str(msd[n].placements), tuple(msd[n].shape),
                  tuple(msd[n].to_local().shape)) for n in banks}
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    full = zerodp.full_state_dict(model, opt)
    whole = {n: rel(msd[n].full_tensor(), full[n]) for n in banks}
    return {"next": _train_steps(model, opt, world_size, rank, range(SAVED_STEPS, SAVED_STEPS + 2)),
            "layout": layout, "whole": whole}


def _perturbed() -> nn.Module:
    """The model with other weights than the saver's, so that a load that misses anything shows."""
    model = build("mixtral")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    return model


def dcp_load_case(rank, world_size, stage, ep_size, path):
    """`path` loaded through DCP into this layout's own state dicts (`get_state_dict`, then
    `set_state_dict`); this rank's view of every parameter against the reference trained
    SAVED_STEPS steps, and the next two losses. With world_size 1 and no ep_size: a plain
    torch model and SGD, no zerodp."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _perturbed()
    if ep_size:
        per = SAVER_WORLD // world_size
        cfg = zerodp.Config(stage=stage, expert_parallel_size=ep_size, grad_accumulation_steps=per)
        model, opt = zerodp.initialize(model, lambda ps: optimizer("sgd", ps), cfg)
    else:
        opt = optimizer("sgd", model.parameters())
    msd, osd = get_state_dict(model, opt)  # templates in this layout
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ref, _ = train_reference("mixtral", "sgd", SAVER_WORLD, steps=SAVED_STEPS)
    if ep_size:
        banks = set(opt.expert_parallel.splits)
        with zerodp.gathered_parameters(model):
            errors = own_view(model, ref, ep_size, opt.comm.topology.ep_rank, banks)
    else:
        errors = own_view(model, ref, 1, 0, set())
    return {"errors": errors, "next": _train_steps(model, opt, world_size, rank,
                                                   range(SAVED_STEPS, SAVED_STEPS + 2))}


# -- what is refused, with its reason -------------------------------------------------------
class NoPlan(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


def refusal_case(rank, world_size):
    """initialize's refusals under expert parallelism, raised on every rank: a model without
    a plan, a bank that does not split into the groups, a plan naming no module."""
    out = {}
    three = lambda: _with_experts(3)  # noqa: E731
    for key, builder, plan in (("no plan", NoPlan, None), ("indivisible", three, None),
                               ("unmatched", lambda: build("mixtral"), {"model.nothing.*": "ep_dispatch_experts"})):
        model = builder()
        if plan is not None:
            model.expert_parallel_plan = plan
        try:
            zerodp.initialize(model, torch.optim.SGD, zerodp.Config(stage=1, expert_parallel_size=2), lr=0.1)
            out[key] = None
        except Exception as e:  # noqa: BLE001 - the message is what the test reads
            out[key] = f"{type(e).__name__}: {e}"
    return out


def _with_experts(n: int) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                            num_local_experts=n, num_experts_per_tok=TOP_K))


def modify_case(rank, world_size, stage):
    """gathered_parameters(modify=True): rank r writes r + 1 everywhere; a bank keeps the value
    of the first rank that holds its experts (the broadcast runs over its expert-data-parallel
    ranks), every other parameter rank 0's."""
    model = build("mixtral")
    model, opt = zerodp.initialize(model, lambda ps: optimizer("sgd", ps),
                                   zerodp.Config(stage=stage, expert_parallel_size=2))
    with zerodp.gathered_parameters(model, modify=True, optimizer=opt):
        for p in model.parameters():
            p.data.fill_(rank + 1)
    with zerodp.gathered_parameters(model):
        values = {n: sorted(set(p.detach().reshape(-1).tolist())) for n, p in model.named_parameters()}
    return {"values": values, "banks": sorted(opt.expert_parallel.splits), "ep_rank": opt.comm.topology.ep_rank}


# -- a model of one's own: its plan, top-1 routing, one rank's experts idle -----------------
class Bank(nn.Module):
    """A fused bank of two-layer experts, called as HF's experts modules are."""

    def __init__(self, experts: int, hidden: int, inner: int):
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, inner, hidden) * 0.2)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, inner) * 0.2)

    def forward(self, x, top_k_index, top_k_weights):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                y = torch.relu(x[token] @ self.w1[e].t()) @ self.w2[e].t()
                out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class OwnMoE(nn.Module):
    """Top-1 routing over 4 experts, of which experts 2 and 3 are never chosen (their router
    logits masked): under EP=2 the rank holding them receives no token in any layer."""

    expert_parallel_plan = {"moe.*": "ep_dispatch_experts", "moe.*.w1": "grouped_gemm", "moe.*.w2": "grouped_gemm"}

    def __init__(self, hidden: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.routers = nn.ModuleList(nn.Linear(hidden, EXPERTS, bias=False) for _ in range(layers))
        self.moe = nn.ModuleList(Bank(EXPERTS, hidden, 2 * hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB)
        self.register_buffer("mask", torch.tensor([0.0, 0.0, -1e9, -1e9]))

    def forward(self, ids):
        x = self.embed(ids).reshape(-1, self.embed.embedding_dim)
        for router, bank in zip(self.routers, self.moe):
            probs = torch.softmax(router(x) + self.mask, dim=-1)
            weight, index = probs.topk(1, dim=-1)
            x = x + bank(x, index, weight)
        return nn.functional.cross_entropy(self.head(x), ids.reshape(-1))


def own_moe_case(rank, world_size, stage):
    torch.manual_seed(0)
    ref = OwnMoE()
    model = copy.deepcopy(ref)
    opt_ref = optimizer("sgd", ref.parameters())
    ref_losses = []
    for step in range(STEPS):
        loss = sum(ref(batch(step, r)) for r in range(world_size)) / world_size
        loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        ref_losses.append(float(loss.detach()))
    model, opt = zerodp.initialize(model, lambda ps: optimizer("sgd", ps),
                                   zerodp.Config(stage=stage, expert_parallel_size=2))
    losses, received = [], []
    for step in range(STEPS):
        loss = model(batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(opt.comm.sum_scalar(loss.detach())) / world_size)
        # What this rank's experts computed: the rows it sends back.
        received.append(sum(r.numel for r in opt.comm.ledger.last_step
                            if r.op == "all_to_all" and r.phase == "forward" and r.label.endswith("outputs")))
    ep_rank = opt.comm.topology.ep_rank
    with zerodp.gathered_parameters(model):
        errors = own_view(model, ref, 2, ep_rank, set(opt.expert_parallel.splits))
    return {"losses": losses, "ref_losses": ref_losses, "errors": errors, "received": received, "ep_rank": ep_rank}


# -- the Hugging Face Trainer ---------------------------------------------------------------
def trainer_case(rank, world_size, root, stage):
    """zerodp's Trainer with expert_parallel_size=2 against the plain transformers.Trainer
    under DDP: the same tiny Mixtral, data, SGD and clipping (above the norm); the losses and
    gradient norms the Trainers log at each step."""
    import os

    import transformers

    import hf_trainer_cases as hf
    from zerodp.integrations.hf import Trainer as ZeroTrainer

    hf._distributed_env(rank, world_size)
    out = {}
    for key, config in (("ddp", None), ("ep", zerodp.Config(stage=stage, expert_parallel_size=2))):
        args = hf.arguments(os.path.join(root, f"{key}-{stage}"))
        data = {"train_dataset": hf.Windows(hf.SAMPLES, seed=1)}
        model = _trainer_model()
        trainer = (transformers.Trainer(model=model, args=args, **data) if config is None
                   else ZeroTrainer(model=model, args=args, zerodp_config=config, **data))
        trainer.train()
        out[key] = hf.history(trainer)
    return out


def _trainer_model() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    import hf_trainer_cases as hf

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=hf.VOCAB, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                             num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                             max_position_embeddings=64, output_router_logits=True,
                                             router_aux_loss_coef=AUX))
    model.config._attn_implementation = "eager"
    return model
