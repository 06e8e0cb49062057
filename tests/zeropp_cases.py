"""ZeRO++ (hpZ, qwZ, qgZ) at world size 4 as 2 nodes x 2 ranks, a case per test in the
session's world of 4 (test_zeropp.py, worldpool.py).

Each case returns plain numbers and tensors; the tests assert on them in the parent process.
Runs compared with DDP are traced at every step (parity.StepTrace, hybrid_cases.traced_run)."""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

import zerodp
from core_cases import OPTIMIZERS, Net, batch, loss_fn, max_rel_diff, train_zerodp
from hybrid_cases import as_two_nodes, reference, step_bytes, traced_run
from zerodp.distributed import Comm, Topology
from zerodp.distributed.quantized import QuantizedCollectives

NODE, NODES = 2, 2
UNITS = dict(stage=3, unit_min_params=10)
VARIANTS = {
    "plain": {},
    "hpz": {"hpz": True},
    "qwz": {"quantize_weights": True},
    "qgz8": {"quantize_grads": "int8"},
    "qgz4": {"quantize_grads": "int4"},
    "all": {"hpz": True, "quantize_weights": True, "quantize_grads": "int4"},
}
BLOCK = 16  # small, so the model's units span several blocks and a partial last one


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block's largest magnitude (blocks of `block` along the last dim)."""
    n = x.shape[-1]
    padded = torch.nn.functional.pad(x.abs(), (0, (-n) % block))
    return padded.view(*x.shape[:-1], -1, block).amax(-1, keepdim=True).expand(
        *x.shape[:-1], -1, block).reshape(*x.shape[:-1], -1)[..., :n]


def collective_bounds(rank: int, world_size: int) -> dict:
    """The quantized collectives alone, against their exact results and the bound of
    [Note: blockwise quantization]: max|block| / (2 qmax) per quantization."""
    as_two_nodes(rank)
    comm = Comm(topology=Topology.build().with_node_axes())
    out = {}
    chunk = 37  # elements per rank: not a multiple of the block
    shards = [torch.randn(chunk, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(world_size)]
    qwz = QuantizedCollectives(comm.collectives("shard"), 8, None, BLOCK)
    gathered = torch.empty(chunk * world_size)
    qwz.all_gather(gathered, shards[rank], "forward")
    exact = torch.cat(shards)
    bound = torch.cat([block_absmax(s, BLOCK) for s in shards]) / (2 * 127)
    out["qwz"] = {"err": float((gathered - exact).abs().max()),
                  "ratio": float(((gathered - exact).abs() / bound.clamp_min(1e-30)).max()),
                  "checksum": float(gathered.double().sum())}
    # qgZ over 2 nodes x 2, and over the degenerate splits: one node of 4 (level 1 only) and
    # 4 nodes of 1 (level 2 only); the replicate axis is a size-1 stand-in for a trivial level.
    splits = {"2x2": (comm.collectives("node"), comm.collectives("cross_node")),
              "1x4": (comm.collectives("shard"), comm.collectives("replicate")),
              "4x1": (comm.collectives("replicate"), comm.collectives("shard"))}
    for bits in (8, 4):
        qmax = 2 ** (bits - 1) - 1
        fulls = [torch.randn(chunk * world_size, generator=torch.Generator().manual_seed(100 + r)) for r in
                 range(world_size)]
        for split, (node_axis, cross_axis) in splits.items():
            qgz = QuantizedCollectives(comm.collectives("shard"), None, bits, BLOCK, node_axis, cross_axis)
            mine = torch.empty(chunk)
            qgz.reduce_scatter(mine, fulls[rank].clone(), "backward")
            exact = sum(fulls)[rank * chunk:(rank + 1) * chunk]
            # The bound, from the inputs alone: level 1 quantizes each rank's copy of this
            # chunk, level 2 each node's sum of it (with its level-1 error); a level over one
            # rank quantizes nothing.
            n, m = node_axis.size, cross_axis.size
            total = torch.zeros(chunk)
            for node in range(m):
                ranks = range(node * n, (node + 1) * n)
                mine_of = [fulls[i][rank * chunk:(rank + 1) * chunk] for i in ranks]
                level1 = sum(block_absmax(t, BLOCK) for t in mine_of) / (2 * qmax) if n > 1 else torch.zeros(chunk)
                level2 = block_absmax(sum(mine_of).abs() + level1, BLOCK) / (2 * qmax) if m > 1 else 0.0
                total += level1 + level2
            err = (mine - exact).abs()
            out[f"qgz{bits}/{split}"] = {"err": float(err.max()), "ratio": float((err / total).max())}
    return out


class CheckpointedNet(Net):
    """The test MLP with norm and fc2 run through torch.utils.checkpoint (their input needs
    a gradient: reentrant checkpointing gives none to a segment whose inputs need none)."""

    reentrant = False

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        def tail(h):
            return self.fc2(torch.tanh(self.norm(h)))
        return checkpoint(tail, self.fc1(x), use_reentrant=self.reentrant) * self.scale


class ReentrantNet(CheckpointedNet):
    reentrant = True


def unit_numels(opt) -> list[int]:
    return [u.layout.padded_numel for u in opt.stage3.units if not u.empty]


def _traced(model_fn, opt_fn, cfg, rank, **kwargs):
    """hybrid_cases.traced_run; the last step's ledger without the trace's snapshots."""
    model, opt, losses, norms, trace = traced_run(model_fn, opt_fn, cfg, rank, **kwargs)
    return model, opt, losses, norms, step_bytes(opt), trace


def training_case(rank: int, world_size: int, variant: str, opt_name: str) -> dict:
    """One variant on the test MLP, fp32, one optimizer: against DDP at every step, the
    parameters of every step (for bit-for-bit comparisons between variants), the error and
    the ledger's bytes of the last step."""
    as_two_nodes(rank)
    fields = VARIANTS[variant]
    ref, _, _, ref_trace = reference(rank, opt_name)
    quantized = "quantize_weights" in fields or "quantize_grads" in fields
    cfg = zerodp.Config(**UNITS, **({"quantize_block_size": BLOCK} if quantized else {}), **fields)
    model, opt, losses, _, volume, trace = _traced(Net, OPTIMIZERS[opt_name], cfg, rank)
    with zerodp.gathered_parameters(model):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        diff = max_rel_diff(model, ref)
    return {"diff": diff, "per_step": trace.compare(ref_trace), "params": params, "step_params": trace.params,
            "losses": losses, "by_axis": volume["nbytes_by_axis"], "by_link": volume["nbytes_by_link"],
            "by_op": volume["by_op"], "units": unit_numels(opt), "secondary": opt.memory_report().secondary_params}


def one_step_gradient_error(rank: int, world_size: int, bits: int) -> dict:
    """One plain-SGD step (lr 1) of qgZ at `bits` against the unquantized stage 3 from the
    same weights: the update differs by the reduced gradient's error, bounded from the
    ranks' own gradients with every block's max taken as the whole model's."""
    as_two_nodes(rank)
    torch.manual_seed(0)
    local = Net()
    x, y = batch(0, rank)
    loss_fn(local(x), y).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in local.parameters()]) / world_size
    every = [torch.empty_like(grads) for _ in range(world_size)]
    dist.all_gather(every, grads)
    qmax = 2 ** (bits - 1) - 1
    level1 = [sum(float(every[i].abs().max()) for i in range(m * NODE, (m + 1) * NODE)) / (2 * qmax)
              for m in range(NODES)]
    node_max = [float(sum(every[i] for i in range(m * NODE, (m + 1) * NODE)).abs().max()) for m in range(NODES)]
    bound = sum(level1) + sum((node_max[m] + level1[m]) / (2 * qmax) for m in range(NODES))
    sgd = lambda ps: torch.optim.SGD(list(ps), lr=1.0)  # noqa: E731
    exact, _, _, _, _ = train_zerodp(Net, sgd, zerodp.Config(**UNITS), rank, steps=1)
    quant, _, _, _, _ = train_zerodp(Net, sgd, zerodp.Config(**UNITS, quantize_grads=f"int{bits}",
                                                             quantize_block_size=BLOCK), rank, steps=1)
    with zerodp.gathered_parameters(exact), zerodp.gathered_parameters(quant):
        err = max(float((a - b).abs().max()) for a, b in zip(exact.parameters(), quant.parameters()))
    return {"err": err, "bound": bound}


EVERYTHING = dict(hpz=True, quantize_weights=True, quantize_grads="int8", quantize_block_size=BLOCK)


def low_precision_case(rank: int, world_size: int, precision: str) -> dict:
    """bf16 or fp16, AdamW: plain stage 3 and all three ZeRO++ parts (int8 gradients), each
    against DDP at every step."""
    as_two_nodes(rank)
    ref, ref_losses, _, ref_trace = reference(rank, "adamw", precision)
    plain, _, _, _, plain_volume, plain_trace = _traced(Net, OPTIMIZERS["adamw"], zerodp.Config(
        **UNITS, mixed_precision=precision), rank)
    model, opt, losses, _, volume, trace = _traced(Net, OPTIMIZERS["adamw"], zerodp.Config(
        **UNITS, mixed_precision=precision, **EVERYTHING), rank)
    with zerodp.gathered_parameters(model), zerodp.gathered_parameters(plain):
        return {"diff": max_rel_diff(model, ref), "plain_diff": max_rel_diff(plain, ref),
                "per_step": trace.compare(ref_trace), "plain_per_step": plain_trace.compare(ref_trace),
                "loss_gap": max(abs(a - b) for a, b in zip(losses, ref_losses)), "ref_losses": ref_losses,
                "by_link": volume["nbytes_by_link"], "plain_by_link": plain_volume["nbytes_by_link"],
                "units": unit_numels(opt), "skipped": opt.skipped_steps}


def accumulation_case(rank: int, world_size: int, variant: str) -> dict:
    """Accumulation (2 micro-batches), clipping and the debug check, fp32 SGD, with all three
    parts ("all", int8 gradients) or hpZ alone ("hpz"), against DDP on the whole batch at
    every step."""
    as_two_nodes(rank)
    fields = EVERYTHING if variant == "all" else VARIANTS["hpz"]
    ref, _, ref_norms, ref_trace = reference(rank, "sgd", clip=0.05)
    model, opt, _, norms, _, trace = _traced(Net, OPTIMIZERS["sgd"], zerodp.Config(
        **UNITS, grad_accumulation_steps=2, debug=True, **fields), rank, clip=0.05, micro_batches=2)
    with zerodp.gathered_parameters(model):
        return {"diff": max_rel_diff(model, ref), "per_step": trace.compare(ref_trace),
                "norm_gap": max(abs(a - b) / b for a, b in zip(norms, ref_norms))}


def activation_checkpointing_case(rank: int, world_size: int, net: str) -> dict:
    """hpZ under activation checkpointing (`net`: CheckpointedNet or ReentrantNet): the
    recomputation gathers inside the node too, and the results are plain stage 3's with the
    same checkpointing."""
    as_two_nodes(rank)
    model_fn = {"CheckpointedNet": CheckpointedNet, "ReentrantNet": ReentrantNet}[net]
    runs = {}
    for variant in ("plain", "hpz"):
        model, opt, losses, _, volumes = train_zerodp(model_fn, OPTIMIZERS["sgd"], zerodp.Config(
            **UNITS, **VARIANTS[variant]), rank)
        with zerodp.gathered_parameters(model):
            runs[variant] = {"params": [p.detach().clone() for p in model.parameters()], "losses": losses,
                             "by_link": volumes[-1]["nbytes_by_link"], "units": unit_numels(opt)}
    return runs


def fp16_inf_case(rank: int, world_size: int) -> dict:
    """An inf on one rank under fp16 with all three: every rank skips the step, the scale backs off."""
    as_two_nodes(rank)
    torch.manual_seed(0)
    model, opt = zerodp.initialize(Net(), OPTIMIZERS["sgd"], zerodp.Config(
        **UNITS, mixed_precision="fp16", initial_loss_scale=1024.0, **EVERYTHING))
    x, y = batch(0, rank)
    loss = loss_fn(model(x), y) * (float("inf") if rank == 1 else 1.0)
    opt.backward(loss)
    opt.step()
    return {"skipped": opt.step_was_skipped, "scale": opt.scaler.scale}


def reduce_once_case(rank: int, world_size: int) -> dict:
    """qgZ reducing once at the boundary (reduce_each_micro_batch=False), synchronously,
    against DDP on the whole batch at every step."""
    as_two_nodes(rank)
    ref, _, _, ref_trace = reference(rank, "sgd")
    model, _, _, _, _, trace = _traced(Net, OPTIMIZERS["sgd"], zerodp.Config(
        **UNITS, grad_accumulation_steps=2, reduce_each_micro_batch=False, overlap_comm=False,
        quantize_grads="int8", quantize_block_size=BLOCK), rank, micro_batches=2)
    with zerodp.gathered_parameters(model):
        return {"diff": max_rel_diff(model, ref), "per_step": trace.compare(ref_trace)}


def checkpoint_case(rank: int, world_size: int, root: str) -> dict:
    """A checkpoint saved with all three parts (int4 gradients), AdamW, loaded by plain
    stage 2 on the same ranks; the saved values, for a load in another world."""
    as_two_nodes(rank)
    path = os.path.join(root, "zeropp")
    model, opt, _, _, _ = train_zerodp(Net, OPTIMIZERS["adamw"], zerodp.Config(
        **UNITS, **dict(EVERYTHING, quantize_grads="int4")), rank)
    zerodp.save(path, model, opt)
    torch.manual_seed(1)
    plain, plain_opt = zerodp.initialize(Net(), OPTIMIZERS["adamw"], zerodp.Config(stage=2))
    zerodp.load(path, plain, plain_opt)
    with zerodp.gathered_parameters(model):
        return {"loaded": max_rel_diff(plain, model),
                "saved": {n: p.detach().clone() for n, p in model.named_parameters()}, "path": path}


def payload(numel: int, bits: int, block: int) -> int:
    """Bytes of `numel` elements quantized, as the docs state it: the codes of whole blocks
    (bits/8 bytes each) and one fp32 scale per block."""
    blocks = math.ceil(numel / block)
    return math.ceil(blocks * block * bits / 8) + 4 * blocks
