#!/usr/bin/env python
"""A GRPO-like step of a GPT-2-small policy: DDP, zerodp stage 3 as it generates today, and
zerodp stage 3 in the generation context; then the weight stream against full_state_dict.

    .venv/bin/python benchmarks/bench_rl.py                 # 124M, N=2, 4 steps (1 warm-up)
    .venv/bin/python benchmarks/bench_rl.py --tiny          # a 2-layer model, to try the script

The policy is Hugging Face's `GPT2LMHeadModel(GPT2Config(...))` built from a config (GPT-2
small's shape by default: 124M parameters, tied embeddings; nothing downloaded; dropout off),
the same seed on every rank. Each step, per rank: `--prompts` prompts of `--prompt-len`
random tokens, `--generations` sampled completions each of exactly `--new-tokens` tokens
(`generate(do_sample=True, min_new_tokens=max_new_tokens)`, the same seed per step in every
variant), a toy reward (how many generated tokens have an even id), group-normalised
advantages, the policy-gradient loss -A·sum(log p(completion)) over one forward and backward
of the prompt and completion, and one AdamW step (lr 1e-6).

  ddp          torch DistributedDataParallel; generation by the wrapped model
  zerodp3      zerodp.initialize(..., Config(stage=3)); `generate` as it runs today: every
               unit all-gathered at every forward, one forward per new token
  zerodp3_ctx  the same inside `zerodp.generation_context(model, optimizer)`: every unit
               gathered on entering it, once per rollout, and kept until it ends

Every variant runs under its own torchrun (2 ranks, CPU/gloo, OMP_NUM_THREADS=1) through
bench.py's launcher, one after another, so a change of the machine's load between variants
moves their ratios. `--paired` measures the generation ratio without that: one torchrun holds
the DDP policy and the zerodp stage-3 policy (same init) and alternates their rollouts
(ABBA order, `--rounds` rounds, the first a warm-up; no training step between them: the
context gathers on every entry whatever the weights), reporting per round the slowest
rank's wall time and process CPU time of each and their ratio, the median of the ratios,
and the load (uptime) before and after:

    .venv/bin/python benchmarks/bench_rl.py --paired        # DDP vs stage 3 in the context

Times (variants) are the slowest rank's, the median over the post-warm-up steps: the step,
its generation, and the generation per new token. Peak RSS is VmHWM of the largest rank
after the steps (before the stream is measured). Gathers per token
come from zerodp's comm ledger (all-gathers recorded during `generate`, per new token).

Then, at stage 3 (both zerodp variants): one pass of `zerodp.iter_full_params(model,
optimizer)` read as a weight loader reads it (each tensor dropped at the next), against one
`zerodp.full_state_dict(model, optimizer)`: the time of each, and the tensor memory each
added at its worst (zerodp.memory.allocations.TensorAllocations, a separate pass: its dispatch
mode slows what it watches), in units of the largest unit's gathered bytes.
"""
from __future__ import annotations

import argparse
import contextlib
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
VARIANTS = ("ddp", "zerodp3", "zerodp3_ctx")
PAIRED = "paired"  # the worker of --paired: DDP and zerodp3_ctx rollouts alternated in one world
LR = 1e-6
SEED = 1234
# GPT-2 small: 124,439,808 parameters (tied embeddings).
DEFAULTS = dict(layers=12, hidden=768, heads=12, vocab=50257, prompts=2, generations=2, prompt_len=16,
                new_tokens=32, steps=4, warmup=1)
TINY = dict(layers=2, hidden=64, heads=2, vocab=512, prompts=2, generations=2, prompt_len=8, new_tokens=8,
            steps=3, warmup=1)


# ============================================================================ worker side
def _policy(args):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                        n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _prompts(args, step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(10_000 * step + rank)
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=g)
    return prompts.repeat_interleave(args.generations, dim=0)  # each prompt's group, side by side


def _loss(model, seqs, prompt_len: int, generations: int):
    """-A·log p(completion), A the reward normalised within each prompt's group."""
    import torch

    completion = seqs[:, prompt_len:]
    reward = (completion % 2 == 0).float().sum(dim=1)
    groups = reward.view(-1, generations)
    advantage = ((groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + 1e-4)).view(-1)
    logits = model(seqs).logits[:, prompt_len - 1:-1]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    return -(advantage * logp.sum(dim=1)).mean()


def _rollout(policy, prompts, args, seed: int, context) -> dict:
    """One rollout in `context`: wall seconds and the process's CPU seconds (every thread:
    what this rank computed, gloo's transfers and page faults included, whatever else
    shares the cores)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    with torch.no_grad(), context:
        policy.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                        pad_token_id=policy.config.eos_token_id)
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def paired_worker(args) -> None:
    """DDP's and zerodp stage 3's (in the generation context) rollouts alternated in one world."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zerodp

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    policy = _policy(args)
    ddp = DDP(policy)  # DDP's generate is its module's: the wrapper only shows it is the same setup
    model, opt = zerodp.initialize(_policy(args), torch.optim.AdamW, zerodp.Config(stage=3), lr=LR)
    ledger = opt.comm.ledger
    sides = {"ddp": (ddp.module, contextlib.nullcontext),
             "zerodp3_ctx": (model, lambda: zerodp.generation_context(model, opt))}
    rounds = []
    for r in range(args.rounds):
        prompts = _prompts(args, r, rank)
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        row = {}
        for name in order:
            before = len(ledger.current)
            policy_, make = sides[name]
            row[name] = _rollout(policy_, prompts, args, SEED + r, make())
            row[name]["gathers"] = sum(x.op == "all_gather" for x in ledger.current[before:])
        rounds.append(row)
    everyone = [None] * ws
    dist.all_gather_object(everyone, rounds)
    if rank == 0:
        per_round = [{name: {k: max(e[r][name][k] for e in everyone) for k in ("wall_s", "cpu_s")}
                      | {"gathers": everyone[0][r][name]["gathers"]} for name in sides} for r in range(args.rounds)]
        record = {"variant": PAIRED, "psi": sum(p.numel() for p in policy.parameters()), "world_size": ws,
                  "args": vars(args), "rounds": per_round, "warmup": 1, "torch": torch.__version__}
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def worker(args) -> None:

    import torch
    import torch.distributed as dist

    import zerodp

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _policy(args)
    psi = sum(p.numel() for p in model.parameters())
    if args.variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        policy, model = model, DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        ledger = None
    else:
        model, opt = zerodp.initialize(model, torch.optim.AdamW, zerodp.Config(stage=3), lr=LR)
        policy, ledger = model, opt.comm.ledger
    steps = []
    for step in range(args.steps):
        prompts = _prompts(args, step, rank)
        context = (zerodp.generation_context(model, opt) if args.variant == "zerodp3_ctx"
                   else contextlib.nullcontext())
        dist.barrier()
        t0 = time.perf_counter()
        before = len(ledger.current) if ledger is not None else 0
        torch.manual_seed(SEED + step)
        with torch.no_grad(), context:
            seqs = policy.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                                   max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                   pad_token_id=policy.config.eos_token_id)
        t_gen = time.perf_counter() - t0
        gathers = (sum(r.op == "all_gather" for r in ledger.current[before:]) if ledger is not None else 0)
        loss = _loss(model, seqs, args.prompt_len, args.generations)
        if args.variant == "ddp":
            loss.backward()
        else:
            opt.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append({"step_s": time.perf_counter() - t0, "gen_s": t_gen, "gathers_per_token": gathers /
                      args.new_tokens, "loss": float(loss)})
    rss = peak_rss_bytes()
    stream = _stream_figures(model, opt) if args.variant != "ddp" else None
    mine = {"rank": rank, "steps": steps, "peak_rss": rss, "stream": stream}
    everyone = [None] * ws
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        measured = range(args.warmup, args.steps)

        def slowest(key):
            return statistics.median(max(r["steps"][i][key] for r in everyone) for i in measured)
        record = {"variant": args.variant, "psi": psi, "world_size": ws, "args": vars(args),
                  "median_step_s": slowest("step_s"), "median_gen_s": slowest("gen_s"),
                  "gen_s_per_token": slowest("gen_s") / args.new_tokens,
                  "gathers_per_token": everyone[0]["steps"][-1]["gathers_per_token"],
                  "peak_rss_max": max(r["peak_rss"] for r in everyone),
                  "losses": [statistics.fmean(r["steps"][i]["loss"] for r in everyone) for i in range(args.steps)],
                  "stream": everyone[0]["stream"], "torch": torch.__version__, "ranks": everyone}
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"[bench_rl] {args.variant}: step {record['median_step_s']:.3f} s, generation "
              f"{record['median_gen_s']:.3f} s, peak RSS {record['peak_rss_max'] / 2**30:.2f} GiB", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _stream_figures(model, opt) -> dict:
    """Time and added tensor memory of one weight stream and of one full_state_dict."""
    import torch.distributed as dist

    import zerodp
    from zerodp.memory.allocations import TensorAllocations

    def read_stream():
        n = 0
        for _, t in zerodp.iter_full_params(model, opt):
            n += t.numel()  # a weight loader's read: the tensor is dropped at the next one
        return n

    out = {"unit_nbytes": max(u.full_nbytes for u in opt.stage3.units)}
    for name, run in (("stream", read_stream), ("full_state_dict", lambda: zerodp.full_state_dict(model, opt))):
        dist.barrier()
        t0 = time.perf_counter()
        result = run()
        out[f"{name}_s"] = time.perf_counter() - t0
        del result
        with TensorAllocations() as added:
            result = run()  # held until the block ends: full_state_dict's dict is its memory
        del result
        out[f"{name}_peak_nbytes"] = added.peak_nbytes
    return out


# ============================================================================ parent side
def render(records: dict, failures: dict, args) -> str:
    ddp = records.get("ddp")
    psi = next(iter(records.values()))["psi"] if records else None
    lines = [f"### GPT-2 policy, {args.layers} layers x {args.hidden}" + (f" (Ψ = {psi:,}, N = {WORLD_SIZE})"
                                                                       if psi else ""), "",
             "| variant | step s | × DDP | generation s | s / new token | × DDP | gathers / new token "
             "| peak RSS GiB/rank | × DDP |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for variant in VARIANTS:
        if variant in failures:
            lines.append(f"| {variant} | failed: {failures[variant]} |" + " |" * 7)
            continue
        r = records.get(variant)
        if r is None:
            continue
        lines.append(f"| {variant} | {r['median_step_s']:.3f} | {_ratio(r['median_step_s'], ddp and ddp['median_step_s'])} "
                     f"| {r['median_gen_s']:.3f} | {r['gen_s_per_token']:.4f} "
                     f"| {_ratio(r['gen_s_per_token'], ddp and ddp['gen_s_per_token'])} "
                     f"| {r['gathers_per_token']:.2f} | {r['peak_rss_max'] / 2**30:.2f} "
                     f"| {_ratio(r['peak_rss_max'], ddp and ddp['peak_rss_max'])} |")
    lines += ["", "| variant | stream s | full_state_dict s | stream peak added | full_state_dict peak added "
              "| largest unit |", "|---|---:|---:|---:|---:|---:|"]
    for variant in VARIANTS[1:]:
        s = (records.get(variant) or {}).get("stream")
        if s is None:
            continue
        unit = s["unit_nbytes"]
        lines.append(f"| {variant} | {s['stream_s']:.3f} | {s['full_state_dict_s']:.3f} "
                     f"| {s['stream_peak_nbytes'] / 2**20:,.1f} MiB ({s['stream_peak_nbytes'] / unit:.2f} units) "
                     f"| {s['full_state_dict_peak_nbytes'] / 2**20:,.1f} MiB "
                     f"({s['full_state_dict_peak_nbytes'] / unit:.2f} units) | {unit / 2**20:,.1f} MiB |")
    lines += ["", "Times: the slowest rank's, median over the post-warm-up steps. s / new token: the rollout's "
              "time over its new tokens (the prompt's forward included). Gathers / new token: all-gathers the "
              "comm ledger recorded during `generate`, over its new tokens. Peak RSS: VmHWM of the largest rank "
              "after the steps. Stream and full_state_dict: rank 0, after the steps, one pass each timed, then "
              "one more each under TensorAllocations for the tensor memory it added at its worst, in units of "
              "the largest unit's gathered bytes.", ""]
    return "\n".join(lines)


def render_paired(record: dict, args) -> str:
    lines = [f"### Paired rollouts, GPT-2 policy, {args.layers} layers x {args.hidden} (Ψ = {record['psi']:,}, "
             f"N = {record['world_size']})", "",
             "| round | DDP wall s | ctx wall s | wall × DDP | DDP CPU s | ctx CPU s | CPU × DDP | ctx gathers |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    walls, cpus = [], []
    for i, r in enumerate(record["rounds"]):
        d, c = r["ddp"], r["zerodp3_ctx"]
        wall, cpu = c["wall_s"] / d["wall_s"], c["cpu_s"] / d["cpu_s"]
        if i >= record["warmup"]:
            walls.append(wall)
            cpus.append(cpu)
        lines.append(f"| {i}{' (warm-up)' if i < record['warmup'] else ''} | {d['wall_s']:.3f} | {c['wall_s']:.3f} "
                     f"| {wall:.3f} | {d['cpu_s']:.3f} | {c['cpu_s']:.3f} | {cpu:.3f} | {c['gathers']} |")
    measured = record["rounds"][record["warmup"]:]
    per_token = statistics.median(r["zerodp3_ctx"]["wall_s"] for r in measured) / args.new_tokens
    lines += ["", f"Median over the post-warm-up rounds: wall {statistics.median(walls):.3f}× DDP, process CPU "
              f"{statistics.median(cpus):.3f}× DDP; stage 3 in the context {per_token:.4f} s per new token. "
              f"Wall and CPU: the slowest rank's, per rollout (the context's entry and exit included).", ""]
    return "\n".join(lines)


def parent(args) -> None:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"rl-{stamp}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    results, log_path = out.with_suffix(".jsonl"), out.with_suffix(".log")
    script = Path(__file__).resolve()
    load_before = uptime()
    print(f"[bench_rl] {load_before}\n[bench_rl] results -> {results}, worker output -> {log_path}", flush=True)
    records, failures = {}, {}
    for variant in ([PAIRED] if args.paired else args.variants):
        t0 = time.perf_counter()
        worker_args = ["--variant", variant, "--results", str(results), "--timeout", str(args.timeout)]
        worker_args += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in DEFAULTS]
        worker_args += [f"--rounds={args.rounds}"]
        record, err = run_variant(script, worker_args, args.timeout, results, log_path)
        if err is not None:
            failures[variant] = err[:200].replace("|", "/")
            print(f"[bench_rl] {variant} FAILED ({err}); see {log_path}", flush=True)
        else:
            records[variant] = record
            print(f"[bench_rl] {variant} done in {time.perf_counter() - t0:.0f} s", flush=True)
    import torch

    header = [f"# RL step benchmark, {stamp}", "",
              f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}` (from the repository root)", "",
              f"World size {WORLD_SIZE} on CPU/gloo, OMP_NUM_THREADS=1, fp32, AdamW(lr={LR}); per rank "
              f"{args.prompts} prompts x {args.generations} completions, prompt {args.prompt_len} tokens, "
              f"{args.new_tokens} new tokens; {args.steps} steps ({args.warmup} warm-up). torch {torch.__version__}, "
              f"Python {platform.python_version()}, {os.cpu_count()} CPUs.", "",
              f"Load before: `{load_before}`  ", f"Load after: `{uptime()}`", ""]
    if args.paired:
        body = (render_paired(records[PAIRED], args) if PAIRED in records
                else f"paired run failed: {failures.get(PAIRED)}\n")
        header[4] = (f"World size {WORLD_SIZE} on CPU/gloo, OMP_NUM_THREADS=1, fp32; per rank {args.prompts} prompts "
                     f"x {args.generations} completions, prompt {args.prompt_len} tokens, {args.new_tokens} new "
                     f"tokens; {args.rounds} rounds (1 warm-up). torch {torch.__version__}, Python "
                     f"{platform.python_version()}, {os.cpu_count()} CPUs.")
    else:
        body = render(records, failures, args)
    text = "\n".join(header + [body])
    out.write_text(text)
    print("\n" + text)
    print(f"[bench_rl] wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and short rollouts, to try the script")
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v}")
    ap.add_argument("--paired", action="store_true",
                    help="DDP's and the generation context's rollouts alternated in one world (module docstring)")
    ap.add_argument("--rounds", type=int, default=7, help="--paired: rounds, the first a warm-up (default 7)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed per variant")
    ap.add_argument("--out", default=None, help="markdown output (default benchmarks/results/rl-<timestamp>.md)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=(*VARIANTS, PAIRED), help=argparse.SUPPRESS)
    ap.add_argument("--results", help=argparse.SUPPRESS)
    args = ap.parse_args()
    base = TINY if args.tiny else DEFAULTS
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not args.worker:
        parent(args)
    elif args.variant == PAIRED:
        paired_worker(args)
    else:
        worker(args)


if __name__ == "__main__":
    main()
