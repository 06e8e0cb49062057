"""Stage 3: what gathered_parameters leaves in the buffer pool (issue 22, item 10) and a
gradient penalty followed by another forward (item 12); a case per test of
test_stage3_buffers.py."""
from __future__ import annotations

import torch
import torch.nn as nn

import zerodp

WIDTH, DEPTH, STEPS = 16, 12, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def model_fn():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(DEPTH)], nn.Linear(WIDTH, 1))


def data(step, rank, rows=4):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, 1, generator=g)


def penalized_loss(model, x, y):
    """A WGAN-GP style loss: the input gradient's norm, taken with create_graph=True, and then
    a second forward (an eval of another batch) before the backward of the whole."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = gx.pow(2).sum(1).mean()
    second = model(x.detach() * 0.5)  # another forward: reuses the pooled gather buffers
    return (out - y).pow(2).mean() + 0.1 * penalty + 0.01 * second.pow(2).mean()


def pool_after_gather(rank, world_size):
    model = model_fn()
    cfg = zerodp.Config(stage=3, unit_modules=(Block,))
    model, opt = zerodp.initialize(model, torch.optim.SGD, cfg, lr=0.1)
    for step in range(2):  # the second step runs with prefetching: the pool's working size
        x, y = data(step, rank)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    before = opt.memory_report().comm_buffers
    with zerodp.gathered_parameters(model):
        whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    during_shapes = {n: tuple(t.shape) for n, t in whole.items()}
    after = opt.memory_report().comm_buffers
    x, y = data(2, rank)
    (model(x) - y).pow(2).mean().backward()  # training goes on with the smaller pool
    opt.step()
    return {"before": before, "after": after, "after_step": opt.memory_report().comm_buffers,
            "shapes": during_shapes, "unit_nbytes": WIDTH * (WIDTH + 1) * 4}


# The one-process reference, kept by each rank's process of the session's world of 2 (which
# lives as long as the session): the four stages' cases compare with the same one.
_REFERENCES: dict = {}


def penalty_reference(world_size: int) -> list:
    """One process, the global batch (every rank's slice): each step's parameters. Every rank
    computes it itself, once per process."""
    if world_size not in _REFERENCES:
        ref = model_fn()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        steps = []
        for step in range(STEPS):
            ref_opt.zero_grad()
            parts = [data(step, r) for r in range(world_size)]
            loss = sum(penalized_loss(ref, x, y) for x, y in parts) / world_size
            loss.backward()
            ref_opt.step()
            steps.append({n: p.detach().clone() for n, p in ref.named_parameters()})
        _REFERENCES[world_size] = steps
    return _REFERENCES[world_size]


def penalty_case(rank, world_size, stage):
    """zerodp at `stage` on this rank's slice against the one-process reference on the global
    batch: the largest parameter difference after each step."""
    expected = penalty_reference(world_size)
    model = model_fn()
    cfg = zerodp.Config(stage=stage, unit_modules=(Block,) if stage == 3 else ())
    model, opt = zerodp.initialize(model, torch.optim.SGD, cfg, lr=0.05)
    out = []
    for step in range(STEPS):
        x, y = data(step, rank)
        penalized_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        with zerodp.gathered_parameters(model):
            got = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append(max(float((got[n] - expected[step][n]).abs().max()) for n in expected[step]))
    return out
