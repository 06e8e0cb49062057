#!/usr/bin/env python
"""LoRA fine-tuning of a bf16 frozen Llama-shaped base: DDP, FSDP2 and zerodp stage 3.

    .venv/bin/python benchmarks/bench_lora.py --steps 5 --warmup 2
    .venv/bin/python benchmarks/bench_lora.py --tiny

Every engine trains the same model: `LlamaForCausalLM(LlamaConfig(...))` built from a
config (nothing downloaded, same seed on every rank), cast to bf16 (`base.to(torch.bfloat16)`;
it is built under bf16 as default dtype, so no fp32 copy of the base is ever held), then
`peft.get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=[every attention
and MLP projection], lora_dropout=0.0))`, which keeps the adapters fp32. AdamW(lr=1e-4) over
the trainable parameters, sequence --seq, batch 1 per rank, labels = inputs.

  ddp     torch DistributedDataParallel over the peft model
  fsdp2   torch.distributed.fsdp.fully_shard on each LlamaDecoderLayer, then on the root
          (frozen base sharded). FSDP2 cannot hold bf16 and fp32 parameters in one unit, so
          the adapters are cast to bf16 first (what most FSDP2 LoRA recipes do); its
          AdamW therefore steps bf16 adapters, unlike the other two engines.
  zerodp3 zerodp.initialize(model, torch.optim.AdamW, zerodp.Config(stage=3), lr=1e-4)

Each engine runs under its own torchrun (2 ranks, CPU/gloo, OMP_NUM_THREADS=1) through
bench.py's launcher, one after another. Step time: median over the post-warm-up steps of the
slowest rank. Peak RSS: VmHWM of the largest rank over the whole run (construction
included); "train peak" is the same after VmHWM was reset (/proc/self/clear_refs) once the
engine was set up, i.e. the high-water mark of the training steps alone.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import WORLD_SIZE, _ratio, peak_rss_bytes, run_variant, uptime  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("ddp", "fsdp2", "zerodp3")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-4
SEED = 1234
# About 0.47B parameters (468,239,360): untied 32000 x 1024 embeddings and head, 24 layers.
DEFAULTS = dict(hidden=1024, layers=24, intermediate=4096, heads=16, kv_heads=16, vocab=32000, seq=256,
                steps=8, warmup=2)
TINY = dict(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2, vocab=1024, seq=64, steps=4, warmup=1)
REPORT_FIELDS = ("frozen_params", "params", "grads", "master", "optimizer_states")


# ============================================================================ worker side
def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def build_model(args):
    """(peft model, parameter count of the base): the bf16 base with fp32 LoRA adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 128),
                      tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(SEED)
    torch.set_default_dtype(torch.bfloat16)  # build the base in bf16: no fp32 copy of it, ever
    try:
        base = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    base = base.to(torch.bfloat16)
    base.config.use_cache = False
    if args.gradient_checkpointing:  # get_peft_model then makes the embeddings' output require a gradient
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    psi_base = sum(p.numel() for p in base.parameters())
    torch.manual_seed(SEED + 1)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGET_MODULES, lora_dropout=0.0))
    model.train()
    return model, psi_base


def setup(variant: str, model):
    """(callable x -> loss, backward, step, zero_grad, memory report or None)."""
    import torch
    import torch.distributed as dist

    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        run = DDP(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        return (lambda x: run(input_ids=x, labels=x).loss, lambda loss: loss.backward(), opt.step,
                lambda: model.zero_grad(set_to_none=True), lambda: None)
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        # One dtype per unit: the fp32 adapters go to bf16 (see the module docstring).
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        return (lambda x: model(input_ids=x, labels=x).loss, lambda loss: loss.backward(), opt.step,
                lambda: model.zero_grad(set_to_none=True), lambda: None)
    import zerodp

    zmodel, opt = zerodp.initialize(model, torch.optim.AdamW, zerodp.Config(stage=3), lr=LR)
    return (lambda x: zmodel(input_ids=x, labels=x).loss, opt.backward, opt.step,
            lambda: zmodel.zero_grad(set_to_none=True), lambda: opt.memory_report().as_dict())


def worker(args) -> None:
    import gc

    import torch
    import torch.distributed as dist

    t_start = time.perf_counter()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    import peft  # noqa: F401
    import transformers  # noqa: F401

    rss_runtime = current_rss_bytes()  # Python, torch, transformers, peft and gloo: every engine's floor
    model, psi_base = build_model(args)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    forward, backward, step, zero_grad, report = setup(args.variant, model)
    del model
    gc.collect()
    setup_s = time.perf_counter() - t_start
    rss_setup = peak_rss_bytes()
    cleared = reset_peak_rss()

    g = torch.Generator().manual_seed(SEED * 1000 + rank)
    batches = torch.randint(0, args.vocab, (args.steps, 1, args.seq), generator=g)
    losses, step_s = [], []
    for x in batches:
        dist.barrier()
        t0 = time.perf_counter()
        loss = forward(x)
        backward(loss)
        step()
        zero_grad()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.detach().item())
    mine = {"rank": rank, "losses": losses, "step_s": step_s, "peak_rss": max(peak_rss_bytes(), rss_setup),
            "train_peak_rss": peak_rss_bytes() if cleared else None, "setup_s": setup_s, "runtime_rss": rss_runtime,
            "memory_report": report()}
    everyone = [None] * ws
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        slowest = [max(r["step_s"][i] for r in everyone) for i in range(args.steps)]
        train_peaks = [r["train_peak_rss"] for r in everyone]
        record = {
            "variant": args.variant, "psi_base": psi_base, "trainable": trainable, "world_size": ws,
            "steps": args.steps, "warmup": args.warmup, "seq": args.seq,
            "median_step_s": statistics.median(slowest[args.warmup:]), "step_s_slowest_rank": slowest,
            "peak_rss_max": max(r["peak_rss"] for r in everyone),
            "train_peak_rss_max": None if None in train_peaks else max(train_peaks),
            "runtime_rss_max": max(r["runtime_rss"] for r in everyone),
            "train_peak_above_runtime_max": (None if None in train_peaks else
                                             max(r["train_peak_rss"] - r["runtime_rss"] for r in everyone)),
            "memory_report_max": ({k: max(r["memory_report"][k] for r in everyone) for k in REPORT_FIELDS}
                                  if everyone[0]["memory_report"] else None),
            "loss_mean": [statistics.fmean(r["losses"][i] for r in everyone) for i in range(args.steps)],
            "setup_s": max(r["setup_s"] for r in everyone), "torch": torch.__version__, "ranks": everyone,
        }
        record["final_loss"] = record["loss_mean"][-1]
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[bench_lora] {args.variant}: median step {record['median_step_s']:.3f} s, peak RSS "
              f"{record['peak_rss_max'] / 2**30:.2f} GiB, final loss {record['final_loss']:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ parent side
NOTES = {"ddp": "DDP over the peft model; fp32 adapters, bf16 base replicated",
         "fsdp2": "fully_shard per LlamaDecoderLayer + root; adapters cast to bf16 (one dtype per unit)",
         "zerodp3": "zerodp.Config(stage=3); fp32 adapters, bf16 base sharded"}


def _gib(n) -> str:
    return f"{n / 2**30:.2f}" if n is not None else "—"


def render(args, records: dict, failures: dict) -> str:
    ddp, fsdp2, z = records.get("ddp"), records.get("fsdp2"), records.get("zerodp3")
    any_r = next(iter(records.values()), None)
    head = (f"Llama-shaped base {any_r['psi_base']:,} parameters (bf16, frozen), LoRA r=16 on all 7 projections: "
            f"{any_r['trainable']:,} trainable (fp32). " if any_r else "")
    lines = [head + f"hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, "
             f"{args.heads} heads / {args.kv_heads} kv heads, vocab {args.vocab}; N={WORLD_SIZE} CPU/gloo, "
             f"OMP_NUM_THREADS=1, batch 1x{args.seq} per rank, "
             f"{'activation checkpointing (non-reentrant), ' if args.gradient_checkpointing else ''}"
             f"AdamW(lr={LR}), {args.steps} steps, median of the "
             f"last {args.steps - args.warmup}.", "",
             "| engine | median step s | × DDP | peak RSS GiB/rank | × DDP | train peak RSS GiB/rank | × DDP "
             "| train peak above runtime GiB/rank | × DDP | setup s | final loss | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for v in args.variants:
        if v in failures:
            lines.append(f"| {v} | failed: {failures[v]} |" + " |" * 10)
            continue
        r = records.get(v)
        if r is None:
            continue
        lines.append(f"| {v} | {r['median_step_s']:.3f} | {_ratio(r['median_step_s'], ddp and ddp['median_step_s'])} "
                     f"| {_gib(r['peak_rss_max'])} | {_ratio(r['peak_rss_max'], ddp and ddp['peak_rss_max'])} "
                     f"| {_gib(r['train_peak_rss_max'])} "
                     f"| {_ratio(r['train_peak_rss_max'], ddp and ddp['train_peak_rss_max'])} "
                     f"| {_gib(r['train_peak_above_runtime_max'])} "
                     f"| {_ratio(r['train_peak_above_runtime_max'], ddp and ddp['train_peak_above_runtime_max'])} "
                     f"| {r['setup_s']:.1f} | {r['final_loss']:.4f} | {NOTES[v]} |")
    lines += ["", "Peak RSS: VmHWM of the largest rank over the whole run (building the model included). Train peak: "
              "VmHWM reset after the engine's setup, so the high-water mark of the training steps alone. Above runtime: "
              "train peak less the RSS of the bare runtime (Python, torch, transformers, peft, gloo: "
              f"{_gib(any_r and any_r['runtime_rss_max'])} GiB, before any model exists), the part the engines "
              "differ in. Step time: "
              "slowest rank per step, median after warm-up. Setup: process start to engine ready, largest rank."]
    if z and z["memory_report_max"]:
        mr = z["memory_report_max"]
        lines += ["", "zerodp3 `opt.memory_report()` (largest rank): " + ", ".join(
            f"{k} {mr[k] / 2**20:,.1f} MiB" for k in REPORT_FIELDS) + "."]
    if z and ddp and fsdp2:
        checks = [("peak RSS <= 0.6x DDP", z["peak_rss_max"] <= 0.6 * ddp["peak_rss_max"],
                   f"{z['peak_rss_max'] / ddp['peak_rss_max']:.2f}x"),
                  ("peak RSS <= FSDP2", z["peak_rss_max"] <= fsdp2["peak_rss_max"],
                   f"{z['peak_rss_max'] / fsdp2['peak_rss_max']:.2f}x")]
        if z["train_peak_rss_max"] and ddp["train_peak_rss_max"] and fsdp2["train_peak_rss_max"]:
            checks += [("train peak RSS <= 0.6x DDP", z["train_peak_rss_max"] <= 0.6 * ddp["train_peak_rss_max"],
                        f"{z['train_peak_rss_max'] / ddp['train_peak_rss_max']:.2f}x"),
                       ("train peak RSS <= FSDP2", z["train_peak_rss_max"] <= fsdp2["train_peak_rss_max"],
                        f"{z['train_peak_rss_max'] / fsdp2['train_peak_rss_max']:.2f}x")]
        checks.append(("step time <= FSDP2", z["median_step_s"] <= fsdp2["median_step_s"],
                       f"{z['median_step_s'] / fsdp2['median_step_s']:.2f}x"))
        lines += ["", "Targets (zerodp3): " + "; ".join(f"{name}: {'MET' if ok else 'NOT MET'} ({val})"
                                                       for name, ok, val in checks) + "."]
    else:
        lines += ["", "Targets: not checked (an engine failed)."]
    return "\n".join(lines)


def parent(args) -> None:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"lora-{stamp}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    results, log_path = out.with_suffix(".jsonl"), out.with_suffix(".log")
    if results.exists():
        results.unlink()
    load_before = uptime()
    print(f"[bench_lora] {load_before}\n[bench_lora] results -> {results}, worker output -> {log_path}", flush=True)
    sizes = ["--hidden", args.hidden, "--layers", args.layers, "--intermediate", args.intermediate, "--heads",
             args.heads, "--kv-heads", args.kv_heads, "--vocab", args.vocab, "--seq", args.seq, "--steps",
             args.steps, "--warmup", args.warmup, "--timeout", args.timeout,
             *(["--gradient-checkpointing"] if args.gradient_checkpointing else [])]
    records, failures = {}, {}
    for v in args.variants:
        t0 = time.perf_counter()
        record, err = run_variant(Path(__file__).resolve(), [str(a) for a in [*sizes, "--variant", v, "--results",
                                                                              results]],
                                  args.timeout, results, log_path)
        if err is not None:
            failures[v] = err[:200].replace("|", "/")
            print(f"[bench_lora] {v} FAILED ({err}); see {log_path}", flush=True)
        else:
            records[v] = record
            print(f"[bench_lora] {v} done in {time.perf_counter() - t0:.0f} s", flush=True)
    import torch

    command = " ".join([".venv/bin/python", "benchmarks/bench_lora.py", *sys.argv[1:]])
    text = "\n".join([f"# LoRA fine-tune: DDP, FSDP2, zerodp stage 3 ({stamp})", "",
                      f"Command: `{command}` (from the repository root)", "",
                      f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs.  ",
                      f"Load before: `{load_before}`  ", f"Load after: `{uptime()}`", "",
                      render(args, records, failures), ""])
    out.write_text(text)
    print("\n" + text)
    print(f"[bench_lora] wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a small model and few steps: a smoke run")
    for name, default in DEFAULTS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                        help=f"default {default} (--tiny: {TINY[name]})")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="activation checkpointing in every engine (HF gradient_checkpointing_enable, non-reentrant)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed per engine")
    ap.add_argument("--out", default=None, help="markdown output (default benchmarks/results/lora-<stamp>.md)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, (TINY if args.tiny else DEFAULTS)[name])
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    if args.worker:
        worker(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
