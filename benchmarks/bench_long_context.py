#!/usr/bin/env python
"""The longest sequence a Llama-shaped model of ~100M parameters trains at within a fixed peak
RSS per rank, with Ulysses sequence parallelism (SP = 1, 2, 4) and with the tiled loss and MLP,
at stage 3 on 4 CPU ranks (gloo); and the step time per token at one common length.

    .venv/bin/python benchmarks/bench_long_context.py            # ~100M parameters
    .venv/bin/python benchmarks/bench_long_context.py --quick    # a small model: a smoke run
    .venv/bin/python benchmarks/bench_long_context.py --model small --base-length 1024

The model: Hugging Face's Llama built from its config (hidden 768, 8 layers, 12 heads of which
4 key/value heads (GQA), intermediate 2048, vocabulary 32000, untied head: 99.5M parameters),
sdpa attention, its gradient checkpointing (non-reentrant) on in every variant, fp32 AdamW
(foreach=False: one shard tensor's temporaries at a time), zerodp stage 3 over the 4 ranks. Variants: sequence_parallel_size 1, 2, 4, each untiled and
tiled (tiled_loss and tiled_mlp). One torchrun launch of 4 processes per variant
(OMP_NUM_THREADS=1); a group of SP ranks reads one sequence of L tokens (batch 1).

The budget: the peak RSS per rank (the largest rank's) of one training step (forward, backward,
AdamW step) of the untiled SP=1 variant at `--base-length` tokens, measured first (after a
short warm-up step, as in every variant). Each
variant then searches the longest L, a multiple of `--granularity`, whose step stays within
it: a trial is one step at length L; its peak is the largest rank's VmHWM over the step, the
high-water mark reset just before it (/proc/self/clear_refs) after the heap was trimmed
(malloc_trim), so each trial's peak is its own in a process that keeps the model between
trials; glibc's mmap threshold is fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_), so that each tensor
over it is mapped on its own and returned when freed: RSS follows the tensors alive. The search fits peak = a + b L through the trials so far (the first two at L0 k / 2
and L0 k, L0 the base length), tries the predicted longest L, and walks by the granularity
until a length that fits sits next to one that does not (at most `--max-trials` trials).

At a short L0 the 100m shape's budget is set by a phase of the step that does not grow with L
(stage 3's vocabulary-sized units: at 512 tokens per rank and fewer): use `--base-length 1024`
or more (benchmarks/RESULTS.md, "Long context"). On this repository's 2-core machine its five
variants but SP=4 tiled take ~34 minutes at L0 = 1,024; SP=4 tiled's search (~18k tokens)
needs a `--timeout` over the default. `--model small` (hidden 256, 4 layers, vocabulary 8192)
with `--base-length 2048 --repeat 3` runs in ~35 minutes here.

Step time per token: steps at `--base-length` with SP rows in the batch, so that every
variant trains the same 4 L0 tokens per step (4 / SP groups of SP rows each) and each rank
computes the same number of tokens' layers; a step's time is the slowest rank's, a variant's
the median of `--time-steps` steps; time per token = that / 4 L0. The search's launch gives the
first round; `--repeat` - 1 more rounds launch every variant again for the timed steps only,
the order reversed every other round, so that each round's launches meet about the same load
on a shared machine; a ratio against SP=1 is the median over the rounds of the ratio within a
round (its range beside it).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import ROOT, run_variant, uptime  # noqa: E402

WORLD = 4
VARIANTS = ("sp1", "sp2", "sp4", "sp1_tiled", "sp2_tiled", "sp4_tiled")
# (hidden, layers, heads, kv heads, intermediate, vocab)
MODELS = {"100m": (768, 8, 12, 4, 2048, 32000), "small": (256, 4, 8, 4, 688, 8192),
          "quick": (128, 2, 4, 4, 352, 4096)}


# ============================================================================ worker side
def build(shape):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, intermediate, vocab = shape
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=1 << 17,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def status_mib() -> dict:
    """This process's VmRSS and VmHWM (peak since the last reset), MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


class Trials:
    """One training step per call, measured on every rank, the largest rank's figures kept."""

    def __init__(self, model, opt, sp: int, vocab: int):
        import torch.distributed as dist

        self.model, self.opt, self.sp, self.vocab = model, opt, sp, vocab
        self.group = dist.get_rank() // sp
        self.libc = ctypes.CDLL("libc.so.6")

    def __call__(self, length: int, rows: int = 1) -> dict:
        import torch
        import torch.distributed as dist

        g = torch.Generator().manual_seed(1000 * length + self.group)
        ids = torch.randint(0, self.vocab, (rows, length), generator=g)
        self.libc.malloc_trim(0)
        dist.barrier()
        before = status_mib()["VmRSS"]
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
            f.write("5")
        start = time.perf_counter()
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        elapsed = time.perf_counter() - start
        mine = [status_mib()["VmHWM"], before, elapsed, float(loss.detach())]
        del loss
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {"length": length, "rows": rows, "peak_mib": max(e[0] for e in everyone),
                "before_mib": max(e[1] for e in everyone), "step_s": max(e[2] for e in everyone),
                "loss": everyone[0][3]}


def search(trial, budget: float, sp: int, base: int, step: int, max_trials: int, log, done: dict) -> tuple:
    """(longest length that fit, shortest that did not, the trials): [module docstring].
    `done`: trials already run, by length."""

    def run(length):
        r = trial(length)
        done[length] = r
        log(f"L={length}: peak {r['peak_mib']:.0f} MiB (before {r['before_mib']:.0f}), {r['step_s']:.1f} s")
        return r["peak_mib"] <= budget

    def predicted():
        pts = sorted(done.items())
        (l1, r1), (l2, r2) = pts[-2], pts[-1]
        slope = (r2["peak_mib"] - r1["peak_mib"]) / (l2 - l1)
        if slope <= 0:
            return None
        return int((l1 + (budget - r1["peak_mib"]) / slope) // step * step)

    for length in (max(step, base * sp // 2 // step * step), base * sp):
        if length not in done:
            run(length)
    while len(done) < max_trials:
        fit = [l for l, r in done.items() if r["peak_mib"] <= budget]
        over = [l for l, r in done.items() if r["peak_mib"] > budget]
        lo, hi = max(fit, default=0), min(over, default=None)
        if hi is not None and hi - lo <= step:
            break
        guess = predicted()
        if guess is None:
            guess = 2 * lo if hi is None else (lo + hi) // 2 // step * step
        # stay strictly inside the bracket, and at most double past the longest that fit
        ceiling = (hi - step) if hi is not None else 2 * max(lo, step)
        guess = max(lo + step, min(guess, ceiling))
        if guess in done:
            guess = lo + step if lo + step not in done else (hi - step if hi else 2 * lo)
        if guess in done:
            break
        run(guess)
    fit = [l for l, r in done.items() if r["peak_mib"] <= budget]
    over = [l for l, r in done.items() if r["peak_mib"] > budget]
    return max(fit, default=0), min(over, default=None), [done[l] for l in sorted(done)]


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zerodp

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    sp, tiled = int(args.variant[2]), args.variant.endswith("_tiled")
    shape = MODELS[args.model]
    model = build(shape)
    psi = sum(p.numel() for p in model.parameters())
    cfg = zerodp.Config(stage=3, sequence_parallel_size=sp, tiled_loss=tiled, tiled_mlp=tiled)
    # foreach=False: AdamW steps one shard tensor at a time, so its temporaries are a tensor's,
    # not the whole shard's at once (which would set the peak of every short step).
    model, opt = zerodp.initialize(model, torch.optim.AdamW, cfg, lr=1e-4, foreach=False)
    trial = Trials(model, opt, sp, shape[-1])

    def log(text):
        if rank == 0:
            print(f"[long_context] {args.variant}: {text}", flush=True)

    trial(64 * sp)  # warm-up: the first step sets up the collectives' buffers, which stay
    step_s = statistics.median(trial(args.base_length, rows=sp)["step_s"] for _ in range(args.time_steps))
    log(f"{WORLD * args.base_length} tokens per step: {step_s:.2f} s (median of {args.time_steps})")
    if args.timing_only:
        if rank == 0:
            with open(args.results, "a") as f:
                f.write(json.dumps({"variant": args.variant, "time_step_s": step_s}) + "\n")
        dist.barrier()
        dist.destroy_process_group()
        return
    budget, done = args.budget, {}
    if budget is None:  # the untiled SP=1 variant measures it, and that trial is its search's at L0
        done[args.base_length] = trial(args.base_length)
        budget = done[args.base_length]["peak_mib"]
        log(f"budget: {budget:.0f} MiB at L={args.base_length}")
    longest, shortest_over, trials = search(trial, budget, sp, args.base_length, args.granularity,
                                            args.max_trials, log, done)
    if rank == 0:
        record = {"variant": args.variant, "sp": sp, "tiled": tiled, "psi": psi, "budget_mib": budget,
                  "longest": longest, "shortest_over": shortest_over, "trials": trials,
                  "time_tokens": WORLD * args.base_length, "time_step_s": step_s}
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ parent side
def time_ratio(times: dict, variant: str, reference: str) -> str:
    """The median over the rounds of variant's step time / reference's in the same round, and
    the range: 'median [low-high]'."""
    pairs = [a / b for a, b in zip(times.get(variant, []), times.get(reference, [])) if a and b]
    if not pairs:
        return "—"
    if len(pairs) == 1:
        return f"{pairs[0]:.2f}"
    return f"{statistics.median(pairs):.2f} [{min(pairs):.2f}-{max(pairs):.2f}]"


def render(records: dict, times: dict, failures: dict, args) -> str:
    """records: variant -> its search's record; times: variant -> its step time per round."""
    base = records.get("sp1")
    any_record = next(iter(records.values()), None)
    lines = []
    if any_record:
        lines.append(f"Ψ = {any_record['psi']:,} parameters; budget {any_record['budget_mib']:.0f} MiB peak RSS per "
                     f"rank (untiled SP=1 at L0 = {args.base_length}); lengths in multiples of {args.granularity}; "
                     f"step time at {WORLD} x {args.base_length} tokens per step, the median of "
                     f"{args.time_steps} steps, in {args.repeat} rounds")
    lines += ["", "| variant | longest L that fits | first L over | × SP=1 | × untiled, same SP | trials | "
                  "step s | s per 1k tokens | × SP=1, same tiling |",
              "|---|---|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        r = records.get(v)
        if r is None:
            if v in failures:
                lines.append(f"| {v} | failed: {failures[v]} | | | | | | | |")
            continue
        untiled = records.get(v.replace("_tiled", ""))
        step_s = statistics.median(t for t in times[v] if t)
        per_k = 1000 * step_s / r["time_tokens"]
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "—"  # noqa: E731
        lines.append(
            f"| {v} | {r['longest']:,} | {'—' if r['shortest_over'] is None else format(r['shortest_over'], ',')} "
            f"| {ratio(r['longest'], base and base['longest'])} "
            f"| {ratio(r['longest'], untiled and untiled['longest']) if r['tiled'] else ''} "
            f"| {len(r['trials'])} | {step_s:.2f} | {per_k:.2f} "
            f"| {time_ratio(times, v, 'sp1_tiled' if r['tiled'] else 'sp1')} |")
    lines += ["", "Each trial's peak (largest rank's VmHWM over one step, MiB) by length:", ""]
    for v in VARIANTS:
        r = records.get(v)
        if r is not None:
            lines.append(f"- {v}: " + ", ".join(f"{t['length']:,}: {t['peak_mib']:.0f}" for t in r["trials"])
                         + f" (RSS before the step {min(t['before_mib'] for t in r['trials']):.0f}"
                           f"-{max(t['before_mib'] for t in r['trials']):.0f})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small model and short lengths: a smoke run")
    ap.add_argument("--base-length", type=int, default=None, help="L0: SP=1's length that sets the budget")
    ap.add_argument("--granularity", type=int, default=None, help="lengths searched in multiples of this")
    ap.add_argument("--max-trials", type=int, default=8)
    ap.add_argument("--time-steps", type=int, default=3, help="timed steps per launch (their median)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of timed steps, in alternating order")
    ap.add_argument("--timing-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_context.md"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=sorted(MODELS), default="100m",
                    help="100m: the shape above; small: hidden 256, 4 layers, 8 heads (4 kv), vocabulary 8192")
    ap.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.base_length is None:
        args.base_length = 256
    if args.granularity is None:
        args.granularity = 64
    if args.worker:
        worker(args)
        return
    import bench

    bench.WORLD_SIZE = WORLD
    # glibc raises its mmap threshold to the size of the largest block freed (up to 32 MiB), after
    # which freed tensors stay in the heap and a step's peak RSS depends on the layout earlier
    # steps left: a fixed threshold maps every tensor over 128 KiB on its own and returns it when
    # freed, so that RSS follows the tensors alive.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    model = "quick" if args.quick else args.model
    out = Path(args.out)
    if args.quick:
        out = out.with_name(out.stem + "_quick.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    results = out.with_suffix(".jsonl")
    results.write_text("")
    log = out.with_suffix(".log")
    log.write_text(f"{uptime()}\n")
    records, times, failures, budget = {}, {}, {}, None
    variants = ["sp1"] + [v for v in args.variants if v != "sp1"]  # the budget first
    started = time.perf_counter()
    for v in variants:
        worker_args = ["--variant", v, "--model", model, "--base-length", str(args.base_length), "--granularity",
                       str(args.granularity), "--max-trials", str(args.max_trials), "--timeout", str(args.timeout),
                       "--results", str(results)] + ([] if budget is None else ["--budget", str(budget)])
        rec, err = run_variant(Path(__file__).resolve(), worker_args, args.timeout, results, log)
        if rec is None:
            failures[v] = err
            print(f"[long_context] {v} failed: {err}", flush=True)
            if budget is None:
                break
            continue
        records[v] = rec
        times[v] = [rec["time_step_s"]]
        budget = rec["budget_mib"]
        print(f"[long_context] {v}: longest {rec['longest']} ({time.perf_counter() - started:.0f} s so far)",
              flush=True)
    searched = [v for v in variants if v in records]
    for i in range(1, args.repeat):
        for v in (searched if i % 2 == 0 else list(reversed(searched))):
            worker_args = ["--variant", v, "--model", model, "--base-length", str(args.base_length), "--time-steps",
                           str(args.time_steps), "--timeout", str(args.timeout), "--results", str(results),
                           "--timing-only"]
            rec, err = run_variant(Path(__file__).resolve(), worker_args, args.timeout, results, log)
            times[v].append(None if rec is None else rec["time_step_s"])
            if rec is None:
                print(f"[long_context] {v} timing round {i + 1} failed: {err}", flush=True)
        print(f"[long_context] timing round {i + 1} done ({time.perf_counter() - started:.0f} s so far)", flush=True)
    table = render(records, times, failures, args)
    began = log.read_text().splitlines()[0]
    out.write_text(f"# bench_long_context\n\n`{' '.join(sys.argv)}` (began: {began}; ended: {uptime()}; "
                   f"{(time.perf_counter() - started) / 60:.1f} min)\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
