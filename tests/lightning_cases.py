"""Lightning's Trainer and Fabric with zerodp's strategies, launched by test_lightning.py with torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/lightning_cases.py OUT
    python -m torch.distributed.run --standalone --nproc_per_node 1 tests/lightning_cases.py OUT resume

Every rank writes what it saw to OUT/rank<r>.pt (the second form: OUT/resumed-n1.pt).

The Trainer runs one LightningModule (an MLP, `Net`) for 2 epochs of 2 optimizer steps:
accumulate_grad_batches=2, gradient_clip_val=1.0 (it clips at every step), SGD with momentum
and a per-step StepLR from configure_optimizers; under Lightning's "ddp" and under zerodp at
stages 1, 2 and 3, in fp32, and under manual optimization (stage 1); a stage-3 run saved by
trainer.save_checkpoint after epoch 1 (and by a ModelCheckpoint every step), resumed by a fresh
Trainer with fit(ckpt_path=...) and validated from it; one step at "bf16-mixed" and
"bf16-true" under both; the registered names and the refusals. Fabric runs the same model and data in its own loop
(no_backward_sync, fabric.backward, fabric.clip_gradients, fabric.save after epoch 1 and
fabric.load in a fresh run) under "ddp" and zerodp at stage 3. The second form resumes the
N=2 stage-3 checkpoint in one process at stage 1, with the global batch in one micro-batch.

The data: 8 samples; rank 0's micro-batches all hold samples 0-3 and rank 1's samples 4-7
(one process: all 8), so every step trains on the same global batch and the two micro-batches
of a window are the same: zerodp's per-micro-batch reduction (stages 2-3) sums what DDP sums.
No dropout: a loss is a function of the weights alone.
"""
from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

import zerodp  # noqa: E402
from zerodp.integrations.lightning import ZeroFabricStrategy, ZeroStrategy  # noqa: E402

SEED, IN, HIDDEN, OUT, BATCH = 0, 16, 32, 4, 4
ACCUMULATION, MAX_NORM, LR, MOMENTUM, GAMMA = 2, 1.0, 0.05, 0.9, 0.7
EPOCHS, STEPS_PER_EPOCH = 2, 2
STAGES = (1, 2, 3)


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, IN, generator=g) * 3, torch.randint(0, OUT, (8,), generator=g)


class Data(Dataset):
    """32 items; item i is sample (i % 2) * 4 + (i // 2) % 4, so a DistributedSampler of 2
    (no shuffle) gives rank 0 samples 0-3 and rank 1 samples 4-7 in every batch of 4, and one
    process all 8 in every batch of 8. (The Trainer's own sampler would shuffle: `loader`.)"""

    def __init__(self):
        self.x, self.y = samples()

    def __len__(self) -> int:
        return 2 * BATCH * ACCUMULATION * STEPS_PER_EPOCH  # 2 epochs' steps of 2 ranks

    def __getitem__(self, i: int):
        j = (i % 2) * 4 + (i // 2) % 4
        return self.x[j], self.y[j]


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.seen = {"losses": [], "norms": [], "lrs": [], "sync": [], "dtypes": set(), "val": []}

    def forward(self, x):
        return self.body(x)

    def on_train_start(self):
        self.seen["model"] = type(self.trainer.strategy.model).__name__  # DDP's wrapper is gone after fit

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen["sync"].append(getattr(self, "require_backward_grad_sync", None))
        logits = self(x)
        self.seen["dtypes"].add(str(logits.dtype))
        loss = F.cross_entropy(logits.float(), y)
        self.seen["losses"].append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.seen["val"].append(F.cross_entropy(self(x), y).item())

    def on_before_optimizer_step(self, optimizer):
        if self.automatic_optimization:  # Lightning clips after this hook
            self.record_step(optimizer)

    def record_step(self, optimizer):
        """Before clipping: the reduced gradient's norm, read through torch's utility."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.seen["norms"].append(float(torch.nn.utils.get_total_norm(grads)))
        self.seen["lrs"].append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ManualNet(Net):
    """The same training under manual optimization: toggle_model(sync_grad=...) around the
    forward and manual_backward of each micro-batch, inside the step (after the model's own
    call began), and the layers called directly, not through self(x): the backward goes by
    the flag as toggle_model left it."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        boundary = batch_idx % ACCUMULATION == ACCUMULATION - 1
        x, y = batch
        with optimizer.toggle_model(sync_grad=boundary):
            self.seen["sync"].append(getattr(self, "require_backward_grad_sync", None))
            loss = F.cross_entropy(self.body(x), y)
            self.seen["losses"].append(loss.item())
            self.manual_backward(loss / ACCUMULATION)
        if boundary:
            self.record_step(optimizer)
            self.clip_gradients(optimizer, gradient_clip_val=MAX_NORM, gradient_clip_algorithm="norm")
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def trainer(strategy, epochs: int = EPOCHS, devices: int = 2, manual: bool = False, **kwargs) -> L.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs,
                     accumulate_grad_batches=1 if manual else ACCUMULATION,
                     gradient_clip_val=None if manual else MAX_NORM, logger=False, use_distributed_sampler=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def loader(devices: int, batch: int) -> DataLoader:
    """Each rank's share in order, as the module docstring says (the Trainer's own sampler
    would shuffle)."""
    rank = int(os.environ.get("RANK", 0))
    return DataLoader(Data(), batch_size=batch,
                      sampler=DistributedSampler(Data(), num_replicas=devices, rank=rank, shuffle=False))


def full_weights(model: nn.Module, optimizer) -> dict:
    if optimizer is None:
        return {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {k: v.float() for k, v in zerodp.full_state_dict(model, optimizer).items()}


def fit(strategy, ckpt_path=None, save_to=None, epochs: int = EPOCHS, devices: int = 2,
        batch: int = BATCH, manual: bool = False, validate=None, **kwargs) -> dict:
    """One Trainer run of a fresh Net (seeded: the same initial weights every time)."""
    L.seed_everything(SEED, verbose=False)
    net = ManualNet() if manual else Net()
    t = trainer(strategy, epochs=epochs, devices=devices, manual=manual, **kwargs)
    t.fit(net, loader(devices, batch), ckpt_path=ckpt_path)
    if save_to is not None:
        t.save_checkpoint(save_to)
    zero = getattr(t.strategy, "zerodp_optimizer", None)
    scheduler = t.lr_scheduler_configs[0].scheduler
    seen = {**net.seen, "final": full_weights(net, zero), "numel": sum(p.numel() for p in mlp().parameters()),
            "optimizer": type(t.optimizers[0]).__name__,
            "scheduler_on_trained": scheduler.optimizer is (zero or t.optimizers[0]),
            "param_dtype": str(next(net.parameters()).dtype)}
    if zero is not None:
        seen["config"] = zero.config
        seen["master_dtype"] = str(zero.inner.param_groups[0]["params"][0].dtype)
        seen["ledger"] = zero.comm.ledger.summary()
    if validate is not None:  # the same Trainer and (sharded) model, the weights of a checkpoint
        t.validate(net, loader(devices, batch), ckpt_path=validate, verbose=False)
    return seen


def validate_plain(strategy, ckpt: str) -> list:
    """trainer.validate(ckpt_path=...) of a fresh Net: the plain model gets the checkpoint's
    weights whole (zerodp.consolidate) and evaluates as under DDP."""
    net = Net()
    trainer(strategy).validate(net, loader(2, BATCH), ckpt_path=ckpt, verbose=False)
    return net.seen["val"]


def fabric_run(strategy, out: str, save_after=None, load_from=None) -> dict:
    """Fabric's loop: the same model, data, accumulation, clipping and schedule as the Trainer's."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(SEED, verbose=False)
    model = mlp()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    loader = fabric.setup_dataloaders(DataLoader(Data(), batch_size=BATCH))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    seen = {"losses": [], "norms": [], "lrs": []}
    if load_from is not None:
        left = fabric.load(load_from, state)
        assert not left, left
        loaded = full_weights(model.module, fabric.strategy.zerodp_optimizer)
        everything = fabric.load(load_from)  # no state: the model's weights whole, the other entries
        seen["everything"] = (sorted(everything), everything["step"],
                              all(torch.equal(everything["model"][k].float(), v) for k, v in loaded.items()))
        try:
            fabric.load_raw(load_from, model)
        except ValueError as e:
            seen["load_raw"] = str(e)
    for _epoch in range(state["step"] // STEPS_PER_EPOCH, EPOCHS):
        for i, (x, y) in enumerate(loader):
            boundary = i % ACCUMULATION == ACCUMULATION - 1
            with fabric.no_backward_sync(model, enabled=not boundary):
                loss = F.cross_entropy(model(x), y)
                fabric.backward(loss / ACCUMULATION)
            seen["losses"].append(loss.item())
            if boundary:
                seen["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)))
                seen["lrs"].append(optimizer.param_groups[0]["lr"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                state["step"] += 1
        if save_after is not None and state["step"] == save_after:
            fabric.save(os.path.join(out, "fabric.ckpt"), state)
    zero = getattr(fabric.strategy, "zerodp_optimizer", None)
    seen["final"] = full_weights(model.module, zero)
    seen["model"] = type(model._forward_module).__name__
    return seen


def refusals() -> dict:
    """What the strategies refuse, each when the Trainer or Fabric is built (no collective)."""
    scaler = torch.amp.GradScaler("cpu")
    cases = {
        "16-mixed": lambda: trainer(ZeroStrategy(), plugins=[MixedPrecision("16-mixed", "cpu", scaler)]),
        "16-true": lambda: trainer(ZeroStrategy(), precision="16-true"),
        "64-true": lambda: trainer(ZeroStrategy(), precision="64-true"),
        "fp16 config": lambda: trainer(ZeroStrategy(zerodp.Config(mixed_precision="fp16")), precision="32-true"),
        "bf16 config at 32-true": lambda: trainer(ZeroStrategy(zerodp.Config(mixed_precision="bf16"))),
        "grad_accumulation_steps": lambda: ZeroStrategy(zerodp.Config(grad_accumulation_steps=2)),
        "ddp option": lambda: ZeroStrategy(find_unused_parameters=True),
        "fabric ddp option": lambda: ZeroFabricStrategy(zerodp.Config(stage=3), static_graph=True),
        "fabric 16-true": lambda: Fabric(accelerator="cpu", devices=2, strategy=ZeroFabricStrategy(),
                                         precision="16-true"),
    }
    out = {}
    for name, build in cases.items():
        try:
            build()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def registered() -> dict:
    t = trainer("zerodp_stage_3")
    f = Fabric(accelerator="cpu", devices=2, strategy="zerodp")
    return {"trainer": (type(t.strategy).__name__, t.strategy.zerodp_config.stage),
            "fabric": (type(f.strategy).__name__, f.strategy.zerodp_config.stage)}


def main(out: str) -> None:
    seen = {"registered": registered(), "refusals": refusals(), "ddp": fit("ddp")}
    for stage in STAGES:
        config = zerodp.Config(stage=stage, **({"unit_modules": (nn.Linear,)} if stage == 3 else {}))
        seen[stage] = fit(ZeroStrategy(config))
    stage3 = zerodp.Config(stage=3, unit_modules=(nn.Linear,))
    ckpt = os.path.join(out, "epoch1.ckpt")
    every_step = ModelCheckpoint(dirpath=os.path.join(out, "every-step"), every_n_train_steps=1, save_top_k=1)
    seen["first epoch"] = fit(ZeroStrategy(stage3), save_to=ckpt, epochs=1, enable_checkpointing=True,
                              callbacks=[every_step])
    seen["resumed"] = fit(ZeroStrategy(stage3), ckpt_path=ckpt, validate=ckpt)
    seen["validated"] = validate_plain(ZeroStrategy(stage3), ckpt)
    seen[("manual", "ddp")] = fit("ddp", manual=True)
    seen[("manual", 1)] = fit(ZeroStrategy(zerodp.Config(stage=1)), manual=True)
    for precision in ("bf16-mixed", "bf16-true"):
        seen[("ddp", precision)] = fit("ddp", precision=precision, max_steps=1)
        seen[(2, precision)] = fit(ZeroStrategy(zerodp.Config(stage=2)), precision=precision, max_steps=1)
    seen[("fabric", "ddp")] = fabric_run("ddp", out)
    seen[("fabric", 3)] = fabric_run(ZeroFabricStrategy(stage3), out, save_after=STEPS_PER_EPOCH)
    seen[("fabric", 3, "resumed")] = fabric_run(ZeroFabricStrategy(stage3), out,
                                                load_from=os.path.join(out, "fabric.ckpt"))
    seen["checkpoint files"] = {name: sorted(os.listdir(os.path.join(out, name)))
                                for name in ("epoch1.ckpt", "every-step", "fabric.ckpt")}
    torch.save(seen, os.path.join(out, f"rank{torch.distributed.get_rank()}.pt"))


def resume_in_one_process(out: str) -> None:
    """The N=2 stage-3 checkpoint after epoch 1, resumed at N=1, stage 1, batch 8."""
    seen = fit(ZeroStrategy(zerodp.Config(stage=1)), ckpt_path=os.path.join(out, "epoch1.ckpt"), devices=1,
               batch=2 * BATCH)
    torch.save(seen, os.path.join(out, "resumed-n1.pt"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[2:] == ["resume"]:
        resume_in_one_process(sys.argv[1])
    else:
        main(sys.argv[1])
