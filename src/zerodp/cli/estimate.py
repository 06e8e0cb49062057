"""`zerodp estimate`: the paper's memory model from the command line (memory/estimator.py)."""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional

from .common import UsageError, parse_count, parse_size, require


def _resolve_model(args) -> Optional[tuple[str, int]]:
    from zerodp.memory import estimator
    from zerodp.demo.models import PRESETS

    given = [x for x in (args.params, args.model, args.model_config) if x is not None]
    if len(given) > 1:
        raise UsageError("give one of --params, --model and --model-config")
    if args.params is not None:
        n = args.params
        label = next((f"{n / f:g}{u}" for f, u in ((1e12, "T"), (1e9, "B"), (1e6, "M")) if n >= f), str(n))
        return label, n
    if args.model is not None:
        if args.model in PRESETS:  # zerodp's own GPT presets, counted exactly on the meta device
            import torch

            from zerodp.demo.models import GPT

            with torch.device("meta"):
                return args.model, GPT(args.model).num_params()
        if args.model in estimator.PAPER_MODELS:
            return estimator.resolve_num_params(args.model)
        raise UsageError(f"--model {args.model}: use one of {sorted(estimator.PAPER_MODELS) + sorted(PRESETS)}, "
                         "--params or --model-config")
    if args.model_config is not None:
        if not os.path.isfile(args.model_config):
            raise UsageError(f"--model-config {args.model_config}: no such file")
        try:
            return estimator.resolve_num_params(args.model_config)
        except (ValueError, KeyError) as e:
            raise UsageError(str(e)) from None
    return None


ACTIVATION_SHAPE = (("--layers", "layers"), ("--hidden", "hidden"), ("--seq-len", "seq"), ("--batch-size", "batch"))


def _activation_shape(args) -> Optional[tuple[int, int, int, int]]:
    """(layers, hidden, seq_len, batch) when the activation shape is given, else None; a
    usage error when only part of it is, or when a flag that needs it comes without it."""
    given = {flag: getattr(args, dest) for flag, dest in ACTIVATION_SHAPE}
    missing = [flag for flag, value in given.items() if value is None]
    needs = [flag for flag, on in (("--partition-activations", args.partition_activations),
                                   ("--activations-on-host", args.activations_on_host),
                                   ("--checkpointing", args.checkpointing)) if on]
    if missing and (needs or len(missing) < len(given)):
        who = needs[0] if needs else "activation memory"
        raise UsageError(f"{who} needs all of --layers, --hidden, --seq-len and --batch-size "
                         f"(missing {', '.join(missing)})")
    if missing:
        return None
    for flag, value in given.items():
        if value < 1:
            raise UsageError(f"{flag} {value}: must be >= 1")
    if args.param_bytes < 1 or args.param_bytes != int(args.param_bytes):  # activations are stored in it
        raise UsageError(f"--param-bytes {args.param_bytes:g}: with --layers etc. it is the activations' "
                         "element size too: give a whole number of bytes (2 for fp16/bf16, 4 for fp32)")
    return tuple(given.values())


def _print_checkpoints(args, shape: tuple[int, int, int, int], dtype_bytes: int) -> int:
    """Print the checkpoints one rank holds without and with Pa (ZeRO §6.1) and what Pa adds
    to the traffic (§8); return the device bytes of the scheme the flags chose."""
    from zerodp.memory import estimator as est

    pa, on_host = args.partition_activations, args.activations_on_host
    marked = pa or on_host or args.checkpointing  # else no checkpoints were asked for
    print("\n" + est.format_checkpoints(*shape, dtype_bytes, args.tp_size, pa, on_host, marked))
    return 0 if on_host else est.checkpoint_bytes_per_rank(*shape, dtype_bytes, args.tp_size, pa)


def _estimate_placed(args, model, shape=None) -> int:
    """`zerodp estimate --offload`: bytes by place per world size and stage 1-3, and the
    largest model that fits the limits given (model states only; the checkpoints of `shape`
    are printed apart)."""
    from zerodp.memory import estimator as est

    kw = dict(k=args.k, param_bytes=args.param_bytes, grad_bytes=args.grad_bytes, tp_size=args.tp_size)
    stages = [s for s in args.stages if s > 0]
    if args.offload_params is not None:
        if args.offload is None:
            raise UsageError("--offload-params needs --offload host|disk (the optimizer steps where the shards are)")
        kw["offload_params"] = args.offload_params
        stages = [3]  # only stage 3 keeps parameter shards of its own
    limits = {"device": args.device_memory, "host": args.host_memory, "disk": args.disk}
    print(f"offload_optimizer={args.offload!r}"
          + (f", offload_params={args.offload_params!r}" if args.offload_params else "")
          + f": GB per rank (1e9 bytes), K={args.k:g}, "
          f"{args.param_bytes:g}-byte parameters" + (f", {model[0]} ({model[1]:,} parameters)" if model else "")
          + (f"; TP={args.tp_size}: Ψ/{args.tp_size} per rank, N = the data-parallel degree" if args.tp_size > 1
             else ""))
    print("| N | stage | device | host | disk | largest model within the limits |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.world_sizes:
        for stage in stages:
            b = est.placement_bytes(model[1] if model else 0, n, stage, args.offload, **kw)
            try:
                fits = f"{est.largest_model_placed(n, stage, args.offload, limits, **kw) / 1e9:.2f}B"
            except ValueError:
                fits = "—"
            cells = " | ".join(f"{b[p] / 1e9:.2f}" if model else "—" for p in est.PLACES)
            print(f"| {n} | {stage} | {cells} | {fits} |")
    if shape is not None and (args.partition_activations or args.activations_on_host or args.tp_size > 1):
        _print_checkpoints(args, shape, int(args.param_bytes))
    return 0


def check_estimate_flags(args: argparse.Namespace) -> None:
    """The numbers of `zerodp estimate`, each finite and in range, whichever table is asked for."""
    fraction = args.expert_fraction
    require(("--tp-size", args.tp_size, args.tp_size >= 1, "must be >= 1 (1 = no tensor parallelism)"),
            ("--ep-size", args.ep_size, args.ep_size >= 1, "must be >= 1 (1 = no expert parallelism)"),
            ("--expert-fraction", fraction, fraction is None or (math.isfinite(fraction) and 0 <= fraction <= 1),
             "use a fraction of the parameters between 0 and 1"),
            *(("--world-sizes", n, n >= 1, "not a world size (must be >= 1)") for n in args.world_sizes),
            ("-k", args.k, math.isfinite(args.k) and args.k >= 0, "use a finite number of bytes per parameter, >= 0"),
            ("--grad-bytes", args.grad_bytes, math.isfinite(args.grad_bytes) and args.grad_bytes >= 0,
             "use a finite number of bytes per parameter, >= 0"),
            ("--param-bytes", args.param_bytes, math.isfinite(args.param_bytes) and args.param_bytes > 0,
             "use a positive, finite number of bytes per parameter (2 for fp16/bf16, 4 for fp32)"))


def cmd_estimate(args: argparse.Namespace, argv: list[str]) -> int:
    from zerodp.memory import estimator as est

    check_estimate_flags(args)
    shape = _activation_shape(args)  # usage errors first, whichever table is asked for
    if args.offload is not None or args.offload_params is not None:
        return _estimate_placed(args, _resolve_model(args), shape)
    if args.paper_table_1:
        print("ZeRO (arXiv 1910.02054) Table 1: model-state GB per device, mixed-precision Adam (K=12)")
        print(est.format_table(est.paper_table_1()))
        return 0
    model = _resolve_model(args)
    if model is None and args.device_memory is None:
        raise UsageError("give --params, --model or --model-config (or --device-memory, or --paper-table-1)")
    if args.expert_fraction is not None:
        return _print_moe(args, model)
    tp = args.tp_size
    kw = dict(k=args.k, param_bytes=args.param_bytes, grad_bytes=args.grad_bytes, tp_size=tp)
    pa_flags = args.partition_activations or args.activations_on_host
    act = 0
    if shape is not None and not pa_flags:
        act = est.activation_bytes(*shape, args.checkpointing, dtype_bytes=int(args.param_bytes))
    print(f"model states per device: {args.param_bytes:g} B params + {args.grad_bytes:g} B grads "
          f"+ K={args.k:g} B optimizer state per parameter (ZeRO §3.1); GB = 1e9 bytes")
    if tp > 1:
        print(f"TP={tp}: each rank holds the states of Ψ/{tp} parameters, which ZeRO partitions over the "
              f"DP ranks (--world-sizes); world = DP x {tp} ranks (ZeRO Table 2: ZeRO-DP with MP)")
    if model is not None:
        label, psi = model
        rows = [est.MemoryRow(label, psi, n, s, est.model_state_bytes(psi, n, s, **kw), tp)
                for n in args.world_sizes for s in args.stages]
        print(f"\n{label}: Ψ = {psi:,} parameters")
        print(est.format_table(rows))
    if act:
        how = "with activation checkpointing" if args.checkpointing else "without checkpointing"
        print(f"\nactivations: {est.format_gb(act / est.GB)} GB per device ({how}; per-device batch "
              f"{args.batch}, not sharded by any stage; ZeRO §3.2)")
    if shape is not None and (pa_flags or tp > 1):
        # Pa and Pa+cpu act on the checkpoints: with them, the device keeps what they leave.
        kept = _print_checkpoints(args, shape, int(args.param_bytes))
        if pa_flags:
            act = kept
    if args.device_memory is not None:
        budget = args.device_memory - act
        print(f"\ndevice memory {est.format_gb(args.device_memory / est.GB)} GB"
              + (f", {est.format_gb(max(budget, 0) / est.GB)} GB left for model states" if act else ""))
        if budget <= 0:
            print("activations alone do not fit: reduce --batch-size or --seq-len, or use --checkpointing, "
                  "--partition-activations with --tp-size, or --activations-on-host")
            return 0
        header = ["DP"] + [est.STAGE_NAMES[s] for s in args.stages]
        lines = [header]
        for n in args.world_sizes:
            row = [str(n)]
            for s in args.stages:
                cap = est.largest_model(budget, n, s, **kw)
                fits = "" if model is None else (" *" if model[1] <= cap else "  ")
                row.append(f"{cap / 1e9:,.2f}B{fits}")
            lines.append(row)
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        print("largest model that fits (parameters" + (f", the whole model over TP={tp}" if tp > 1 else "")
              + ")" + (f"; * = {model[0]} fits" if model else ""))
        for line in lines:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    return 0


def _print_moe(args, model) -> int:
    """Model states per rank of an MoE model, experts apart, with and without expert
    parallelism (docs/moe.md, "What each rank holds")."""
    from zerodp.memory import estimator as est

    if model is None:
        raise UsageError("--expert-fraction needs the model's size: give --params, --model or --model-config")
    if args.tp_size > 1:
        raise UsageError("--expert-fraction with --tp-size: tensor and expert parallelism together are not built")
    label, psi = model
    f, ep = args.expert_fraction, args.ep_size
    print(f"{label}: Ψ = {psi:,} parameters, experts {f:.0%} of them; EP={ep}: each rank holds 1/{ep} of every "
          f"expert bank, ZeRO shards it over the N/{ep} ranks that hold the same experts (docs/moe.md); GB = 1e9 bytes")
    header = ["DP", "stage", "dense GB", "experts GB", "total GB", "total without EP GB"]
    lines = [header]
    kw = dict(k=args.k, param_bytes=args.param_bytes, grad_bytes=args.grad_bytes)
    for n in args.world_sizes:
        if n % ep:
            continue
        for s in args.stages:
            with_ep = est.moe_state_bytes(psi, n, s, f, ep, **kw)
            without = est.moe_state_bytes(psi, n, s, f, 1, **kw)
            lines.append([str(n), est.STAGE_NAMES[s]] + [est.format_gb(with_ep[c] / est.GB)
                                                         for c in ("dense", "experts", "total")]
                         + [est.format_gb(without["total"] / est.GB)])
    if len(lines) == 1:
        raise UsageError(f"--ep-size {ep} divides none of --world-sizes {args.world_sizes}")
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print(f"at stage 3 a rank gathers 1/{ep} of a layer's bank while the layer runs (without EP: all of it)")
    return 0


def add_arguments(e: argparse.ArgumentParser) -> None:
    from zerodp.memory import estimator

    e.add_argument("--params", type=parse_count, help="parameter count, e.g. 7.5e9")
    e.add_argument("--model", help=f"a model: {', '.join(estimator.PAPER_MODELS)} (paper) or a zerodp GPT preset")
    e.add_argument("--model-config", help="a GPT-2 style Hugging Face config.json")
    e.add_argument("--world-sizes", type=int, nargs="+", default=list(estimator.TABLE_1_WORLD_SIZES),
                   metavar="N", help="data-parallel degrees (default: Table 1's); with --tp-size the world "
                                     "is each of these x the TP degree")
    e.add_argument("--tp-size", type=int, default=1, metavar="N",
                   help="tensor-parallel degree (default 1): each rank holds the model states of Ψ/N "
                        "parameters, which ZeRO partitions over the data-parallel ranks; world = DP x TP")
    e.add_argument("--expert-fraction", type=float, default=None, metavar="F",
                   help="an MoE model: the fraction of its parameters in expert banks (0-1); prints its model "
                        "states with and without expert parallelism (docs/moe.md)")
    e.add_argument("--ep-size", type=int, default=1, metavar="K",
                   help="with --expert-fraction: Config.expert_parallel_size (default 1)")
    e.add_argument("--stages", type=int, nargs="+", choices=estimator.STAGES, default=list(estimator.STAGES),
                   metavar="S", help="ZeRO stages among 0 1 2 3 (default all)")
    e.add_argument("-k", type=float, default=12, help="optimizer bytes per parameter (12: mixed-precision Adam)")
    e.add_argument("--param-bytes", type=float, default=2, help="bytes per parameter (default 2: fp16/bf16)")
    e.add_argument("--grad-bytes", type=float, default=2, help="bytes per gradient element (default 2)")
    e.add_argument("--layers", type=int, metavar="L", help="activations: transformer layers")
    e.add_argument("--hidden", type=int, metavar="H", help="activations: hidden size")
    e.add_argument("--seq-len", "--seq", dest="seq", type=int, metavar="S", help="activations: sequence length")
    e.add_argument("--batch-size", "--batch", dest="batch", type=int, metavar="B",
                   help="activations: micro-batch per data-parallel rank (its TP ranks share it)")
    e.add_argument("--checkpointing", action="store_true", help="activations: one checkpoint per layer")
    e.add_argument("--partition-activations", action="store_true",
                   help="Pa (ZeRO §6.1): each layer's checkpoint split over the --tp-size ranks, "
                        "all-gathered before its recomputation (implies one checkpoint per layer)")
    e.add_argument("--activations-on-host", action="store_true",
                   help="the checkpoints live in host memory; with --partition-activations: Pa+cpu")
    e.add_argument("--device-memory", type=parse_size, help="bytes per device, e.g. 32GB: shows what fits")
    e.add_argument("--paper-table-1", action="store_true", help="print the paper's Table 1 and exit")
    e.add_argument("--offload", choices=("host", "disk"), default=None,
                   help="with Config.offload_optimizer: bytes per rank on the device, the host and the disk")
    e.add_argument("--offload-params", choices=("host", "disk"), default=None,
                   help="stage 3 with Config.offload_params: the parameter and gradient shards there too")
    e.add_argument("--host-memory", type=parse_size, help="--offload: host bytes per rank, e.g. 256GB")
    e.add_argument("--disk", type=parse_size, help="--offload disk: disk bytes per rank, e.g. 2TB")
