"""ZeRO++ (hpZ, qwZ, qgZ) at world size 4 as 2 nodes x 2 ranks, inside one spawned world
(test_zeropp.py)."""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

import zerodp
from core_cases import OPTIMIZERS, Net, batch, loss_fn, max_rel_diff, train_reference, train_zerodp
from hybrid_cases import as_two_nodes
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


def training(rank: int, world_size: int) -> dict:
    """Parity, error and ledger bytes of every variant on the test MLP, fp32 SGD and AdamW."""
    out = {}
    ref = {name: train_reference(Net, fn, torch.float32, rank) for name, fn in OPTIMIZERS.items()}
    for variant, fields in VARIANTS.items():
        for name, fn in OPTIMIZERS.items():
            quantized = "quantize_weights" in fields or "quantize_grads" in fields
            cfg = zerodp.Config(**UNITS, **({"quantize_block_size": BLOCK} if quantized else {}), **fields)
            model, opt, losses, _, volumes = train_zerodp(Net, fn, cfg, rank)
            with zerodp.gathered_parameters(model):
                params = {n: p.detach().clone() for n, p in model.named_parameters()}
                diff = max_rel_diff(model, ref[name][0])
            out[(variant, name)] = {"diff": diff, "params": params, "losses": losses,
                                    "by_axis": volumes[-1]["nbytes_by_axis"], "by_link": volumes[-1]["nbytes_by_link"],
                                    "by_op": volumes[-1]["by_op"], "units": unit_numels(opt),
                                    "secondary": opt.memory_report().secondary_params}
    return out


def one_step_gradient_error(rank: int, world_size: int) -> dict:
    """One plain-SGD step (lr 1) of qgZ against the unquantized stage 3 from the same
    weights: the update differs by the reduced gradient's error, bounded from the ranks'
    own gradients with every block's max taken as the whole model's."""
    out = {}
    torch.manual_seed(0)
    local = Net()
    x, y = batch(0, rank)
    loss_fn(local(x), y).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in local.parameters()]) / world_size
    every = [torch.empty_like(grads) for _ in range(world_size)]
    dist.all_gather(every, grads)
    for bits in (8, 4):
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
        out[bits] = {"err": err, "bound": bound}
    return out


def low_precision_and_paths(rank: int, world_size: int, root: str) -> dict:
    """bf16/fp16 with all three; accumulation, clipping, the debug check; a checkpoint saved
    with ZeRO++ loaded without it."""
    out = {}
    everything = dict(hpz=True, quantize_weights=True, quantize_grads="int8", quantize_block_size=BLOCK)
    for precision in ("bf16", "fp16"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        cfg = zerodp.Config(**UNITS, mixed_precision=precision)
        plain, _, _, _, plain_volumes = train_zerodp(Net, OPTIMIZERS["adamw"], cfg, rank)
        model, opt, losses, _, volumes = train_zerodp(Net, OPTIMIZERS["adamw"], zerodp.Config(
            **UNITS, mixed_precision=precision, **everything), rank)
        ref, ref_losses, _ = train_reference(Net, OPTIMIZERS["adamw"], dtype, rank)
        with zerodp.gathered_parameters(model), zerodp.gathered_parameters(plain):
            out[precision] = {"diff": max_rel_diff(model, ref), "plain_diff": max_rel_diff(plain, ref),
                              "loss_gap": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                              "ref_losses": ref_losses,
                              "by_link": volumes[-1]["nbytes_by_link"], "plain_by_link": plain_volumes[-1]["nbytes_by_link"],
                              "units": unit_numels(opt), "skipped": opt.skipped_steps}
    # Accumulation (2 micro-batches) and clipping, fp32 SGD, against DDP on the whole batch.
    ref, _, ref_norms = train_reference(Net, OPTIMIZERS["sgd"], torch.float32, rank, clip=0.05)
    model, opt, _, norms, _ = train_zerodp(Net, OPTIMIZERS["sgd"], zerodp.Config(
        **UNITS, grad_accumulation_steps=2, debug=True, hpz=True, quantize_weights=True, quantize_grads="int8",
        quantize_block_size=BLOCK), rank, clip=0.05, micro_batches=2)
    with zerodp.gathered_parameters(model):
        out["accumulation"] = {"diff": max_rel_diff(model, ref),
                               "norm_gap": max(abs(a - b) / b for a, b in zip(norms, ref_norms))}
    # hpZ alone with accumulation and the debug check: exact maths, so DDP's tolerance.
    model, opt, _, norms, _ = train_zerodp(Net, OPTIMIZERS["sgd"], zerodp.Config(
        **UNITS, grad_accumulation_steps=2, debug=True, hpz=True), rank, clip=0.05, micro_batches=2)
    with zerodp.gathered_parameters(model):
        out["hpz_accumulation"] = max_rel_diff(model, ref)
    # hpZ under activation checkpointing, both modes: the recomputation gathers inside the
    # node too, and the results are plain stage 3's with the same checkpointing.
    for model_fn in (CheckpointedNet, ReentrantNet):
        runs = {}
        for variant in ("plain", "hpz"):
            model, opt, losses, _, volumes = train_zerodp(model_fn, OPTIMIZERS["sgd"], zerodp.Config(
                **UNITS, **VARIANTS[variant]), rank)
            with zerodp.gathered_parameters(model):
                runs[variant] = {"params": [p.detach().clone() for p in model.parameters()], "losses": losses,
                                 "by_link": volumes[-1]["nbytes_by_link"], "units": unit_numels(opt)}
        out[f"checkpoint/{model_fn.__name__}"] = runs
    # An inf on one rank under fp16 with all three: every rank skips the step, the scale backs off.
    torch.manual_seed(0)
    model, opt = zerodp.initialize(Net(), OPTIMIZERS["sgd"], zerodp.Config(
        **UNITS, mixed_precision="fp16", initial_loss_scale=1024.0, **everything))
    x, y = batch(0, rank)
    loss = loss_fn(model(x), y) * (float("inf") if rank == 1 else 1.0)
    opt.backward(loss)
    opt.step()
    out["fp16_inf"] = {"skipped": opt.step_was_skipped, "scale": opt.scaler.scale}
    # qgZ reducing once at the boundary (reduce_each_micro_batch=False), synchronously.
    ref, _, _ = train_reference(Net, OPTIMIZERS["sgd"], torch.float32, rank)
    model, opt, _, _, _ = train_zerodp(Net, OPTIMIZERS["sgd"], zerodp.Config(
        **UNITS, grad_accumulation_steps=2, reduce_each_micro_batch=False, overlap_comm=False,
        quantize_grads="int8", quantize_block_size=BLOCK), rank, micro_batches=2)
    with zerodp.gathered_parameters(model):
        out["reduce_once"] = max_rel_diff(model, ref)
    path = os.path.join(root, "zeropp")
    model, opt, _, _, _ = train_zerodp(Net, OPTIMIZERS["adamw"], zerodp.Config(
        **UNITS, **dict(everything, quantize_grads="int4")), rank)
    zerodp.save(path, model, opt)
    torch.manual_seed(1)
    plain, plain_opt = zerodp.initialize(Net(), OPTIMIZERS["adamw"], zerodp.Config(stage=2))
    zerodp.load(path, plain, plain_opt)
    with zerodp.gathered_parameters(model):
        out["loaded"] = max_rel_diff(plain, model)
        out["saved"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["path"] = path
    return out


def zeropp_world(rank: int, world_size: int, root: str) -> dict:
    as_two_nodes(rank)
    return {"bounds": collective_bounds(rank, world_size), "training": training(rank, world_size),
            "one_step": one_step_gradient_error(rank, world_size),
            "paths": low_precision_and_paths(rank, world_size, root)}


def payload(numel: int, bits: int, block: int) -> int:
    """Bytes of `numel` elements quantized, as the docs state it: the codes of whole blocks
    (bits/8 bytes each) and one fp32 scale per block."""
    blocks = math.ceil(numel / block)
    return math.ceil(blocks * block * bits / 8) + 4 * blocks
