"""Hugging Face's Trainer, trained with zerodp: the one-line change is the import.

    pip install "zerodp[hf]"            # transformers + accelerate
    zerodp launch --nproc 2 examples/hf_trainer.py --stage 3 --max-steps 20 --save-steps 10
    zerodp launch --nproc 2 examples/hf_trainer.py --stage 3 --max-steps 20 --resume   # from the last checkpoint
    zerodp launch --nproc 2 examples/hf_trainer.py --ddp ...                           # plain DDP, to compare

A Llama (or GPT-2) built from a small config, so nothing is downloaded, trained on the
bundled corpus (byte-level, vocab 256) with the Trainer's AdamW, linear LR schedule,
gradient accumulation, clipping, evaluation, save_steps checkpoints and resume. With
--log-json, rank 0 writes the Trainer's log history there.
"""
import argparse
import json
import os
import sys

import torch

import zerodp
from zerodp.demo.data import load_splits


class Windows(torch.utils.data.Dataset):
    """Fixed windows of a byte corpus, as a causal LM's input_ids and labels."""

    def __init__(self, data: torch.Tensor, seq: int, count: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - seq - 1, (count,), generator=g)
        self.data, self.seq = data, seq

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        ids = self.data[self.starts[i]: self.starts[i] + self.seq].long()
        return {"input_ids": ids, "labels": ids.clone()}  # HF shifts the labels itself


def build_model(kind: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                          bos_token_id=255, eos_token_id=255))
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    p.add_argument("--ddp", action="store_true", help="plain transformers.Trainer (torch DDP), for comparison")
    p.add_argument("--output-dir", default="runs/hf_trainer")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): zerodp's bf16 compute, fp32 master")
    p.add_argument("--train-windows", type=int, default=512, help="training examples (an epoch)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    p.add_argument("--log-json", default=None)
    args = p.parse_args()
    try:
        from transformers import Trainer, TrainingArguments
    except ImportError:
        sys.exit('examples/hf_trainer.py needs transformers and accelerate: pip install "zerodp[hf]"')
    if not args.ddp:
        from zerodp.integrations.hf import Trainer  # noqa: F811  (the one-line change)

    torch.manual_seed(0)
    model = build_model(args.model)
    splits = load_splits()
    train, val = Windows(splits.train, 32, args.train_windows, seed=1), Windows(splits.val, 32, 16, seed=2)
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, gradient_accumulation_steps=args.accumulation, learning_rate=3e-3,
        weight_decay=0.1, warmup_steps=2, lr_scheduler_type="linear", max_grad_norm=0.5,
        eval_strategy="steps", eval_steps=args.save_steps, save_steps=args.save_steps, logging_steps=1,
        save_total_limit=2, bf16=args.bf16, use_cpu=not torch.cuda.is_available(), report_to=[], disable_tqdm=True, seed=0,
        dataloader_num_workers=0)
    kwargs = {} if args.ddp else {"zerodp_config": zerodp.Config(stage=args.stage)}
    trainer = Trainer(model=model, args=targs, train_dataset=train, eval_dataset=val, **kwargs)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if args.log_json and trainer.args.process_index == 0:
        with open(args.log_json, "w") as f:
            json.dump(trainer.state.log_history, f)
    # Tear the process groups down before the interpreter does: gloo's threads otherwise
    # race the exit (and torch warns that destroy_process_group was not called).
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
