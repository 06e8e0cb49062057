"""A Hugging Face GPT-2 (random init, from a config) trained with zerodp on the bundled corpus.

    pip install transformers
    zerodp launch --nproc 2 examples/hf_gpt2.py --stage 3 --steps 20

Stage 3 gathers one GPT2Block at a time (Config.unit_modules). The model is built from a
GPT2Config, so nothing is downloaded; the bundled corpus is byte-level, so vocab_size=256.
"""
import argparse
import sys

import torch

import zerodp
from zerodp.demo.data import TokenBatches, load_splits


def main():
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    except ImportError:
        sys.exit("examples/hf_gpt2.py needs Hugging Face transformers: pip install transformers")
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=4)
    args = p.parse_args()

    rank, world_size = zerodp.init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    hf_cfg = GPT2Config(vocab_size=256, n_positions=128, n_embd=256, n_layer=4, n_head=4)
    cfg = zerodp.Config(stage=args.stage, mixed_precision=args.precision,
                        unit_modules=(GPT2Block,) if args.stage == 3 else ())
    # HF models initialise weights in a whole-model post_init() pass rather than in each
    # module's reset_parameters(), so build them for real (not under zerodp.init).
    model = GPT2LMHeadModel(hf_cfg).to(device)
    model, optimizer = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=1e-3, weight_decay=0.1)

    batches = TokenBatches(load_splits(), "train", args.batch_size, 128, seed=0, rank=rank, world_size=world_size)
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        loss = model(input_ids=x.to(device), labels=x.to(device)).loss  # HF shifts the labels itself
        optimizer.backward(loss)
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
