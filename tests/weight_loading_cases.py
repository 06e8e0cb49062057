"""The weight-loading contract, run inside one spawned world per world size
(test_weight_loading.py reads the results): every way weights come in updates what it must
(the parameters, the fp32 master, never the optimizer's states) at every stage, precision
and placement, as the same load does to torch DDP; state dicts settle a delayed update
first; a state dict asked for before the first step creates nothing.

[Note: exact arithmetic]
`Net` is linear in its input and in each layer's parameters and its loss is the sum of its
outputs. Its inputs are integers in {-1, 0, 1}, and every weight it computes a gradient at
is a multiple of 2^-12 in [-1/2, 1/2] (loaded or initial: the steps checked against DDP run
from loaded weights). A hidden value h = a(x) + b(x) is then a multiple of 2^-12 with
|h| <= 2 (8 x 1/2 + 1/2) = 9, and each gradient element a sum over the 4 rows of the global
batch of such products, averaged over N = 2 or 4 ranks: a multiple of 2^-12/N of size at
most 36/N, i.e. fewer than 2^18 steps of its grid. SGD with momentum 1 keeps its buffer a
plain sum of at most 11 gradients (< 2^19 steps of the same grid), and an update
W - 2^-4 x buffer lies on the grid 2^-16/N within 2^19 + 2^17 steps: 20 bits. All of it fits
in fp32's 24-bit significand, so each result is exact whatever the order of the sums, the
blocking of the matrix products or a fused multiply-add: in fp32 zerodp and DDP must agree
bit for bit on any CPU. (A momentum below 1 would halve the grid at every step.) The same
weights do not fit in bf16's 8 bits: under bf16 the loaded fp32 values must reach the
master unrounded, while the parameters hold their bf16 rounding.
"""
from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import zerodp

LR = 2.0 ** -4  # exact steps: [Note: exact arithmetic]


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the tests assert on what was raised
        return f"{type(e).__name__}: {e}"
    return None


class Pair(nn.Module):
    """Two layers side by side: at stage 3 one unit, so a load of `body.b` fills part of it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) + self.b(x)


class Net(nn.Module):
    """[Note: exact arithmetic]. The head's parameters live in the root's unit at stage 3."""

    def __init__(self):
        super().__init__()
        self.body = Pair()
        self.head = nn.Linear(8, 4)

    def forward(self, x, body_only: bool = False):
        h = self.body(x.to(self.head.weight.dtype))
        return (h if body_only else self.head(h)).float().sum()


SHAPES = {k: tuple(v.shape) for k, v in Net().state_dict().items()}


def fine_weights(seed: int) -> dict[str, torch.Tensor]:
    """Multiples of 2^-12 in [-1/2, 1/2], most needing more than bf16's 8 significant bits."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randint(-2048, 2049, s, generator=g).float() / 4096 for k, s in SHAPES.items()}


def under(prefix: str, weights: dict) -> dict:
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    """A global batch of 4 rows of integers in {-1, 0, 1}, split across the ranks."""
    x = torch.randint(-1, 2, (4, 8), generator=torch.Generator().manual_seed(1000 + step)).float()
    return x[rank * 4 // world_size: (rank + 1) * 4 // world_size]


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=1.0)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


# (stage, precision, placement): every stage with the optimizer beside the parameters;
# stages 1-3 also with it on the host, and with the host's delayed update; one on disk.
CONFIGS = ([(s, p, "device") for s in (0, 1, 2, 3) for p in ("fp32", "bf16")]
           + [(s, p, "host") for s in (1, 2, 3) for p in ("fp32", "bf16")]
           + [(s, "fp32", "delayed") for s in (1, 2, 3)] + [(2, "bf16", "disk")])


def zconfig(stage: int, precision: str, placement: str, offload_dir: str = None, **kw) -> zerodp.Config:
    offload = {"device": "none", "delayed": "host"}.get(placement, placement)
    return zerodp.Config(stage=stage, mixed_precision=precision, offload_optimizer=offload,
                         delayed_update_after=0 if placement == "delayed" else None,
                         offload_dir=offload_dir if placement == "disk" else None,
                         bucket_bytes=128, unit_modules=(Pair,) if stage == 3 else (), **kw)


class Runs:
    """A zerodp model and the DDP model it must match, from the same initial weights, stepped
    on the same batches."""

    def __init__(self, cfg: zerodp.Config, w0: dict, opt_fn=sgd, **ddp_kwargs):
        net = Net()
        net.load_state_dict(w0)  # before initialize: the master starts from these exact values
        self.z, self.zopt = zerodp.initialize(net, opt_fn, cfg)
        ref = Net()
        ref.load_state_dict(w0)
        self.d = DDP(ref, **ddp_kwargs)
        self.dopt = opt_fn(self.d.parameters())
        self.dtype = cfg.compute_dtype
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def step(self, k: int, lr: float) -> None:
        for opt in (self.zopt, self.dopt):
            for g in opt.param_groups:
                g["lr"] = lr
        x = batch(k, self.rank, self.world_size)
        self.zopt.backward(self.z(x))
        self.zopt.step()
        self.zopt.zero_grad()
        self.d(x).backward()
        self.dopt.step()
        self.dopt.zero_grad()

    def ddp_params(self) -> dict:
        return {k: v.detach().clone() for k, v in self.d.module.named_parameters()}

    def ddp_states(self) -> dict:
        return {n: {k: v.clone() for k, v in self.dopt.state.get(p, {}).items() if torch.is_tensor(v) and v.dim()}
                for n, p in self.d.module.named_parameters()}

    def owned(self) -> dict:
        """(name, start) -> (master, {state: value}) of what this rank owns, as copies."""
        return {(s.name, s.start): (s.master.detach().clone(), {k: v.clone() for k, v in s.states.items()})
                for s in self.zopt.owned_slices() if s.numel}


def _max(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def compare(pair: Runs, states_ref: dict | None, with_ddp_states: bool) -> dict:
    """Largest differences, each to be 0: the zerodp parameters against DDP's (in the compute
    dtype), the master against DDP's fp32 parameters, the optimizer's states against
    `states_ref` (this rank's own, before) and, when `with_ddp_states`, against DDP's."""
    full = zerodp.full_state_dict(pair.z, pair.zopt)  # settles a delayed update first
    ref = pair.ddp_params()
    out = {"params": max(_max(full[k], ref[k].to(pair.dtype)) for k in ref)}
    owned, ddp_states = pair.owned(), pair.ddp_states()
    master = states = ddp = 0.0
    for (name, start), (m, st) in owned.items():
        n = m.numel()
        master = max(master, _max(m, ref[name].reshape(-1)[start: start + n]))
        if states_ref is not None:
            before = states_ref[(name, start)][1]
            states = max([states] + [_max(v, before.get(k, torch.empty(0))) for k, v in st.items()]
                         + [float("inf") for k in before if k not in st])
        if with_ddp_states:
            ddp = max([ddp] + [_max(v, ddp_states[name][k].reshape(-1)[start: start + n]) for k, v in st.items()])
    out["master"] = master
    if states_ref is not None:
        out["states"] = states
    if with_ddp_states:
        out["ddp_states"] = ddp
    return out


# -- the entry points: each loads into the zerodp model and does the same to DDP -------------
def load_root(pair, ctx):
    w = fine_weights(ctx["seed"])
    pair.z.load_state_dict(w)
    pair.d.module.load_state_dict(w)


def load_head(pair, ctx):
    w = under("head.", fine_weights(ctx["seed"]))
    pair.z.head.load_state_dict(w)
    pair.d.module.head.load_state_dict(w)


def load_part_of_unit(pair, ctx):
    w = under("body.b.", fine_weights(ctx["seed"]))
    pair.z.body.b.load_state_dict(w)
    pair.d.module.body.b.load_state_dict(w)


def dcp_set_model(pair, ctx):
    w = fine_weights(ctx["seed"])
    set_model_state_dict(pair.z, w)
    pair.d.module.load_state_dict(w)


def dcp_set_model_full(pair, ctx):
    w = fine_weights(ctx["seed"])
    set_model_state_dict(pair.z, w, options=StateDictOptions(full_state_dict=True))
    pair.d.module.load_state_dict(w)


def dcp_rows_from_fp32(pair, ctx):
    """A sharded (DTensor) state dict of an fp32 stage-3 model: rows of fp32 values."""
    set_model_state_dict(pair.z, copy.deepcopy(ctx["rows"]))
    pair.d.module.load_state_dict(ctx["rows_full"])


def dcp_set_state_dict(pair, ctx):
    """Back to the snapshot taken after the first step (weights and optimizer states), after
    a step that moved both."""
    pair.step(50, LR)
    msd, osd = copy.deepcopy(ctx["snap"])
    set_state_dict(pair.z, pair.zopt, model_state_dict=msd, optim_state_dict=osd)
    dmsd, dosd = copy.deepcopy(ctx["ddp_snap"])
    set_state_dict(pair.d, pair.dopt, model_state_dict=dmsd, optim_state_dict=dosd)


def pretrained(pair, ctx):
    w = fine_weights(ctx["seed"])
    zerodp.load_pretrained(pair.z, w, pair.zopt)
    pair.d.module.load_state_dict(w)


def modify_in_place(pair, ctx):
    """Edited inside gathered_parameters(modify=True): in the compute dtype, so DDP gets the
    rounded values."""
    w = under("head.", fine_weights(ctx["seed"]))
    with zerodp.gathered_parameters(pair.z.head, modify=True, optimizer=pair.zopt), torch.no_grad():
        for n, p in pair.z.head.named_parameters():
            p.copy_(w[n])
    with torch.no_grad():
        for n, p in pair.d.module.head.named_parameters():
            p.copy_(w[n].to(pair.dtype))


ENTRY_POINTS = {"model.load_state_dict": load_root, "model.head.load_state_dict": load_head,
                "model.body.b.load_state_dict": load_part_of_unit, "set_model_state_dict": dcp_set_model,
                "set_model_state_dict(full)": dcp_set_model_full, "set_model_state_dict(fp32 rows)": dcp_rows_from_fp32,
                "set_state_dict": dcp_set_state_dict, "load_pretrained": pretrained,
                "gathered_parameters(modify=True)": modify_in_place}


def shared_tmp(rank: int) -> str:
    root = [tempfile.mkdtemp(prefix="zerodp-wl-") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    return root[0]


def rows_source(rank: int) -> tuple[dict, dict]:
    """An fp32 stage-3 model's sharded state dict (DTensors) and the full weights it holds."""
    w = fine_weights(7)
    net = Net()
    net.load_state_dict(w)
    model, _ = zerodp.initialize(net, sgd, zconfig(3, "fp32", "device"))
    return copy.deepcopy(get_model_state_dict(model)), w


def contract_grid(rank: int, world_size: int, configs=CONFIGS, entries=ENTRY_POINTS) -> dict:
    """For each config, one pair of runs, stepped once at lr 0 (the optimizer's states exist,
    the weights stay on the grid); then for each entry point: fresh weights on the grid
    (through load_pretrained, into both), the load, then in fp32 a step at lr 2^-4, which
    must equal DDP's bit for bit, in bf16 a step at lr 0, which must keep what the load
    wrote (a stale master would be written back over it)."""
    root = shared_tmp(rank)
    rows, rows_full = rows_source(rank)
    out = {}
    for ci, (stage, precision, placement) in enumerate(configs):
        offload_dir = os.path.join(root, str(ci))
        os.makedirs(offload_dir, exist_ok=True)
        pair = Runs(zconfig(stage, precision, placement, offload_dir), fine_weights(0))
        pair.step(0, 0.0)
        ctx = {"rows": rows, "rows_full": rows_full, "snap": copy.deepcopy(get_state_dict(pair.z, pair.zopt)),
               "ddp_snap": copy.deepcopy(get_state_dict(pair.d, pair.dopt))}
        snap_owned = pair.owned()
        fp32 = precision == "fp32"
        for ei, (entry, load) in enumerate(entries.items()):
            fresh = fine_weights(200 + ei)
            zerodp.load_pretrained(pair.z, fresh, pair.zopt)
            pair.d.module.load_state_dict(fresh)
            ctx["seed"] = 100 + ei
            before = pair.owned()
            err = error_of(lambda: load(pair, ctx))
            key = (stage, precision, placement, entry)
            if err is not None:
                out[key] = {"error": err}
                continue
            # Every entry point leaves the optimizer's states as they were; set_state_dict
            # restores the snapshot's.
            res = {"load": compare(pair, snap_owned if entry == "set_state_dict" else before, fp32)}
            pair.step(1 + ei, LR if fp32 else 0.0)
            res["step" if fp32 else "lr0"] = compare(pair, None, fp32)
            out[key] = res
    return out


# -- item 6: state dicts settle a delayed update first -----------------------------------
def _full(sd: dict, prefix: str = "") -> dict:
    return {prefix + k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().clone()
            for k, v in sd.items()}


STATE_DICT_READS = {
    "model.state_dict()": lambda z, opt: _full(z.state_dict()),
    "model.head.state_dict()": lambda z, opt: _full(z.head.state_dict(), "head."),
    "model.body.b.state_dict()": lambda z, opt: _full(z.body.b.state_dict(), "body.b."),
    "get_model_state_dict": lambda z, opt: _full(get_model_state_dict(z)),
    "get_model_state_dict(full)": lambda z, opt: _full(get_model_state_dict(
        z, options=StateDictOptions(full_state_dict=True))),
    "get_state_dict": lambda z, opt: _full(get_state_dict(z, opt)[0]),
    "zerodp.full_state_dict": lambda z, opt: _full(zerodp.full_state_dict(z, opt)),
}


def delayed_state_dicts(rank: int, world_size: int) -> dict:
    """After a step whose update is still in flight, each way of reading the weights returns
    the updated ones (what they hold once settled)."""
    out = {}
    for stage in (1, 2, 3):
        pair = Runs(zconfig(stage, "fp32", "delayed"), fine_weights(0))
        for k, (name, read) in enumerate(STATE_DICT_READS.items()):
            pair.step(k, LR)
            if not pair.zopt.stepper.pending:
                out[(stage, name)] = "no update in flight"
                continue
            got = {}
            err = error_of(lambda: got.update(read(pair.z, pair.zopt)))
            pair.zopt.settle()
            true = _full(zerodp.full_state_dict(pair.z, pair.zopt))
            out[(stage, name)] = err or max(_max(v, true[k2]) for k2, v in got.items())
    return out


# -- item 7: a state dict before the first step creates nothing -------------------------
def _state_keys(opt) -> list:
    return sorted({k for entry in opt.state_dict()["state"].values() for k in entry})


def before_first_step(rank: int, world_size: int) -> dict:
    out = {}
    w0 = fine_weights(0)
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            asked = Runs(zconfig(stage, precision, "device"), w0, adam)
            sd = copy.deepcopy(asked.zopt.state_dict())
            keys = sorted({k for entry in sd["state"].values() for k in entry})
            plain = Runs(zconfig(stage, precision, "device"), w0, adam)
            for k in range(3):
                asked.step(k, 1e-2)
                plain.step(k, 1e-2)
            a, b = zerodp.full_state_dict(asked.z, asked.zopt), zerodp.full_state_dict(plain.z, plain.zopt)
            case = {"keys": keys, "training_changed": max(_max(a[k], b[k]) for k in a)}
            # Loaded into a stepped optimizer, it leaves no state (torch: its state becomes the
            # dict's, empty), and the next step is a first step again.
            plain.zopt.load_state_dict(copy.deepcopy(sd))
            plain.dopt.load_state_dict(adam(Net().parameters()).state_dict())
            case["keys_after_load"] = _state_keys(plain.zopt)
            plain.step(3, 1e-2)
            case["step_after_load"] = [g.get("step") for g in plain.zopt.scalar_states()]
            case["ddp_step_after_load"] = sorted({float(s["step"]) for s in plain.dopt.state.values()})
            out[(stage, precision)] = case
    return out


def dcp_probe(rank: int, world_size: int, stages=(2, 3)) -> dict:
    """torch's get_state_dict on a never-stepped optimizer steps it once at lr 0 (torch's
    `_init_optim_state`): on DDP that creates states with step 1, and so must it here, also
    after model.zero_grad() or optimizer.zero_grad() (a resume script clears before it loads)."""
    out = {}
    for stage in stages:
        for clearing in ("none", "model", "optimizer"):
            pair = Runs(zconfig(stage, "fp32", "device"), fine_weights(0), adam)
            if clearing == "model":
                pair.z.zero_grad()
                pair.d.zero_grad()
            elif clearing == "optimizer":
                pair.zopt.zero_grad()
                pair.dopt.zero_grad()
            err = error_of(lambda: (get_state_dict(pair.z, pair.zopt), get_state_dict(pair.d, pair.dopt)))
            out[(stage, clearing)] = err or {
                "steps": [g.get("step") for g in pair.zopt.scalar_states()],
                "ddp_steps": sorted({float(s["step"]) for s in pair.dopt.state.values()})}
    return out


def _steps(sd: dict) -> dict:
    """Parameter number -> its step count (None: no state), of a torch optimizer state dict."""
    return {i: float(entry["step"]) if "step" in entry else None for i, entry in sd["state"].items()}


def unused_parameter(rank: int, world_size: int) -> dict:
    """A step that does not reach the head leaves it without states, as on DDP; a state
    dict then holds none for it, and loading one leaves it without states again."""
    out = {}
    for stage in (0, 1, 2, 3):
        case: dict = {}
        out[stage] = error_of(lambda: _unused_parameter(stage, rank, world_size, case)) or case
    return out


def _unused_parameter(stage: int, rank: int, world_size: int, case: dict) -> None:
    pair = Runs(zconfig(stage, "fp32", "device"), fine_weights(0), adam, find_unused_parameters=True)
    x = batch(0, rank, world_size)
    pair.zopt.backward(pair.z.body(x).sum())
    pair.zopt.step()
    pair.zopt.zero_grad()
    pair.d(x, body_only=True).backward()
    pair.dopt.step()
    pair.dopt.zero_grad()
    case["first"] = (_steps(pair.zopt.state_dict()), _steps(pair.dopt.state_dict()))
    after_first, ddp_after_first = copy.deepcopy(pair.zopt.state_dict()), copy.deepcopy(pair.dopt.state_dict())
    pair.step(1, 1e-2)
    case["second"] = (_steps(pair.zopt.state_dict()), _steps(pair.dopt.state_dict()))
    pair.zopt.load_state_dict(after_first)
    pair.dopt.load_state_dict(ddp_after_first)
    pair.step(2, 1e-2)
    case["reloaded"] = (_steps(pair.zopt.state_dict()), _steps(pair.dopt.state_dict()))


# -- gradient buffers: a load inside an accumulation window leaves the gradients alone ------
def load_mid_window(rank: int, world_size: int) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        for entry in ("model.load_state_dict", "model.head.load_state_dict"):
            pair = Runs(zconfig(stage, "fp32", "device", grad_accumulation_steps=2), fine_weights(0))
            x1, x2 = batch(0, rank, world_size), batch(1, rank, world_size)
            pair.zopt.backward(pair.z(x1))
            with pair.d.no_sync():
                (pair.d(x1) / 2).backward()  # zerodp's backward divides by the 2 micro-batches
            err = error_of(lambda: ENTRY_POINTS[entry](pair, {"seed": 5}))
            if err is not None:
                out[(stage, entry)] = err
                continue
            pair.zopt.backward(pair.z(x2))
            (pair.d(x2) / 2).backward()
            pair.zopt.step()
            pair.dopt.step()
            out[(stage, entry)] = compare(pair, None, True)
    return out


# -- refused: a load that would detach the parameters from zerodp's storage ------------------
def refusals(rank: int, world_size: int) -> dict:
    out = {}
    for stage in (0, 3):
        pair = Runs(zconfig(stage, "fp32", "device"), fine_weights(0))
        before, params = zerodp.full_state_dict(pair.z, pair.zopt), list(pair.z.parameters())
        err = error_of(lambda: pair.z.load_state_dict(fine_weights(9), assign=True))
        after = zerodp.full_state_dict(pair.z, pair.zopt)
        out[stage] = {"error": err, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
                      "same_parameters": all(a is b for a, b in zip(params, pair.z.parameters()))}
    return out


def world_two(rank: int, world_size: int) -> dict:
    return {"grid": contract_grid(rank, world_size), "delayed": delayed_state_dicts(rank, world_size),
            "before_first_step": before_first_step(rank, world_size), "probe": dcp_probe(rank, world_size),
            "probe01": dcp_probe(rank, world_size, stages=(0, 1)), "mid_window": load_mid_window(rank, world_size),
            "unused": unused_parameter(rank, world_size),
            "refusals": refusals(rank, world_size)}


def world_four(rank: int, world_size: int) -> dict:
    """Parameters cut into four ranks' rows and pieces: stages 2-3, fp32 and bf16, beside and on the host."""
    configs = [(2, "bf16", "device"), (3, "fp32", "device"), (3, "bf16", "host")]
    return {"grid": contract_grid(rank, world_size, configs)}
