"""zerodp's Hugging Face Trainer (zerodp.integrations.hf.Trainer) against the plain
transformers.Trainer under torch DDP, inside one spawned world of 2 ranks
(test_hf_trainer.py): the grid of stages 0-3 x reduce_each_micro_batch x fp32/bf16, the
Trainer under tensor parallelism, and a run that fails while it saves a checkpoint.

Every run: a tiny Llama built from a config (nothing downloaded) from seed 0; a dataset of 8
random token windows, which is one step's batch (2 ranks x 2 sequences x 2 micro-batches), so
every step trains on the same 8 sequences (grouped differently each epoch): a gradient kept
from one step into the next then doubles the step, which the losses show; plain SGD (a wrong
gradient scale shows, where Adam would hide it); clipping computed at every step (the norm is
logged) but above the norm, so that it cannot hide a doubled gradient.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

import zerodp  # noqa: E402
from zerodp.integrations.hf import STAGING_DIR  # noqa: E402
from zerodp.integrations.hf import Trainer as ZeroTrainer  # noqa: E402

VOCAB, SEQ, EVAL_SAMPLES = 256, 16, 10
WORLD, BATCH, ACCUMULATION, STEPS = 2, 2, 2, 3  # BATCH: sequences per rank and micro-batch
SAMPLES = WORLD * BATCH * ACCUMULATION  # one step's batch: an epoch per step
# 3 micro-batches per rank and epoch: each epoch's second window is 1 micro-batch long (the
# Trainer then divides by 1, and zerodp's window must end there).
SHORT_WINDOW_SAMPLES = WORLD * BATCH * (ACCUMULATION + 1)
# fp32 trains (lr 0.5); bf16 does not move its weights (lr 0), so every one of its steps
# compares a forward and backward at the same weights (test_hf_trainer.py says why).
LR = {"fp32": 0.5, "bf16": 0.0}
MAX_NORM = 10.0
STAGES = (0, 1, 2, 3)
# Stages 0-1 reduce once per window whatever reduce_each_micro_batch says (the engine's own
# rule): one run each; the flag is a grid axis at stages 2-3 only. bf16 runs the three ways
# its gradients can travel: all-reduced once per window (stage 0; stage 1 is the same hook
# with a reduce-scatter, run in fp32), kept in autograd's bf16 across micro-batches (stage 2
# at the boundary) and reduced into shards every micro-batch (stage 3).
FP32_GRID = tuple((stage, each, "fp32") for stage in STAGES for each in ((True, False) if stage >= 2 else (True,)))
GRID = FP32_GRID + ((0, True, "bf16"), (2, False, "bf16"), (3, True, "bf16"))
FAULT_STAGE = 1  # the checkpoint fault: a stage whose steps match DDP's whatever the engine's clearing


class Windows(torch.utils.data.Dataset):
    """`count` random token windows (input_ids = labels: the model shifts them itself)."""

    def __init__(self, count: int, seed: int):
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def build_model() -> LlamaForCausalLM:
    transformers.set_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))


def numel() -> int:
    return sum(p.numel() for p in build_model().parameters())


def arguments(out: str, precision: str = "fp32", **changes) -> TrainingArguments:
    fields = dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
                  gradient_accumulation_steps=ACCUMULATION, optim="sgd", learning_rate=LR[precision],
                  lr_scheduler_type="constant", max_grad_norm=MAX_NORM, logging_steps=1, save_strategy="no",
                  report_to=[], disable_tqdm=True, seed=0, data_seed=0, use_cpu=True, dataloader_num_workers=0,
                  bf16=precision == "bf16")
    fields.update(changes)
    return TrainingArguments(**fields)


def history(trainer) -> dict:
    """Per step: the loss and gradient norm the Trainer logged; the eval losses by step."""
    out = {"loss": {}, "grad_norm": {}, "eval_loss": {}}
    for entry in trainer.state.log_history:
        for key in out:
            if key in entry:
                out[key][entry["step"]] = float(entry[key])
    return out


def trainer_for(out: str, config=None, precision: str = "fp32", evaluate: bool = False, samples: int = SAMPLES,
                **changes):
    """zerodp's Trainer with `config`, else the plain one (DDP)."""
    args = arguments(out, precision, **changes)
    data = {"train_dataset": Windows(samples, seed=1)}
    if evaluate:
        data["eval_dataset"] = Windows(EVAL_SAMPLES, seed=2)
    if config is None:
        return transformers.Trainer(model=build_model(), args=args, **data)
    return ZeroTrainer(model=build_model(), args=args, zerodp_config=config, **data)


def run(out: str, config=None, precision: str = "fp32", evaluate: bool = False, samples: int = SAMPLES,
        **changes) -> dict:
    """`evaluate`: once before the first step (the eval loss at step 0), at the weights both
    runs start from."""
    if evaluate:
        changes.update(eval_on_start=True, eval_strategy="no")
    trainer = trainer_for(out, config, precision, evaluate, samples, **changes)
    trainer.train()
    return history(trainer)


class SaveFault(RuntimeError):
    """Stands for the process dying while the Trainer writes a checkpoint."""


def interrupted_save(root: str) -> dict:
    """Save every step; the save of checkpoint-2 fails after the model and zerodp's shards are
    written, before the Trainer's RNG and state files (every rank alike, as a job killed
    there). Then a fresh Trainer resumes with resume_from_checkpoint=True; a `checkpoint-9`
    holding a model and no Trainer state (a kill before saves were atomic) lies there too."""
    out = os.path.join(root, "fault")
    config = zerodp.Config(stage=FAULT_STAGE, reduce_each_micro_batch=True)
    trainer = trainer_for(out, config, save_strategy="steps", save_steps=1)
    save_rng = trainer._save_rng_state

    def failing(output_dir):
        if trainer.state.global_step == 2:
            raise SaveFault("killed while saving checkpoint-2")
        return save_rng(output_dir)
    trainer._save_rng_state = failing
    try:
        trainer.train()
        failed = "no error"
    except SaveFault as e:
        failed = str(e)
    left = sorted(os.listdir(out))
    staging = os.path.join(out, STAGING_DIR)
    staged = sorted(os.listdir(staging)) if os.path.isdir(staging) else []
    torch.distributed.barrier()
    if int(os.environ["RANK"]) == 0:
        os.makedirs(os.path.join(out, "checkpoint-9"))
        with open(os.path.join(out, "checkpoint-9", "model.safetensors"), "wb") as f:
            f.write(b"half a model")
    torch.distributed.barrier()
    resumed = trainer_for(out, config, save_strategy="steps", save_steps=1)
    resumed.train(resume_from_checkpoint=True)
    return {"failed": failed, "left": left, "staged": staged, "resumed": history(resumed),
            "after": sorted(os.listdir(out))}


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(Windows(SAMPLES, seed=1))


def refusals(root: str) -> dict:
    """Tensor parallelism the Trainer cannot serve: refused with the fix named, on every rank."""
    from tp_slices import error_of

    out = os.path.join(root, "refused")
    stream = trainer_for(out, zerodp.Config(tensor_parallel_size=WORLD))
    stream.train_dataset = Stream()
    return {"divide": error_of(lambda: trainer_for(out, zerodp.Config(tensor_parallel_size=3))),
            "dispatch": error_of(stream.get_train_dataloader)}


def tensor_parallel_resume(root: str) -> dict:
    """The Trainer under tensor parallelism (one data-parallel rank of WORLD) saving every step,
    then a fresh Trainer resuming from checkpoint-1: the steps after it, as the run went."""
    config = zerodp.Config(stage=2, tensor_parallel_size=WORLD)
    out = os.path.join(root, "tp-ckpt")
    first = trainer_for(out, config, save_strategy="steps", save_steps=1)
    first.train()
    listing = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    resumed = trainer_for(os.path.join(root, "tp-resumed"), config)
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
    return {"full": history(first), "resumed": history(resumed), "listing": listing}


def _distributed_env(rank: int, world_size: int) -> None:
    """What torchrun would set: accelerate reads it (the process group exists already)."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})


def trainer_world(rank: int, world_size: int, root: str) -> dict:
    _distributed_env(rank, world_size)
    out = {"ddp": {p: run(os.path.join(root, f"ddp-{p}"), precision=p, evaluate=p == "fp32")
                   for p in ("fp32", "bf16")}}
    for stage, each, precision in GRID:
        config = zerodp.Config(stage=stage, reduce_each_micro_batch=each or stage < 2)  # stages 0-1 reduce once anyway
        out[(stage, each, precision)] = run(os.path.join(root, f"z{stage}-{each}-{precision}"), config, precision)
    out["short"] = {"ddp": run(os.path.join(root, "short-ddp"), samples=SHORT_WINDOW_SAMPLES),
                    "zerodp": run(os.path.join(root, "short-z3"), zerodp.Config(stage=3, reduce_each_micro_batch=False),
                                  samples=SHORT_WINDOW_SAMPLES)}
    # Tensor parallelism over both ranks: one data-parallel rank reads the whole global batch
    # (twice the per-device batch), as DDP's two ranks read it together.
    out["tp"] = run(os.path.join(root, "tp"), zerodp.Config(stage=2, tensor_parallel_size=WORLD), evaluate=True,
                    per_device_train_batch_size=WORLD * BATCH, per_device_eval_batch_size=WORLD * BATCH)
    out["fault"] = interrupted_save(root)
    out["refusals"] = refusals(root)
    out["tp_resume"] = tensor_parallel_resume(root)
    out["numel"] = numel()
    return out
