"""A plain PyTorch training script, converted from DDP to zerodp.

    zerodp launch --nproc 2 examples/ddp_to_zerodp.py --stage 3 --steps 50
    torchrun --standalone --nproc_per_node 2 examples/ddp_to_zerodp.py     # the same thing

The lines marked `# zerodp` are the whole change from a DDP script: no DDP wrapper, the
optimizer built by zerodp.initialize, and backward/step through the returned optimizer.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import zerodp


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x).squeeze(-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    args = p.parse_args()

    rank, world_size = zerodp.init_distributed()                           # zerodp (was init_process_group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    cfg = zerodp.Config(stage=args.stage, mixed_precision=args.precision,  # zerodp
                        unit_modules=(nn.Linear,) if args.stage == 3 else ())
    if args.stage == 3:
        with zerodp.init(cfg):                                             # zerodp: stage 3 is born sharded
            model = MLP()
    else:
        model = MLP().to(device)
    model, optimizer = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=1e-3)  # zerodp (was DDP(model))

    # Every rank draws its own batch of a fixed regression task: y = sum of sin(x).
    gen = torch.Generator().manual_seed(1234 + rank)
    for step in range(1, args.steps + 1):
        x = torch.randn(64, 256, generator=gen)
        y = torch.sin(x).sum(-1) / 16
        loss = F.mse_loss(model(x.to(device)).float(), y.to(device))
        optimizer.backward(loss)                                           # zerodp (was loss.backward())
        optimizer.clip_grad_norm_(1.0)                                     # zerodp: exact global norm
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps or step == 1):
            mem = optimizer.memory_report()
            print(f"step {step}: loss {loss.item():.4f}, model state {mem.model_state / 1e6:.2f} MB on this rank "
                  f"(of {world_size})", flush=True)
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
