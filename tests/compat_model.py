"""The small model and data of tests/data/checkpoint_v1 (see tests/data/make_v1_checkpoint.py)."""
import torch
import torch.nn as nn

import zerodp

STEPS_BEFORE = 2


class TiedNet(nn.Module):
    """An embedding tied to the output head, a norm and a buffer: every kind of state a
    checkpoint holds (trainable pieces, tied names, replicated tensors)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("offset", torch.linspace(-1, 1, 16))

    def forward(self, x):
        h = self.embed(x) + self.offset.to(self.embed.weight.dtype)
        return self.head(self.norm(torch.tanh(self.hidden(h))))


def config() -> zerodp.Config:
    return zerodp.Config(stage=2, mixed_precision="bf16", bucket_bytes=1024)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)


def loss_at(model: nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 32), y.reshape(-1))
