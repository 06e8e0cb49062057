"""The state_dict protocol, run inside one spawned world per world size (test_state_dict.py).

World 2 trains, saves with torch.distributed.checkpoint (DCP) through `get_state_dict`,
trains on (the uninterrupted runs), and checks in-memory round trips, full state dicts
against torch DDP, save_pretrained and bad input; world 4 loads world 2's DCP checkpoints
at another stage and trains on. Cases return plain values; the tests assert on them.
"""
from __future__ import annotations

import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from checkpoint_cases import (LM, TRAIN, adamw_groups, config, error_of, fixed_batch, full_state, sgd,  # noqa: E402
                              sgd_continuation, train)
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,  # noqa: E402
                                                     get_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor  # noqa: E402

import zerodp  # noqa: E402

# (tag, stage saved at N=2, stage loaded at N=4, mixed precision, optimizer)
DCP_CASES = [("s3_to_s2", 3, 2, "fp32", adamw_groups), ("s1_to_s3", 1, 3, "fp32", adamw_groups),
             ("s2_to_s3_sgd", 2, 3, "fp32", sgd)]


def build(stage, precision="fp32", opt_fn=adamw_groups, seed=0):
    torch.manual_seed(seed)
    return zerodp.initialize(LM(), opt_fn, config(stage, mixed_precision=precision))


def dcp_save(model, opt, path):
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def dcp_load(model, opt, path):
    msd, osd = get_state_dict(model, opt)  # templates: this world's shapes and rows
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def kinds(sd: dict) -> dict:
    return {k: type(v).__name__ for k, v in sd.items()}


def describe_state_dicts(rank):
    """What each stage's state dicts hold: DTensors only where the state is sharded."""
    out = {}
    for stage in (0, 1, 3):
        model, opt = build(stage)
        train(model, opt, 1, fixed_batch)
        osd = opt.state_dict()
        first = osd["state"][0]
        out[stage] = {"model": kinds(model.state_dict()), "optim": {k: type(v).__name__ for k, v in first.items()},
                      "optim_keys": sorted(osd["state"]), "groups": [g["params"] for g in osd["param_groups"]],
                      "rows": {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()
                               if isinstance(v, DTensor)}}
    return out


def dcp_worlds_save(root, rank):
    """Train TRAIN steps, DCP-save, train TRAIN more: what the loaders at N=4 must reproduce."""
    out = {}
    for tag, stage, _, precision, opt_fn in DCP_CASES:
        model, opt = build(stage, precision, opt_fn)
        train(model, opt, TRAIN, fixed_batch)
        dcp_save(model, opt, os.path.join(root, tag))
        at_save = full_state(model)
        losses = train(model, opt, TRAIN, fixed_batch, first_step=TRAIN)
        out[tag] = {"at_save": at_save, "end": full_state(model), "losses": losses,
                    "sgd_end": sgd_continuation(at_save, stage) if opt_fn is adamw_groups else None}
    return out


def dcp_worlds_load(root, rank):
    out = {}
    for tag, _, stage, precision, opt_fn in DCP_CASES:
        model, opt = build(stage, precision, opt_fn, seed=123)  # everything must come from the checkpoint
        dcp_load(model, opt, os.path.join(root, tag))
        after_load = full_state(model)
        losses = train(model, opt, TRAIN, fixed_batch, first_step=TRAIN)
        out[tag] = {"after_load": after_load, "end": full_state(model), "losses": losses,
                    "sgd_end": sgd_continuation(after_load, stage) if opt_fn is adamw_groups else None}
    return out


def copied(sd):
    """A deep copy of a state dict (DTensors included): the source keeps training."""
    return copy.deepcopy(sd)


def memory_round_trips(rank):
    """state_dict() -> load_state_dict() into a fresh model at another stage (same N): the
    next steps equal the uninterrupted run's; bf16 restores the fp32 master exactly."""
    out = {}
    for tag, stage, other, precision in [("s3_to_s1", 3, 1, "fp32"), ("s2_to_s3_bf16", 2, 3, "bf16"),
                                         ("s3_to_s3_bf16", 3, 3, "bf16")]:
        model, opt = build(stage, precision)
        train(model, opt, TRAIN, fixed_batch)
        msd, osd = copied(model.state_dict()), copied(opt.state_dict())
        masters = {(s.name, s.start): s.master.clone() for s in opt.owned_slices()}
        end_losses = train(model, opt, TRAIN, fixed_batch, first_step=TRAIN)
        end = full_state(model)
        fresh, fopt = build(other, precision, seed=123)
        fresh.load_state_dict(msd)
        fopt.load_state_dict(osd)
        fresh_masters = {(s.name, s.start): s.master.clone() for s in fopt.owned_slices()}
        losses = train(fresh, fopt, TRAIN, fixed_batch, first_step=TRAIN)
        same_layout = stage == other
        out[tag] = {"end": end, "fresh_end": full_state(fresh), "losses": end_losses, "fresh_losses": losses,
                    "master_keys": [k for k in osd["state"][0] if k == "master"],
                    "masters_equal": same_layout and all(torch.equal(masters[k], v) for k, v in fresh_masters.items())}
    return out


def ddp_reference(rank, world_size):
    """torch DDP on the same model, optimizer and data: the full state dict to match."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    lm = LM()
    ddp = DDP(lm)
    opt = adamw_groups(p for p in ddp.parameters() if p.requires_grad)
    for step in range(TRAIN):
        x, y = fixed_batch(step, rank, world_size)
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in lm.state_dict().items()}


def full_state_dicts(rank, world_size):
    """zerodp's and torch's full state dicts at every stage, against DDP's model."""
    ref = ddp_reference(rank, world_size)
    out = {"ref": ref if rank == 0 else None}
    for stage in (0, 1, 2, 3):
        model, opt = build(stage)
        train(model, opt, TRAIN, fixed_batch)
        ours = zerodp.full_state_dict(model, opt, rank0_only=True)
        torchs = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        mine = zerodp.full_state_dict(model, opt)  # every rank
        out[stage] = {"ours": ours, "torch": torchs, "all_ranks_keys": sorted(mine),
                      "tied_shared": mine["gpt.lm_head.weight"] is mine["gpt.transformer.wte.weight"]}
    return out


def bad_inputs(rank):
    """Each wrong state dict raises, naming what is wrong, and changes nothing."""
    model, opt = build(3)
    train(model, opt, 1, fixed_batch)
    before = full_state(model)
    good_m, good_o = copied(model.state_dict()), copied(opt.state_dict())
    wrong_shape = {k: (torch.zeros(3, 3) if k == "gpt.transformer.h.0.mlp.c_fc.weight" else v)
                   for k, v in good_m.items()}
    fewer_groups = {"state": good_o["state"], "param_groups": good_o["param_groups"][:1]}
    no_state = {"state": {k: {kk: vv for kk, vv in v.items() if kk != "exp_avg"} for k, v in good_o["state"].items()},
                "param_groups": good_o["param_groups"]}
    plain = LM()
    out = {"wrong_shape": error_of(lambda: model.load_state_dict(wrong_shape)),
           "fewer_groups": error_of(lambda: opt.load_state_dict(fewer_groups)),
           "missing_state": error_of(lambda: opt.load_state_dict(no_state)),
           "not_a_dict": error_of(lambda: opt.load_state_dict([1, 2])),
           # A sharded state dict into a plain model: torch refuses to mix DTensor and Tensor.
           "into_plain_model": error_of(lambda: plain.load_state_dict(good_m))}
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in full_state(model).items())
    return out


def hf_save_pretrained(root, rank):
    """save_pretrained -> from_pretrained into a plain model equals the gathered
    parameters: tied GPT-2 and untied Llama, stages 2 and 3."""
    from hf_cases import gpt2, llama
    from transformers import AutoModelForCausalLM

    out = {}
    for name, make in (("gpt2", gpt2), ("llama", llama)):
        for stage in (2, 3):
            torch.manual_seed(0)
            model, opt = zerodp.initialize(make(), torch.optim.AdamW, zerodp.Config(stage=stage), lr=1e-2)
            ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
            for _ in range(2):
                opt.backward(model(input_ids=ids, labels=ids).loss)
                opt.step()
                opt.zero_grad()
            path = os.path.join(root, f"{name}_s{stage}")
            zerodp.save_pretrained(model, path, opt)
            with zerodp.gathered_parameters(model):
                gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
            case = {"files": sorted(os.listdir(path))}
            if stage == 3:  # and back into a model born sharded: no rank ever holds it whole
                from transformers import AutoConfig

                born_cfg = zerodp.Config(stage=3)
                torch.manual_seed(0)
                with zerodp.init(born_cfg):
                    born = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
                born, born_opt = zerodp.initialize(born, torch.optim.AdamW, born_cfg, lr=1e-2)
                zerodp.load_pretrained(born, os.path.join(path, "model.safetensors"), born_opt)
                with torch.no_grad():
                    case["born_logits"] = born(input_ids=ids).logits
            if rank == 0:
                plain = AutoModelForCausalLM.from_pretrained(path)
                with torch.no_grad():
                    case["plain_logits"] = plain(input_ids=ids).logits
                loaded = dict(plain.named_parameters())
                case["equal"] = all(torch.equal(loaded[n], v) for n, v in gathered.items())
                case["names"] = sorted(loaded) == sorted(gathered)
                case["tied"] = plain.get_output_embeddings().weight is plain.get_input_embeddings().weight
            out[f"{name}_s{stage}"] = case
    return out


class Odd(torch.nn.Module):
    """What trips a state dict: a 0-d parameter first on the root (its states are 0-d too),
    a (1, 5) one (fewer rows than ranks), a tied pair, a frozen one, two param groups
    sharing every unit."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.7))
        self.small = torch.nn.Parameter(torch.randn(1, 5))
        self.emb = torch.nn.Embedding(11, 5)
        self.lin = torch.nn.Linear(5, 5)
        self.head = torch.nn.Linear(5, 11, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)

    def forward(self, idx):
        h = self.lin(self.emb(idx) * self.scale + self.small + self.frozen)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1).float(), idx.flatten())


def odd_groups(params):
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim == 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=3e-2)


def odd_run(stage, precision, steps, model=None, opt=None, first=0, seed=0):
    if model is None:
        torch.manual_seed(seed)
        # fp16: the scale grows every 2 clean steps, so a lost scaler state would show.
        cfg = zerodp.Config(stage=stage, mixed_precision=precision, **({"unit_min_params": 1} if stage == 3 else {}),
                            **({"loss_scale_growth_interval": 2} if precision == "fp16" else {}))
        model, opt = zerodp.initialize(Odd(), odd_groups, cfg)
    losses = []
    for step in range(first, first + steps):
        idx = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(100 * step + opt.comm.rank))
        loss = model(idx)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return model, opt, losses


def masters_of(opt):
    return {(s.name, s.start): s.master.clone() for s in opt.owned_slices()}


def hard_cases(root, rank):
    """The cases a review found: each once wrong, each now exact."""
    out = {}
    for stage, precision in [(3, "bf16"), (3, "fp16"), (1, "bf16"), (3, "fp32")]:
        tag = f"s{stage}_{precision}"
        model, opt, _ = odd_run(stage, precision, 3)
        path = os.path.join(root, f"odd_{tag}")
        dcp_save(model, opt, path)
        saved_masters, saved_scale = masters_of(opt), opt.scaler.scale
        _, _, straight = odd_run(stage, precision, 3, model, opt, first=3)
        # torch's set_state_dict loads the optimizer first, then the model.
        fresh, fopt, _ = odd_run(stage, precision, 0, seed=5)
        dcp_load(fresh, fopt, path)
        loaded_masters = masters_of(fopt)
        out[tag] = {"masters_exact": loaded_masters.keys() == saved_masters.keys() and
                    all(torch.equal(v, saved_masters[k]) for k, v in loaded_masters.items()),
                    "scale": (saved_scale, fopt.scaler.scale),
                    "resumed": odd_run(stage, precision, 3, fresh, fopt, first=3)[2], "straight": straight}
    # DCP into stage 1 (where torch's own state probe never steps): the states arrive.
    model, opt, _ = odd_run(3, "fp32", 3)
    dcp_save(model, opt, os.path.join(root, "odd_to_s1"))
    _, _, straight = odd_run(3, "fp32", 2, model, opt, first=3)
    s1, s1opt, _ = odd_run(1, "fp32", 0, seed=5)
    dcp_load(s1, s1opt, os.path.join(root, "odd_to_s1"))
    out["to_stage1"] = {"steps": [g.get("step") for g in s1opt.scalar_states()],
                        "resumed": odd_run(1, "fp32", 2, s1, s1opt, first=3)[2], "straight": straight}
    # A never-stepped bf16 optimizer's state dict loads.
    fresh, fopt, _ = odd_run(3, "bf16", 0)
    sd = copied(fopt.state_dict())
    other, oopt, _ = odd_run(3, "bf16", 0, seed=5)
    out["never_stepped"] = error_of(lambda: oopt.load_state_dict(sd))
    # A scheduler built before initialize would drive the wrapped optimizer: refused.
    lm = LM()
    plain = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 0.5)
    out["scheduler_first"] = error_of(lambda: zerodp.initialize(lm, lambda params: plain, config(2)))
    return out


def world_two(rank, world_size, root):
    return {"describe": describe_state_dicts(rank), "dcp": dcp_worlds_save(root, rank),
            "memory": memory_round_trips(rank), "full": full_state_dicts(rank, world_size),
            "bad": bad_inputs(rank), "pretrained": hf_save_pretrained(root, rank), "hard": hard_cases(root, rank)}


def world_four(rank, world_size, root):
    out = {"dcp": dcp_worlds_load(root, rank)}
    dist.barrier()
    return out
