"""Edge cases of tensor parallelism with ZeRO, at world size 4 (DP x TP = 2 x 2), a case per test
in the session's world of 4 (test_tensor_parallel_edges.py): clipping with the inf-, 2- and 1-norm against
torch's clip_grad_norm_ on one process; a nan/inf on one tensor-parallel rank skipping the
step everywhere (fp32 under nonfinite_grads="skip", and fp16); Pa and Pa+cpu for layers that
take two tensor inputs, checkpointed through a model-level `_gradient_checkpointing_func`,
with dropout in the replicated region; an in-place change to a checkpointed input; dropout in
the split region and the input check (tp_region_cases.py).

Every rank builds its model from a seed of its own: initialize must start all of them from
rank 0's weights (and tensor-parallel rank 0's random state)."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import zerodp
from tp_slices import error_of, expected_slice
from tp_slices import max_diff_to_reference as max_diff
from zerodp.demo.models import GPT, GPTConfig

DP, TP = 2, 2
LR = 0.5  # plain SGD: every element's update is lr x its (clipped) gradient, so a wrong scale shows
STEPS = 2

# The bundled GPT: clipping and the non-finite cases.
BATCH, SEQ, VOCAB = 2, 16, 64  # per data-parallel rank
GPT_CFG = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)
# Below every norm of this model's gradient (2-norm ~1.5, inf-norm ~0.15-0.26, 1-norm ~104), so each clips.
MAX_NORM = 0.05
NORMS = {"2": 2.0, "inf": float("inf"), "1": 1.0}
# (norm, stage); the 1-norm at stage 3 only: its fault is not the stage's.
CLIP_CASES = (("2", 0), ("2", 3), ("inf", 0), ("inf", 3), ("1", 3))
# The split weight whose gradient is poisoned on tensor-parallel rank 1 only.
POISONED = "transformer.h.1.mlp.c_fc.weight"
# (stage, how, clip) of the fp32 non-finite cases: see nonfinite_run.
NONFINITE = tuple((0, how, clip) for how, clip in (("loss", None), ("grad", None), ("grad", 2.0),
                                                   ("grad", float("inf")), ("grad_inf", float("inf")))) + (
    (3, "loss", None), (3, "grad", None), (3, "grad", 2.0), (3, "grad_inf", float("inf")))

# The two-input model: odd sizes, so Pa's slices are padded (105 = 3 x 5 x 7 elements per
# layer input, 35 in the gate: ceil(105 / 2) = 53 and ceil(35 / 2) = 18 kept per rank).
TWO_BATCH, TWO_SEQ, TWO_HIDDEN, TWO_INNER, TWO_LAYERS, TWO_VOCAB = 3, 5, 7, 8, 2, 16
DROPOUT = 0.2
PA = {"none": {}, "pa": {"partition_activations": True},
      "pa_cpu": {"partition_activations": True, "activations_on_host": True}}


def local_params(model) -> dict:
    with zerodp.gathered_parameters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def slice_of(name: str, full: torch.Tensor, local: torch.Tensor, tp_rank: int) -> torch.Tensor:
    return expected_slice(name, full, local, tp_rank, TP)


def max_diff_to_reference(result: dict, ref: dict, tp_rank: int) -> float:
    return max_diff(result, ref, tp_rank, TP)


# -- the bundled GPT ----------------------------------------------------------------------
def gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPT_CFG)
    model.gradient_checkpointing_enable()
    return model.train()


def gpt_batch(step: int, dp_rank=None) -> torch.Tensor:
    """The global batch of `step`, or data-parallel rank `dp_rank`'s slice of it."""
    ids = torch.randint(0, VOCAB, (DP * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(2000 + step))
    return ids if dp_rank is None else ids[dp_rank * BATCH:(dp_rank + 1) * BATCH]


def gpt_loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[:, :-1], ids[:, 1:])[1]


def gpt_zero(rank: int, stage: int, **fields):
    cfg = zerodp.Config(stage=stage, tensor_parallel_size=TP, **({"unit_min_params": 1000} if stage == 3 else {}),
                        **fields)
    return zerodp.initialize(gpt(seed=rank), torch.optim.SGD, cfg, lr=LR)


def grad_max(model: nn.Module) -> float:
    return max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)


# One process's runs on the global batch, kept by the process that computed them (rank 0 of the
# session's world of 4, which lives as long as the session): several tests compare with each.
_REFERENCES: dict = {}


def memoized(key, compute):
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return _REFERENCES[key]


def clip_reference(norm_type: float) -> dict:
    """One process, the global batch, torch's clip_grad_norm_ and SGD; each step's largest
    clipped gradient element, which the rounding bounds are computed from, and each step's
    parameters ("steps"). Once per process for each norm."""
    return memoized(("clip", norm_type), lambda: _clip_reference(norm_type))


def _clip_reference(norm_type: float) -> dict:
    model = gpt(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms, largest, steps = [], [], []
    for step in range(STEPS):
        gpt_loss(model, gpt_batch(step)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=norm_type)))
        largest.append(grad_max(model))
        opt.step()
        opt.zero_grad()
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"norms": norms, "params": steps[-1], "steps": steps,
            "grad_max": largest, "numel": sum(p.numel() for p in model.parameters())}


def clip_run(rank: int, stage: int, norm_type: float) -> dict:
    model, opt = gpt_zero(rank, stage)
    norms, steps = [], []
    for step in range(STEPS):
        opt.backward(gpt_loss(model, gpt_batch(step, opt.comm.rank)))
        norms.append(float(opt.clip_grad_norm_(MAX_NORM, norm_type=norm_type)))
        opt.step()
        opt.zero_grad()
        steps.append(local_params(model))
    return {"norms": norms, "params": steps[-1], "steps": steps, "dp_rank": opt.comm.rank}


def poison(value: float):
    """A gradient hook putting `value` in one element (the rest stay finite)."""
    def hook(grad):
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad
    return hook


def nonfinite_run(rank: int, stage: int, how: str, clip, precision: str = "fp32") -> dict:
    """One step with a nan on tensor-parallel rank 1 of data-parallel rank 0 (global rank 1),
    then a clean step. `how`: "loss" multiplies that rank's loss by nan (the nan reaches its
    tensor-parallel and data-parallel peers through the collectives anyway); "grad" / "grad_inf"
    put a nan / inf in one element of that rank's slice of a split weight's gradient, which only
    its data-parallel peer (rank 3) sees: ranks 0 and 2 learn of it from the step agreement over
    the tp axis alone. `clip`: None, or the norm type clip_grad_norm_ runs with first."""
    model, opt = gpt_zero(rank, stage, mixed_precision=precision,  # fp16's loss scaler skips on its own
                          **({} if precision == "fp16" else {"nonfinite_grads": "skip"}))
    before = local_params(model)
    scale = opt.scaler.scale
    loss = gpt_loss(model, gpt_batch(0, opt.comm.rank))
    handle = None
    if rank == 1 and how == "loss":
        loss = loss * float("nan")
    elif rank == 1:
        handle = dict(model.named_parameters())[POISONED].register_hook(
            poison(float("inf") if how == "grad_inf" else float("nan")))
    opt.backward(loss)
    if handle is not None:
        handle.remove()
    out = {}
    if stage == 0 and precision == "fp16":
        # Under fp16 p.grad is a handle (the flat gradient holds the loss-scaled value: [Note:
        # torch's utilities on sharded gradients]); the premise reads this rank's unscaled masters.
        opt.prepare_grads()
        out["local_nonfinite"] = any(not torch.isfinite(m.grad).all() for m in opt.stepper.masters()
                                     if m.grad is not None)
    elif stage == 0:  # the premise: which ranks hold a non-finite gradient before the step
        out["local_nonfinite"] = any(not torch.isfinite(p.grad).all() for p in model.parameters()
                                     if p.grad is not None)
    out["norm"] = float(opt.clip_grad_norm_(1.0, norm_type=clip)) if clip is not None else None
    opt.step()
    after = local_params(model)
    out.update(skipped_steps=opt.skipped_steps, was_skipped=opt.step_was_skipped, scale=opt.scaler.scale,
               scale_before=scale, unchanged=all(torch.equal(before[n], after[n]) for n in before))
    opt.zero_grad()
    opt.backward(gpt_loss(model, gpt_batch(1, opt.comm.rank)))
    opt.step()
    opt.zero_grad()
    later = local_params(model)
    out.update(later_skipped_steps=opt.skipped_steps, later_was_skipped=opt.step_was_skipped,
               later_changed=any(not torch.equal(after[n], later[n]) for n in after), params=later)
    return out


# -- a model whose checkpointed layers take two tensors -------------------------------------
class GatedMLP(nn.Module):
    """fc column-, proj row-parallel: its input enters the tensor-parallel region; `inner`
    drops out in the split region between them."""

    def __init__(self, inner_dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(TWO_HIDDEN, TWO_INNER)
        self.inner = nn.Dropout(inner_dropout)
        self.proj = nn.Linear(TWO_INNER, TWO_HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.inner(F.gelu(self.fc(h))))


class GatedLayer(nn.Module):
    """x + dropout(mlp(norm(x) * gate)); the dropout acts in the replicated region."""

    def __init__(self, dropout: float, inner_dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(TWO_HIDDEN)
        self.mlp = GatedMLP(inner_dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.mlp(self.norm(x) * gate))


class FlatGatedLayer(nn.Module):
    """The same computation with the projections held by the layer itself, so the layer is
    the module that encloses the column-parallel fc."""

    def __init__(self, dropout: float, inner_dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(TWO_HIDDEN)
        self.fc = nn.Linear(TWO_HIDDEN, TWO_INNER)
        self.proj = nn.Linear(TWO_INNER, TWO_HIDDEN)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.proj(F.gelu(self.fc(self.norm(x) * gate))))


class TwoInputNet(nn.Module):
    """Checkpointing as older Hugging Face base models have it: the model itself carries
    `gradient_checkpointing` and `_gradient_checkpointing_func`, and calls the latter on each
    layer with two tensor inputs: the residual stream and a gate, one tensor (from a learned,
    replicated parameter) shared by every layer."""

    gradient_checkpointing = False
    _gradient_checkpointing_func = None
    tensor_parallel_plan = {"embed": "embedding", "layers.*.mlp.fc": "colwise", "layers.*.mlp.proj": "rowwise",
                            "head": "lm_head"}
    layer_class = GatedLayer

    def __init__(self, dropout: float = 0.0, inner_dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(TWO_VOCAB, TWO_HIDDEN)
        self.gate = nn.Parameter(torch.randn(TWO_SEQ, TWO_HIDDEN))
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(self.layer_class(dropout, inner_dropout) for _ in range(TWO_LAYERS))
        self.norm = nn.LayerNorm(TWO_HIDDEN)
        self.head = nn.Linear(TWO_HIDDEN, TWO_VOCAB, bias=False)
        self.mutate_inputs = False  # change each layer's input in place once the layer has run

    def gradient_checkpointing_enable(self, use_reentrant: bool) -> None:
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                              use_reentrant=use_reentrant)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(ids))
        gate = torch.sigmoid(self.gate)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                out = self._gradient_checkpointing_func(layer.__call__, x, gate)
            else:
                out = layer(x, gate)
            if self.mutate_inputs:
                x.mul_(2.0)
            x = out
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class FlatTwoInputNet(TwoInputNet):
    """Its layers hold fc and proj themselves: the plan is as valid, but the module enclosing
    the column-parallel fc is the layer, whose norm and gate act before fc."""

    tensor_parallel_plan = {"embed": "embedding", "layers.*.fc": "colwise", "layers.*.proj": "rowwise",
                            "head": "lm_head"}
    layer_class = FlatGatedLayer


MODELS = {"nested": TwoInputNet, "flat": FlatTwoInputNet}


def two_input_net(seed: int, dropout: float, reentrant=None, kind: str = "nested",
                  inner_dropout: float = 0.0) -> TwoInputNet:
    torch.manual_seed(seed)
    model = MODELS[kind](dropout, inner_dropout)
    if reentrant is not None:
        model.gradient_checkpointing_enable(reentrant)
    return model.train()


def two_batch(step: int, dp_rank=None) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, TWO_VOCAB, (DP * TWO_BATCH, TWO_SEQ + 1), generator=torch.Generator().manual_seed(
        3000 + step))
    if dp_rank is not None:
        ids = ids[dp_rank * TWO_BATCH:(dp_rank + 1) * TWO_BATCH]
    return ids[:, :-1], ids[:, 1:]


def two_input_reference(kind: str) -> dict:
    """One process, the global batch, SGD; each step's parameters ("steps"). Once per process."""
    return memoized(("two", kind), lambda: _two_input_reference(kind))


def _two_input_reference(kind: str) -> dict:
    model = two_input_net(seed=0, dropout=0.0, reentrant=False, kind=kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, largest, steps = [], [], []
    for step in range(STEPS):
        loss = model(*two_batch(step))
        loss.backward()
        largest.append(grad_max(model))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "params": steps[-1], "steps": steps, "grad_max": largest}


def two_input_run(rank: int, dropout: float, reentrant: bool, late_enable: bool = False, kind: str = "nested",
                  every_step: bool = False, **fields) -> dict:
    """Stage 3 at 2 x 2; the ledger read right after the first forward. `late_enable`:
    checkpointing is switched on after initialize (the store must wrap it at the forward)."""
    model = two_input_net(seed=rank, dropout=dropout, reentrant=None if late_enable else reentrant, kind=kind)
    cfg = zerodp.Config(stage=3, tensor_parallel_size=TP, unit_min_params=50, **fields)
    model, opt = zerodp.initialize(model, torch.optim.SGD, cfg, lr=LR)
    if late_enable:
        model.gradient_checkpointing_enable(reentrant)
    losses, ledger, steps = [], None, []
    for step in range(STEPS):
        loss = model(*two_batch(step, opt.comm.rank))
        if step == 0:
            report = opt.memory_report()
            ledger = {"held": report.activation_checkpoints, "on_host": report.activation_checkpoints_on_host}
        opt.backward(loss)
        if step == 0:
            ledger["after_backward"] = opt.memory_report().activation_checkpoints
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if every_step and step < STEPS - 1:
            steps.append(local_params(model))
    params = local_params(model)
    return {"losses": losses, "params": params, "ledger": ledger, **({"steps": steps + [params]} if every_step else {})}


def in_place_after_forward(rank: int, reentrant: bool, under_zerodp: bool) -> str:
    """Each layer's input is changed in place after the layer ran; the error its backward
    raises (torch's own without zerodp, on one process)."""
    model = two_input_net(seed=rank, dropout=0.0, reentrant=reentrant)
    opt = None
    if under_zerodp:
        model, opt = zerodp.initialize(model, torch.optim.SGD, zerodp.Config(stage=3, tensor_parallel_size=TP),
                                       lr=LR)
    model.mutate_inputs = True
    loss = model(*two_batch(0, rank // TP))
    return error_of(lambda: opt.backward(loss) if opt is not None else loss.backward())


# -- the cases (test_tensor_parallel_edges.py sends one per test) ----------------------------
def _check_world(world_size: int) -> None:
    assert world_size == DP * TP, world_size


def whole_shapes() -> dict:
    """The GPT's parameters' shapes, unsplit."""
    return {n: tuple(p.shape) for n, p in gpt(seed=0).named_parameters()}


def clip_case(rank: int, world_size: int, name: str, stage: int) -> dict:
    """Clipping with norm `name` at `stage`; rank 0 adds the one-process reference ("ref")."""
    _check_world(world_size)
    ref = clip_reference(NORMS[name]) if rank == 0 else None
    return {**clip_run(rank, stage, NORMS[name]), "ref": ref}


def nonfinite_case(rank: int, world_size: int, stage: int, how: str, clip, precision: str = "fp32") -> dict:
    """A nan/inf on global rank 1 only (nonfinite_run), with the GPT's unsplit shapes."""
    _check_world(world_size)
    return {**nonfinite_run(rank, stage, how, clip, precision=precision), "whole": whole_shapes()}


def two_parity_case(rank: int, world_size: int, kind: str) -> dict:
    """The two-input model without dropout, each step's parameters; rank 0 adds the
    one-process reference ("ref")."""
    _check_world(world_size)
    ref = two_input_reference(kind) if rank == 0 else None
    return {**two_input_run(rank, 0.0, False, kind=kind, every_step=True), "ref": ref}


def two_pa_case(rank: int, world_size: int, reentrant: bool) -> dict:
    """The two-input model with dropout, without Pa, with Pa and with Pa+cpu."""
    _check_world(world_size)
    return {name: two_input_run(rank, DROPOUT, reentrant, **fields) for name, fields in PA.items()}


def late_pa_case(rank: int, world_size: int) -> dict:
    """Pa with checkpointing switched on after initialize."""
    _check_world(world_size)
    return two_input_run(rank, DROPOUT, False, late_enable=True, partition_activations=True)


def in_place_case(rank: int, world_size: int, reentrant: bool) -> dict:
    """The errors of an in-place change to a checkpointed input: torch's on one process, then
    zerodp's. The backward passes stop part-way, on every rank alike."""
    _check_world(world_size)
    return {"torch": in_place_after_forward(rank, reentrant, under_zerodp=False),
            "zerodp": in_place_after_forward(rank, reentrant, under_zerodp=True)}


def region_case(rank: int, world_size: int, reentrant) -> dict:
    """Dropout in both regions, checkpointed (`reentrant` False / True) or not (None)
    (tp_region_cases.region_run, which builds on this file)."""
    _check_world(world_size)
    from tp_region_cases import region_run

    return region_run(rank, reentrant)


def input_check_case(rank: int, world_size: int) -> dict:
    _check_world(world_size)
    from tp_region_cases import input_check

    return input_check(rank)


def demo_case(rank: int, world_size: int) -> dict:
    """The demo's job without tensor parallelism and with TP = 2, in a directory rank 0 makes."""
    _check_world(world_size)
    import shutil
    import tempfile

    from tp_region_cases import demo_run

    root = [tempfile.mkdtemp(prefix="zerodp-tp-demo-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(root, src=0)
    try:
        return {tp: demo_run(rank, root[0], tp) for tp in (1, TP)}
    finally:
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(root[0], ignore_errors=True)
