"""A LoRA fine-tune with zerodp stage 3: the frozen base sharded, the adapters trained,
saved the natural way, and merged one unit at a time.

    pip install "zerodp[hf]" peft
    zerodp launch --nproc 2 examples/lora_finetune.py --steps 20
    zerodp launch --nproc 2 examples/lora_finetune.py --steps 20 --sft   # through TRL's SFTTrainer

A Llama built from a small config (nothing downloaded; in practice `from_pretrained`),
its base cast to bf16 and frozen, LoRA (peft) on every attention and MLP projection in
fp32, trained on the bundled corpus (byte-level, vocab 256). Writes, under --output-dir:
`adapters/` (PeftModel.save_pretrained, loadable by PeftModel.from_pretrained) and
`merged/` (the base with the adapters merged in, loadable by from_pretrained).
"""
import argparse
import os

import torch

import zerodp
from zerodp.demo.data import load_splits


def build_model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    base = base.to(torch.bfloat16)  # the frozen base in 16 bits; peft keeps the adapters in fp32
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(base, lora), lora


def windows(data, seq, count, seed):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq - 1, (count,), generator=g)
    return [data[s: s + seq].long() for s in starts]


def plain_loop(args, rank):
    model, _ = build_model()
    model, opt = zerodp.initialize(model, torch.optim.AdamW, zerodp.Config(stage=3), lr=1e-3)
    report = opt.memory_report()
    if rank == 0:
        print(f"per rank: frozen base {report.frozen_params / 2**10:.1f} KiB (sharded), trainable model state "
              f"{(report.params + report.grads + report.master + report.optimizer_states) / 2**10:.1f} KiB")
    data = windows(load_splits().train, 32, args.steps * 2, seed=rank)
    for step in range(args.steps):
        batch = torch.stack(data[2 * step: 2 * step + 2])
        loss = model(input_ids=batch, labels=batch).loss
        opt.backward(loss)
        opt.clip_grad_norm_(1.0)
        opt.step()
        model.zero_grad(set_to_none=True)
        if rank == 0 and step % 5 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    # Every rank calls it, as the Trainer and accelerate do; the main process writes.
    model.save_pretrained(os.path.join(args.output_dir, "adapters"), is_main_process=rank == 0)
    from zerodp.integrations.peft import save_merged
    save_merged(model, os.path.join(args.output_dir, "merged"), opt)


def sft(args):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from trl import SFTConfig, SFTTrainer

    from zerodp.integrations.hf import with_zerodp

    model, lora = build_model()
    base = model.unload()  # SFTTrainer applies the peft_config itself
    vocab = {f"b{i}": i for i in range(254)} | {"<pad>": 254, "</s>": 255}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                        pad_token="<pad>", eos_token="</s>")
    data = Dataset.from_dict({"input_ids": [w.tolist() for w in windows(load_splits().train, 32, 256, seed=1)]})
    targs = SFTConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=2,
                      learning_rate=1e-3, logging_steps=5, save_strategy="no", report_to=[], bf16=False,
                      use_cpu=not torch.cuda.is_available(), disable_tqdm=True, packing=False)
    trainer = with_zerodp(SFTTrainer)(model=base, args=targs, train_dataset=data, processing_class=tokenizer,
                                      peft_config=lora, zerodp_config=zerodp.Config(stage=3))
    trainer.train()
    trainer.save_model(os.path.join(args.output_dir, "adapters"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--output-dir", default="runs/lora_finetune")
    p.add_argument("--sft", action="store_true", help="train through TRL's SFTTrainer (with_zerodp)")
    args = p.parse_args()
    rank, _ = zerodp.init_distributed()
    if args.sft:
        sft(args)
    else:
        plain_loop(args, rank)
    zerodp.shutdown_distributed()


if __name__ == "__main__":
    main()
