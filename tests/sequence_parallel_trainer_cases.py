"""Cases for test_sequence_parallel_trainer.py: zerodp's Hugging Face Trainer and TRL's
SFTTrainer with sequence_parallel_size > 1 against the same trainer without it, on the same
ranks and the same global batch; and packed samples at the model, against one process.

The trainers' runs: a tiny Llama with grouped-query attention (4 heads, 2 key/value heads)
from a config, plain SGD at lr 0.5 (a wrong gradient scale shows), 2 micro-batches per step,
clipping computed every step but above the norm, 3 steps, the dataset one step's batch (an
epoch per step, as hf_trainer_cases). The reference, without sequence parallelism, runs on 2
ranks reading BATCH sequences each a micro-batch; with SP=2 the one group of N=2 reads 2 BATCH,
and the two groups of N=4 read BATCH each: every run trains on the same global batch.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402

import zerodp  # noqa: E402

VOCAB, SEQ, HIDDEN = 256, 16, 32
BATCH, ACCUMULATION, STEPS = 2, 2, 3
LR, MAX_NORM = 0.5, 10.0
SP = 2
EPOCH = 2 * BATCH * ACCUMULATION  # one step's global batch: 2 data-parallel ranks' worth


def build_model() -> transformers.LlamaForCausalLM:
    transformers.set_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def numel() -> int:
    return sum(p.numel() for p in build_model().parameters())


class PaddedWindows(torch.utils.data.Dataset):
    """`count` windows of SEQ tokens, each of 5 to SEQ real tokens and right padding
    (attention_mask 0, labels -100): the ranks' token counts differ, so a loss normalised by
    anything but the global batch's labelled-token count moves."""

    def __init__(self, count: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)
        self.lengths = torch.randint(5, SEQ + 1, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        real = torch.arange(SEQ) < self.lengths[i]
        ids = self.ids[i].masked_fill(~real, 0)
        return {"input_ids": ids, "attention_mask": real.long(), "labels": ids.masked_fill(~real, -100)}


def _distributed_env(rank: int, world_size: int) -> None:
    """What torchrun would set: accelerate reads it (the process group exists already)."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})


def _arguments(config_cls, out: str, batch: int, **extra):
    return config_cls(output_dir=out, max_steps=STEPS, per_device_train_batch_size=batch,
                      gradient_accumulation_steps=ACCUMULATION, optim="sgd", learning_rate=LR,
                      lr_scheduler_type="constant", max_grad_norm=MAX_NORM, logging_steps=1, save_strategy="no",
                      report_to=[], disable_tqdm=True, seed=0, data_seed=0, use_cpu=True, dataloader_num_workers=0,
                      bf16=False, **extra)


def _result(trainer) -> dict:
    """Per step the logged loss and gradient norm; the final parameters, whole."""
    out = {"loss": {}, "grad_norm": {}}
    for entry in trainer.state.log_history:
        for key in out:
            if key in entry:
                out[key][entry["step"]] = float(entry[key])
    out["params"] = {n: t.float() for n, t in zerodp.full_state_dict(trainer.model, trainer.optimizer).items()}
    return out


def trainer_case(rank: int, world_size: int, root: str, runs: tuple) -> dict:
    """zerodp's Trainer on EPOCH padded windows, once per (name, stage, sequence_parallel_size,
    per-device batch) of `runs`."""
    from zerodp.integrations.hf import Trainer

    _distributed_env(rank, world_size)
    out = {}
    for name, stage, sp, batch in runs:
        args = _arguments(transformers.TrainingArguments, os.path.join(root, name), batch)
        trainer = Trainer(model=build_model(), args=args, train_dataset=PaddedWindows(EPOCH),
                          zerodp_config=zerodp.Config(stage=stage, sequence_parallel_size=sp))
        trainer.train()
        out[name] = _result(trainer)
    return out


# Sample lengths that best-fit-decreasing packing (TRL's "bfd", max_length SEQ) puts two to a
# row: 8 rows, one step's batch at N=2 (2 ranks x BATCH rows x ACCUMULATION); one row holds 15
# tokens, so a flattened micro-batch can be odd and the collator pads it for SP=2.
SFT_LENGTHS = [12, 4, 11, 5, 10, 6, 9, 7, 8, 8, 13, 3, 14, 2, 9, 6]


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<pad>": VOCAB - 2, "</s>": VOCAB - 1})
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")),
                                                pad_token="<pad>", eos_token="</s>")


def sft_case(rank: int, world_size: int, root: str, stage: int) -> dict:
    """TRL's SFTTrainer (through with_zerodp) with packing (bfd, so padding-free: one row of
    packed samples per micro-batch, position_ids restarting at each sample), at `stage`, with
    sequence_parallel_size=world_size and without."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from zerodp.integrations.hf import with_zerodp

    _distributed_env(rank, world_size)
    g = torch.Generator().manual_seed(3)
    data = Dataset.from_dict({"input_ids": [torch.randint(0, VOCAB - 2, (n,), generator=g).tolist()
                                            for n in SFT_LENGTHS]})
    out = {}
    for sp in (1, world_size):
        args = _arguments(SFTConfig, os.path.join(root, f"sft-sp{sp}"), sp * BATCH, packing=True, max_length=SEQ,
                          shuffle_dataset=False)
        trainer = with_zerodp(SFTTrainer)(model=build_model(), args=args, train_dataset=data,
                                          processing_class=_tokenizer(),
                                          zerodp_config=zerodp.Config(stage=stage, sequence_parallel_size=sp))
        batch = next(iter(trainer.get_train_dataloader()))
        trainer.train()
        out[sp] = _result(trainer)
        out[sp]["batch"] = {"keys": sorted(batch), "length": batch["input_ids"].shape[-1],
                            "rows": batch["input_ids"].shape[0],
                            "samples": int((batch["position_ids"] == 0).sum())}
        out[sp]["pad_to_multiple_of"] = trainer.data_collator.pad_to_multiple_of
    return out


# -- packed samples at the model, against one process ---------------------------------------------
# sequence_parallel_cases' Llama (GQA: 4 heads, 2 key/value heads), rows, steps and SGD, so that
# test_sequence_parallel's SGD bound holds as derived there. Two rows of its SEQ = 16 tokens:
# the first packs samples of 5, 7 and 4 tokens, the second of 10 and 3 and three tokens of
# padding at position 0 (each a sample of its own, as TRL pads a padding-free row); labels -100
# at each sample's first token, as the collators give.
PACKED_POSITIONS = [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3],
                    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 0, 0, 0]]


def packed_batch(step: int) -> dict:
    import sequence_parallel_cases as spc

    positions = torch.tensor(PACKED_POSITIONS)
    ids = torch.randint(0, spc.VOCAB, positions.shape, generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids.masked_fill(positions == 0, -100), "position_ids": positions}


def packed_case(rank: int, world_size: int, stage: int, attn: str) -> dict:
    """sequence_parallel_cases.STEPS SGD steps on packed rows with sequence_parallel_size=
    world_size at `stage`, against one process on the same rows (transformers' own
    packed-sample mask: use_cache off, no attention_mask)."""
    import sequence_parallel_cases as spc

    ref = spc.build("llama", attn)
    ref_opt = spc.optimizer("sgd", ref.parameters())
    ref_losses = []
    for step in range(spc.STEPS):
        loss = ref(**packed_batch(step), use_cache=False).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    model, opt = zerodp.initialize(spc.build("llama", attn), lambda ps: spc.optimizer("sgd", ps),
                                   zerodp.Config(stage=stage, sequence_parallel_size=world_size))
    losses = []
    for step in range(spc.STEPS):
        loss = model(**packed_batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    with zerodp.gathered_parameters(model):
        want = dict(ref.named_parameters())
        errors = {n: spc.rel(p.detach(), want[n].detach()) for n, p in model.named_parameters()}
    return {"losses": losses, "ref_losses": ref_losses, "errors": errors}
