"""An Accelerate custom loop (transformers' examples/pytorch/language-modeling/
run_clm_no_trainer.py, shrunk) under the plain accelerate.Accelerator with DDP and under
zerodp.integrations.accelerate.Accelerator, launched by test_accelerate.py with torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/accelerate_cases.py OUT

(ACCELERATE_USE_CPU=1). Every rank writes what it saw to OUT/rank<r>.pt.

The loop is the example's: the model, then its optimizer over two weight-decay groups, then
the LR scheduler on that optimizer, then `accelerator.prepare(model, optimizer, train, eval,
scheduler)`; `with accelerator.accumulate(model):` around forward, `accelerator.backward`,
`accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)` at the boundary, `optimizer.step()`,
`scheduler.step()`, `optimizer.zero_grad()`; `accelerator.save_state` at step SAVE_AT; a
fresh run (another seed, new model, optimizer and Accelerator) that `load_state`s it and
goes on (`skip_first_batches`, the position kept with `register_for_checkpointing`); at the
end an evaluation through `gather_for_metrics`, and (stage 3) the example's
`accelerator.unwrap_model(model).save_pretrained(...)` on every rank.

The data: 4 token sequences A, B, C, D of a learnable sequence (x[t+1] = 5 x[t] + 3 mod 64)
repeated, so with batches of 2 every micro-batch of rank 0 is [A, B] and of rank 1 [C, D]:
every step trains on the same global batch and the loss falls step by step (the test's
bounds are held against that fall). An epoch is 5 micro-batches per rank: windows of 2, 2,
and a short one of 1 at its end (accelerate then steps after one backward, still dividing by
2). No dropout: each step's loss is a function of the weights alone.
"""
from __future__ import annotations

import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from accelerate import Accelerator as PlainAccelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler  # noqa: E402

import zerodp  # noqa: E402
from zerodp.integrations.accelerate import STAGING_DIR  # noqa: E402
from zerodp.integrations.accelerate import Accelerator as ZeroAccelerator  # noqa: E402

SEED, VOCAB, SEQ, BATCH, ACCUMULATION = 0, 64, 16, 2, 2
EPOCHS, SAVE_AT = 2, 4  # 3 steps an epoch (windows 2, 2, 1): 6 steps; the save after step 4
STEPS = 6
MAX_NORM = 1.0  # below the gradient's norm here: clipping acts at every step
LR = {"sgd": 0.05, "adamw": 1e-3}
WEIGHT_DECAY = 0.01
KINDS = {"sgd": (0, 1, 2, 3), "adamw": (1, 3)}  # the zerodp stages each optimizer runs at


def build_model() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))


class Sequences(torch.utils.data.Dataset):
    def __init__(self, count: int):
        starts = torch.tensor([1, 7, 20, 42])
        ids = torch.empty(4, SEQ, dtype=torch.long)
        ids[:, 0] = starts
        for t in range(1, SEQ):
            ids[:, t] = (5 * ids[:, t - 1] + 3) % VOCAB
        self.ids = ids.repeat((count + 3) // 4, 1)[:count]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class Position:
    """Where the loop is, kept in the checkpoint through register_for_checkpointing."""

    def __init__(self):
        self.epoch, self.batch, self.completed = 0, 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch, "completed": self.completed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch, self.completed = state["epoch"], state["batch"], state["completed"]


def make_accelerator(backend: str, stage: int):
    if backend == "ddp":
        return PlainAccelerator(gradient_accumulation_steps=ACCUMULATION)
    return ZeroAccelerator(gradient_accumulation_steps=ACCUMULATION, zerodp_config=zerodp.Config(stage=stage))


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    no_decay = ["bias", "ln_", "layer_norm"]  # run_clm_no_trainer's two groups
    groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
               "weight_decay": WEIGHT_DECAY},
              {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
               "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=LR["sgd"])
    return torch.optim.AdamW(groups, lr=LR["adamw"])


def run(backend: str, stage: int, kind: str, out: str, resume_from: str | None = None, record_grads: bool = False):
    """The loop; returns what it saw. `resume_from`: a save_state folder to go on from."""
    set_seed(SEED if resume_from is None else SEED + 1)  # a fresh run: only load_state can make it the same
    accelerator = make_accelerator(backend, stage)
    model = build_model()
    optimizer = make_optimizer(model, kind)
    train = torch.utils.data.DataLoader(Sequences(4 * 5), batch_size=BATCH)
    evaluation = torch.utils.data.DataLoader(Sequences(5), batch_size=BATCH)
    # run_clm_no_trainer counts scheduler steps in processes x optimizer steps (accelerate
    # steps a prepared scheduler once per process at each optimizer step); this one decays
    # to half the learning rate over the run.
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0,
                              num_training_steps=2 * STEPS * accelerator.num_processes)
    plain_optimizer = optimizer
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation,
                                                                         scheduler)
    position = Position()
    accelerator.register_for_checkpointing(position)
    seen = {"prepared": {"model": type(model).__name__, "unwrapped_is_model": accelerator.unwrap_model(model) is model,
                         "optimizer": type(optimizer).__name__,
                         "inner": type(getattr(optimizer, "optimizer", optimizer)).__name__,
                         "scheduler_on": type(scheduler.scheduler.optimizer).__name__,
                         "scheduler_on_prepared": scheduler.scheduler.optimizer is optimizer.optimizer,
                         "script_optimizer_kept": getattr(optimizer.optimizer, "inner", optimizer.optimizer)
                         is plain_optimizer}}
    if resume_from is not None:
        accelerator.load_state(resume_from)
        seen["rng"] = rng_states()
    losses, norms, lrs, grads = {}, {}, {}, {}  # by step (losses: by step, epoch and micro-batch)
    for epoch in range(position.epoch, EPOCHS):
        model.train()
        skip = position.batch if epoch == position.epoch else 0
        for i, batch in enumerate(accelerator.skip_first_batches(train, skip) if skip else train, start=skip):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                losses[(position.completed, epoch, i)] = loss.item()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if record_grads:  # DDP's reduced gradient before clipping
                        grads[position.completed] = {n: p.grad.detach().clone() for n, p in
                                                     accelerator.unwrap_model(model).named_parameters()}
                    norms[position.completed] = float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM))
                if accelerator.sync_gradients:  # the rates this step runs at: the scheduler's, in the optimizer
                    lrs[position.completed] = [group["lr"] for group in optimizer.param_groups]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                position.completed += 1
                position.epoch, position.batch = (epoch, i + 1) if i + 1 < len(train) else (epoch + 1, 0)
                if position.completed == SAVE_AT and resume_from is None:
                    folder = os.path.join(out, f"{backend}-{stage}-{kind}", f"step_{SAVE_AT}")
                    accelerator.save_state(folder)
                    seen["rng"] = rng_states()
                    seen["saved"] = (sorted(os.listdir(os.path.dirname(folder))), sorted(os.listdir(folder)))
    model.eval()
    gathered = []
    for batch in evaluation:
        with torch.no_grad():
            loss = model(**batch).loss
        gathered.append(accelerator.gather_for_metrics(loss.repeat(BATCH)))
    seen.update(losses=losses, norms=norms, lrs=lrs, grads=grads, eval=torch.cat(gathered),
                final={k: v.detach().clone() for k, v in accelerator.get_state_dict(model).items()})
    if backend == "zerodp" and stage == 3 and resume_from is None:  # run_clm_no_trainer's last lines
        accelerator.wait_for_everyone()
        accelerator.unwrap_model(model).save_pretrained(os.path.join(out, f"pretrained-{stage}-{kind}"),
                                                        is_main_process=accelerator.is_main_process,
                                                        save_function=accelerator.save)
    accelerator.wait_for_everyone()
    return seen


def rng_states() -> tuple:
    """This process's random states (torch, python, numpy), read without drawing."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return torch.get_rng_state(), random.getstate(), (name, keys.tolist(), pos, has_gauss, cached)


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "no error"


def refusals(root: str) -> dict:
    """What is refused, at once and on every rank, before anything is wrapped or sharded; and
    a save over a folder that exists, beside what a killed save left."""
    out = {}
    accelerator = make_accelerator("zerodp", 1)
    model = build_model()
    model, optimizer = accelerator.prepare(model, make_optimizer(model, "sgd"))
    # plain accelerate's folder of the DDP run: no zerodp/, so nothing to load the shards from
    out["load_plain_folder"] = error_of(lambda: accelerator.load_state(os.path.join(root, "ddp-0-sgd",
                                                                                    f"step_{SAVE_AT}")))
    target = os.path.join(root, "resave", "checkpoint")
    if accelerator.is_main_process:
        os.makedirs(os.path.join(root, "resave", STAGING_DIR, "checkpoint"))
        open(os.path.join(root, "resave", STAGING_DIR, "checkpoint", "half-written"), "w").close()
        os.makedirs(target)
        open(os.path.join(target, "from-before"), "w").close()
    accelerator.wait_for_everyone()
    accelerator.save_state(target)
    out["resaved"] = (sorted(os.listdir(os.path.dirname(target))), sorted(os.listdir(target)))
    model = build_model()
    # A scheduler built on the optimizer but left out of prepare could not follow zerodp's optimizer.
    optimizer = make_optimizer(model, "sgd")
    get_scheduler("linear", optimizer=optimizer, num_warmup_steps=1, num_training_steps=4)
    out["scheduler_left_out"] = error_of(lambda: make_accelerator("zerodp", 1).prepare(model, optimizer))
    # The plain Accelerator given a model zerodp.initialize returned: never DDP.
    model, optimizer = zerodp.initialize(build_model(), torch.optim.SGD, zerodp.Config(stage=1), lr=0.1)
    plain = PlainAccelerator(gradient_accumulation_steps=ACCUMULATION)
    out["plain_accelerator"] = error_of(lambda: plain.prepare(model, optimizer))
    out["plain_ddp_direct"] = error_of(lambda: nn.parallel.DistributedDataParallel(model))
    return out


def main(out: str) -> None:
    results = {}
    for kind, stages in KINDS.items():
        results[("ddp", kind)] = run("ddp", 0, kind, out, record_grads=True)
        for stage in stages:
            results[(stage, kind)] = run("zerodp", stage, kind, out)
            results[(stage, kind, "resumed")] = run("zerodp", stage, kind, out,
                                                    os.path.join(out, f"zerodp-{stage}-{kind}", f"step_{SAVE_AT}"))
    # Another stage goes on from stage 1's checkpoint.
    results[(3, "sgd", "from stage 1")] = run("zerodp", 3, "sgd", out, os.path.join(out, "zerodp-1-sgd",
                                                                                    f"step_{SAVE_AT}"))
    results["refusals"] = refusals(out)
    results["numel"] = sum(p.numel() for p in build_model().parameters())
    results["out"] = out
    rank = int(os.environ["RANK"])
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
