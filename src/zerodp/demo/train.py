"""The training job behind `zerodp train` (and `make demo`): the bundled GPT on the bundled
corpus, with ZeRO, one process per rank under torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m zerodp.demo.train --steps 250

`zerodp train` builds that command line; this module also runs alone (world size 1). Rank 0 shows
a progress bar and, at the end, a summary table, a sample, `summary.json` and `summary.png` in --out.
Every rank runs every forward (evaluation and generation too): under stage 3 each forward
gathers parameters, and a gather needs all ranks.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Optional

import torch

import zerodp
from zerodp.demo import data as zdata
from zerodp.memory import estimator
from zerodp.config import DTYPES, Config, ConfigError
from zerodp.config_world import WorldFacts
from zerodp.memory import formula_bytes
from zerodp.demo.models import GPT, PRESETS, Block, gpt_config

log = logging.getLogger("zerodp.demo.train")
console = logging.getLogger("zerodp.demo.train.console")

DEFAULT_STAGE = 3
PROMPT = "LOVE, n."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `zerodp train`; the launcher and the job parse the same ones."""
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help=f"ZeRO stage (default {DEFAULT_STAGE}, or the --config file's)")
    p.add_argument("--nproc", type=int, default=None,
                   help="world size: local processes (default: all GPUs with CUDA, else 2)")
    p.add_argument("--model", default="small", choices=sorted(PRESETS), help="GPT preset (default small)")
    p.add_argument("--precision", choices=sorted(DTYPES), default=None,
                   help="compute dtype (default fp32, or the --config file's)")
    p.add_argument("--steps", type=_positive_int, default=250, help="optimizer steps (default 250)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per rank per micro-batch")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="tokens per sequence (default: the preset's block size)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of AdamW (default 2e-3)")
    p.add_argument("--replicate-size", type=_rows, default=None,
                   help="hybrid sharding: rows of ranks that each hold a full copy, or 'nodes' (one per node)")
    p.add_argument("--grad-accum", type=_positive_int, default=None,
                   help="micro-batches per optimizer step (default 1, or the --config file's)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default OUT/ckpt)")
    p.add_argument("--ckpt-every", type=int, default=0,
                   help="save every N steps as well as at the end (default 0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--keep-last", type=_positive_int, default=None,
                   help="keep only the newest K complete checkpoints in --ckpt-dir (default: all)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the workers up to K times after one dies (torchrun's own mechanism), each time "
                        "resuming from the newest complete checkpoint; needs --ckpt-every")
    p.add_argument("--simulate-failure-at", type=_positive_int, default=None, metavar="STEP",
                   help="to try --max-restarts: rank 1 exits abruptly when it reaches STEP, in the first attempt")
    p.add_argument("--out", default=None, help="run directory for summary.json/png (default runs/<timestamp>)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--config", default=None, help="a zerodp Config as a .json/.yaml file")
    p.add_argument("--eval-every", type=int, default=None, help="val loss every N steps (default steps/10)")
    p.add_argument("--sample-tokens", type=int, default=200, help="bytes to generate at the end (0: none)")
    p.add_argument("--log-level", default="WARNING", help="logging level of the ranks (default WARNING)")


def to_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """`args` as a command line for this module, in full flag names: the launcher re-states
    the parsed flags rather than forwarding what the user typed, since torchrun's own parser
    would claim abbreviations and prefixes of its flags (--nproc, --ste, ...)."""
    out = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "nproc"):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value is False or value == action.default:
            continue
        flag = action.option_strings[-1]
        out += [flag] if value is True else [flag, str(value)]
    return out


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _rows(text: str):
    return "nodes" if text == "nodes" else _positive_int(text)


# The flags that set a Config field, by field: named when a flag's value is refused.
FLAG_OF_FIELD = {"stage": "--stage", "mixed_precision": "--precision", "grad_accumulation_steps": "--grad-accum",
                 "replicate_size": "--replicate-size"}


def build_config(args: argparse.Namespace) -> Config:
    """The run's Config: the --config file (if any), then the flags given explicitly."""
    cfg = Config.from_file(args.config) if args.config else Config(stage=DEFAULT_STAGE)
    changes = {}
    if args.stage is not None:
        changes["stage"] = args.stage
    if args.precision is not None:
        changes["mixed_precision"] = args.precision
    if args.grad_accum is not None:
        changes["grad_accumulation_steps"] = args.grad_accum
    if args.replicate_size is not None:
        changes["replicate_size"] = args.replicate_size
    try:
        cfg = dataclasses.replace(cfg, **changes)
    except ConfigError as e:  # the Config names a field; the user typed flags
        given = " ".join(f"{FLAG_OF_FIELD[k]} {v}" for k, v in changes.items())
        raise ConfigError(f"{f'--config {args.config} with ' if args.config else ''}{given}: {e}") from None
    if cfg.stage == 3 and not cfg.unit_modules:
        # One unit per transformer block: the natural gather granularity (as FSDP wraps blocks).
        cfg = dataclasses.replace(cfg, unit_modules=(Block,))
    return cfg


def builds_on_meta(cfg: Config) -> bool:
    """Stage 3 builds on the meta device (born sharded by initialize); tensor parallelism
    splits real weights, so it builds them whole."""
    return cfg.stage == 3 and cfg.tensor_parallel_size == 1


def standalone_world(cfg: Config, nproc: int) -> WorldFacts:
    """The world `zerodp train` starts: `nproc` ranks on this node (torchrun --standalone),
    building the model as `Job` does, for `check_world` before any rank is launched."""
    return WorldFacts(world_size=nproc, local_world_size=nproc, rank=0, node_rank=0,
                      device_type="cuda" if torch.cuda.is_available() else "cpu", model_on_meta=builds_on_meta(cfg))


def check_run(args: argparse.Namespace, cfg: Config) -> None:
    """What every rank of this job would fail on with these flags and this Config, as one
    ConfigError naming the field or flag and the fix: `zerodp train` calls it before it
    launches any rank, and each rank again, since this module also runs on its own."""
    tp = cfg.tensor_parallel_size
    if tp == 1:
        return
    if args.ckpt_every or args.resume or args.max_restarts:
        raise ConfigError(f"tensor_parallel_size={tp}: zerodp checkpoints do not hold tensor-parallel slices yet: "
                          f"run without --ckpt-every, --resume and --max-restarts")
    # The bundled GPT's plan keeps whole heads on each rank and splits the vocabulary's rows.
    gcfg = gpt_config(args.model)
    for name, value in (("n_head", gcfg.n_head), ("vocab_size", gcfg.vocab_size)):
        if value % tp:
            raise ConfigError(f"Config.tensor_parallel_size={tp}: --model {args.model} has {name}={value}, which "
                              f"does not split into {tp} equal parts: use a tensor_parallel_size that divides "
                              f"{value}, or another --model")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_step(path: str) -> Optional[int]:
    """The step of a checkpoint this job wrote (named by `checkpoint_name`), else None."""
    name = os.path.basename(os.path.normpath(path))
    number = name[len("step_"):] if name.startswith("step_") else ""
    return int(number) if number.isdigit() else None


def setup_logging(rank: int, level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING), stream=sys.stderr,
                        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s", force=True)
    # Rank 0's report to the user (summary table, sample, files written): plain lines on
    # stdout, apart from the rank-prefixed diagnostics on stderr.
    console.handlers.clear()
    console.propagate = False
    if rank == 0:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        console.addHandler(handler)
        console.setLevel(logging.INFO)
    else:
        console.addHandler(logging.NullHandler())


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warmup over the first 10% of steps, then cosine decay to peak/10 (nanoGPT)."""
    warmup = max(1, total // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def fmt_numel(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


class Job:
    """One training run on this rank: model, optimizer, data and the run's records."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank, self.world_size = zerodp.init_distributed()
        setup_logging(self.rank, args.log_level)
        if args.out is None:  # rank 0's clock names the run directory, for every rank and node
            from zerodp.distributed import Comm

            args.out = Comm().all_gather_object(os.path.join("runs", time.strftime("%Y%m%d-%H%M%S")))[0]
        if args.nproc is not None and args.nproc != self.world_size:
            log.warning("--nproc %d but the world has %d processes; using %d",
                        args.nproc, self.world_size, self.world_size)
        self.cfg = build_config(args)
        check_run(args, self.cfg)  # every rank raises the same, before any collective
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        else:
            self.device = torch.device("cpu")
        gcfg = gpt_config(args.model)
        self.block_size = args.block_size or gcfg.block_size
        if self.block_size > gcfg.block_size:
            gcfg = dataclasses.replace(gcfg, block_size=self.block_size)
        torch.manual_seed(args.seed)
        if builds_on_meta(self.cfg) and hasattr(zerodp, "init"):
            with zerodp.init(self.cfg):
                model = GPT(gcfg)
        else:
            model = GPT(gcfg).to(self.device)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        self.model, self.opt = zerodp.initialize(model, torch.optim.AdamW, self.cfg, params=groups,
                                                 lr=args.lr, betas=(0.9, 0.95))
        # Data by data-parallel rank: every rank of a tensor-parallel group reads the same
        # batches (without tensor parallelism these are the global rank and size).
        self.data_rank, self.data_size = self.opt.comm.rank, self.opt.comm.world_size
        self.splits = zdata.load_splits()
        self.start_step = 0
        self.losses: list[tuple[int, float]] = []
        self.val_losses: list[tuple[int, float]] = []
        self.steps_info: list[dict] = []
        self.ckpt_dir = args.ckpt_dir or os.path.join(args.out, "ckpt")
        self.last_ckpt: Optional[str] = None
        self.ckpt_error: Optional[str] = None
        if args.resume:
            self._resume()
        self.train_batches = zdata.TokenBatches(self.splits, "train", args.batch_size, self.block_size,
                                                seed=args.seed, rank=self.data_rank, world_size=self.data_size)
        # Skip the batches the resumed steps already consumed: the run continues the same stream.
        for _ in range(self.start_step * self.cfg.grad_accumulation_steps):
            next(self.train_batches)

    # -- checkpoints --------------------------------------------------------------------
    def _checkpoints_available(self) -> bool:
        return hasattr(zerodp, "save") and hasattr(zerodp, "load") and hasattr(zerodp, "latest")

    def _resume(self) -> None:
        if not self._checkpoints_available():
            raise RuntimeError("--resume needs zerodp checkpoints (zerodp.save/load/latest), "
                               "which this install lacks")
        path = zerodp.latest(self.ckpt_dir)
        if path is None:
            log.warning("no checkpoint in %s: starting from step 0", self.ckpt_dir)
            return
        extra = zerodp.load(path, self.model, self.opt) or {}
        self.start_step = int(extra.get("step", 0))
        self.losses = [tuple(x) for x in extra.get("losses", [])]
        self.val_losses = [tuple(x) for x in extra.get("val_losses", [])]
        if self.rank == 0:
            console.info("resumed from %s at step %d", path, self.start_step)

    def save(self, step: int) -> None:
        if self.cfg.tensor_parallel_size > 1:  # refused up front when asked for; the final one is skipped
            log.warning("tensor parallelism: zerodp checkpoints do not hold tensor-parallel slices yet; not saving "
                        "step %d", step)
            return
        if not self._checkpoints_available():
            if self.args.ckpt_dir or self.args.ckpt_every:
                log.warning("checkpoints are not available in this install: not saving step %d", step)
            return
        path = os.path.join(self.ckpt_dir, checkpoint_name(step))
        zerodp.save(path, self.model, self.opt, keep_last=self.args.keep_last, step=step,
                    losses=[list(x) for x in self.losses], val_losses=[list(x) for x in self.val_losses],
                    preset=self.args.model)
        self.last_ckpt = path

    # -- evaluation ---------------------------------------------------------------------
    def mean_over_ranks(self, value: torch.Tensor) -> float:
        """The mean over the data-parallel ranks (the ranks of a tensor-parallel group hold
        the same value)."""
        return float(self.opt.comm.sum_scalar(value.detach())) / self.data_size

    @torch.no_grad()
    def val_loss(self, iters: int = 4) -> float:
        self.model.eval()
        batches = zdata.TokenBatches(self.splits, "val", self.args.batch_size, self.block_size,
                                     seed=self.args.seed + 1, rank=self.data_rank, world_size=self.data_size)
        total = torch.zeros((), device=self.device)
        for _ in range(iters):
            x, y = next(batches)
            _, loss = self.model(x.to(self.device), y.to(self.device))
            total += loss.float()
        self.model.train()
        return self.mean_over_ranks(total / iters)

    @torch.no_grad()
    def sample(self, n_tokens: int) -> str:
        """Generate on every rank with the same seed (stage 3 gathers need all ranks)."""
        self.model.eval()
        gen = torch.Generator(device=self.device).manual_seed(self.args.seed)
        idx = zdata.encode(PROMPT)[None].to(self.device)
        out = self.model.generate(idx, n_tokens, temperature=0.8, top_k=40, generator=gen)
        self.model.train()
        return zdata.decode(out[0].cpu())

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> dict:
        from tqdm import tqdm

        args, cfg, ledger = self.args, self.cfg, self.opt.comm.ledger
        accum = cfg.grad_accumulation_steps
        eval_every = args.eval_every or max(1, args.steps // 10)
        tokens_per_step = args.batch_size * self.block_size * accum * self.data_size
        bar = tqdm(total=args.steps, initial=self.start_step, disable=self.rank != 0, desc="train",
                   dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
        not_step = set()  # ids of ledger records from evaluation, not from a training step
        t_start = time.perf_counter()
        for step in range(self.start_step, args.steps):
            t0 = time.perf_counter()
            for g in self.opt.param_groups:
                g["lr"] = lr_at(step, args.steps, args.lr)
            loss_sum = torch.zeros((), device=self.device)
            for _ in range(accum):
                x, y = next(self.train_batches)
                _, loss = self.model(x.to(self.device), y.to(self.device))
                self.opt.backward(loss)
                loss_sum += loss.detach().float()
            loss_val = self.mean_over_ranks(loss_sum / accum)
            self.opt.clip_grad_norm_(1.0)
            self.opt.step()
            self.opt.zero_grad()
            dt = time.perf_counter() - t0
            mem = self.opt.memory_report()
            records = [r for r in ledger.last_step if id(r) not in not_step]
            volume = ledger.volume(records)
            not_step.clear()
            self.losses.append((step, loss_val))
            self.steps_info.append({"step": step, "loss": loss_val, "seconds": dt,
                                    "model_state_nbytes": mem.model_state, "volume_numel": volume,
                                    "nbytes_by_link": ledger.summary(records)["nbytes_by_link"]})
            bar.set_postfix_str(f"loss {loss_val:.3f} | {tokens_per_step / dt:,.0f} tok/s | "
                                f"state/rank {fmt_bytes(mem.model_state)} | comm {fmt_numel(volume)} el",
                                refresh=False)
            bar.update(1)
            done = step + 1
            if done % eval_every == 0 or done == args.steps:
                n0 = len(ledger.current)
                self.val_losses.append((done, self.val_loss()))
                not_step.update(id(r) for r in ledger.current[n0:])
                if self.rank == 0:
                    bar.write(f"step {done}: train loss {loss_val:.3f}, val loss {self.val_losses[-1][1]:.3f}")
            if args.ckpt_every and done % args.ckpt_every == 0 and done != args.steps:
                self.save(done)
            if done == args.simulate_failure_at and self.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                                                      "0") == "0":
                log.error("rank 1: --simulate-failure-at %d: exiting abruptly", done)
                os._exit(17)
        bar.close()
        wall = time.perf_counter() - t_start
        try:
            self.save(args.steps)
        except Exception as e:  # a failed save raises on every rank (atomic); keep the run's record
            self.ckpt_error = f"{type(e).__name__}: {e}"
            log.error("final checkpoint not saved: %s", self.ckpt_error)
        text = self.sample(args.sample_tokens) if args.sample_tokens > 0 else ""
        return self.summarize(wall, text, tokens_per_step)

    # -- the record -----------------------------------------------------------------------
    def summarize(self, wall: float, text: str, tokens_per_step: int) -> dict:
        cfg, n = self.cfg, self.data_size  # ZeRO shards over the data-parallel ranks
        mem = self.opt.memory_report()
        psi = mem.numel
        pb = cfg.compute_dtype.itemsize
        gb = cfg.grad_reduce_dtype.itemsize
        master_b = 0 if cfg.compute_dtype == torch.float32 else 4
        state_b = 8  # AdamW's exp_avg and exp_avg_sq, fp32
        k = master_b + state_b  # the paper's K: 12 under bf16/fp16 (with the fp32 master), 8 under fp32
        steps_run = self.steps_info
        volumes = [s["volume_numel"] for s in steps_run]
        expected_factor = 3 if (cfg.stage == 3 and cfg.reshard_after_forward) else 2
        step_secs = sorted(s["seconds"] for s in steps_run)
        median = step_secs[len(step_secs) // 2] if step_secs else float("nan")
        first = self.losses[0][1] if self.losses else float("nan")
        tail = [v for _, v in self.losses[-10:]]
        return {
            "stage": cfg.stage, "world_size": self.world_size, "data_parallel_size": n, "model": self.args.model,
            "numel": psi,
            "mesh": {"replicate": self.opt.comm.topology.replicate_size, "shard": self.opt.comm.topology.shard_size},
            "precision": cfg.mixed_precision, "device": str(self.device.type),
            "backend": "nccl" if self.device.type == "cuda" else "gloo",
            "config": self.opt.config.to_dict(), "args": {k: v for k, v in vars(self.args).items()},
            "bytes_per_param": {"param": pb, "grad": gb, "k": k},
            "memory": mem.as_dict(),
            "memory_formula": formula_bytes(cfg.stage, mem.padded_numel, n, pb, gb, master_b, state_b),
            "memory_ddp": formula_bytes(0, psi, n, pb, gb, master_b, state_b),
            "model_state_formula_nbytes": estimator.model_state_bytes(psi, n, cfg.stage, k, pb, gb),
            "model_state_ddp_nbytes": estimator.model_state_bytes(psi, n, 0, k, pb, gb),
            "volume_numel_last_step": volumes[-1] if volumes else 0,
            "nbytes_by_link_last_step": steps_run[-1]["nbytes_by_link"] if steps_run else {},
            "volume_numel_expected": expected_factor * psi,
            "volume_factor": expected_factor,
            "loss": {"first": first, "last": sum(tail) / max(1, len(tail)),
                     "val_last": self.val_losses[-1][1] if self.val_losses else None},
            "losses": self.losses, "val_losses": self.val_losses,
            "model_state_per_step": [s["model_state_nbytes"] for s in steps_run],
            "volume_per_step": volumes,
            "wall_seconds": wall, "median_step_seconds": median,
            "tokens_per_second": tokens_per_step / median if steps_run else 0.0,
            "checkpoint": self.last_ckpt, "checkpoint_error": self.ckpt_error, "sample": text,
        }


def summary_table(s: dict) -> str:
    """The run against DDP and against the stage's formula, as a few aligned lines."""
    psi, n = s["numel"], s["world_size"]
    tp = n // s.get("data_parallel_size", n)
    b = s["bytes_per_param"]
    mem = s["memory"]
    ddp_factor = b["param"] + b["grad"] + b["k"]
    rows = [
        ("", "this run", "DDP (stage 0)", "formula (stage %d)" % s["stage"]),
        ("model state / rank", fmt_bytes(mem["model_state"]), fmt_bytes(s["model_state_ddp_nbytes"]),
         fmt_bytes(s["model_state_formula_nbytes"])),
        ("  ratio to DDP", "%.2fx" % (mem["model_state"] / s["model_state_ddp_nbytes"]), "1.00x",
         "%.2fx" % (s["model_state_formula_nbytes"] / s["model_state_ddp_nbytes"])),
        ("comm / step (elements)", "%s (%.2fΨ)" % (fmt_numel(s["volume_numel_last_step"]),
                                                  s["volume_numel_last_step"] / psi),
         "%s (2Ψ)" % fmt_numel(2 * psi), "%s (%dΨ)" % (fmt_numel(s["volume_numel_expected"]), s["volume_factor"])),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    mesh = f" (data {n // tp} x tensor {tp})" if tp > 1 else ""
    lines = [f"stage {s['stage']} on N={n} ranks{mesh} ({s['backend']}, {s['device']}), model {s['model']}, "
             f"Ψ = {psi:,} params, {s['precision']}; DDP holds {ddp_factor}Ψ bytes "
             f"({b['param']}+{b['grad']}+{b['k']}) per rank"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              for r in rows]
    loss = s["loss"]
    val = f", val {loss['val_last']:.3f}" if loss["val_last"] is not None else ""
    lines.append(f"loss {loss['first']:.3f} -> {loss['last']:.3f}{val}; {s['tokens_per_second']:,.0f} tokens/s; "
                 f"{len(s['losses'])} steps in {s['wall_seconds']:.1f} s")
    return "\n".join(lines)


def write_outputs(s: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1, default=str)
    try:
        from zerodp.demo.plotting import plot_run
    except ImportError:  # matplotlib is the optional `plot` extra
        console.info("no plot: matplotlib is not installed (pip install 'zerodp[plot]')")
        return
    plot_run(os.path.join(out, "summary.png"), s)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerodp.demo.train", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    job = Job(args)
    summary = job.run()
    if job.rank == 0:
        write_outputs(summary, args.out)
        console.info(summary_table(summary))
        if summary["sample"]:
            console.info("\nsample:\n" + summary["sample"].rstrip() + "\n")
        ckpt = f"; checkpoint {summary['checkpoint']}" if summary["checkpoint"] else ""
        if summary["checkpoint_error"]:
            ckpt = f"; NO checkpoint ({summary['checkpoint_error'][:200]})"
        console.info("wrote %s and summary.png%s", os.path.join(args.out, "summary.json"), ckpt)
    zerodp.shutdown_distributed()
    # An explicitly requested checkpoint that failed fails the run (after its record is written).
    return 1 if job.ckpt_error and (args.ckpt_dir or args.ckpt_every or args.resume) else 0


if __name__ == "__main__":
    sys.exit(main())
