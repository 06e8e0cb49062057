"""The `zerodp` command: train | estimate | launch | bench | export.

Usage errors print one line on stderr and exit with status 2; a command that fails at
run time prints one line and exits 1 (a failed training job exits with its own status).
Processes are always started by torchrun (`python -m torch.distributed.run`).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

PROG = "zerodp"
MAX_WORLD_SIZE = 64  # one node; more ranks take several nodes (`zerodp launch --nnodes`)
CPU_OVERSUBSCRIPTION = 4  # on CPU at most this many processes per core


class UsageError(Exception):
    """A mistake in the command line; reported in one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (no usage block) and exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def fail(prog: str, message: str, status: int = 1) -> int:
    sys.stderr.write(f"{prog}: error: {message}\n")
    return status


# -- world size ---------------------------------------------------------------------------
def max_local_procs() -> tuple[int, str]:
    """How many processes one node may run, and why: one per GPU with CUDA; on CPU, at most
    4 per core and at most 64 (more only oversubscribes the cores: gloo ranks share them)."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return n, f"one process per GPU and this node has {n} GPU(s)"
    cores = os.cpu_count() or 1
    n = min(MAX_WORLD_SIZE, CPU_OVERSUBSCRIPTION * cores)
    return n, f"on CPU at most {CPU_OVERSUBSCRIPTION} processes per core ({cores} cores) and at most {MAX_WORLD_SIZE}"


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def check_nproc(nproc: Optional[int]) -> int:
    nproc = default_nproc() if nproc is None else nproc
    limit, why = max_local_procs()
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: the world size must be at least 1")
    if nproc > limit:
        raise UsageError(f"--nproc {nproc} is larger than allowed here ({limit}: {why})")
    return nproc


def torchrun_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores; torchrun would set it and warn
    return env


def run_child(cmd: list[str], env: Optional[dict] = None) -> int:
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


# -- train ----------------------------------------------------------------------------------
def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    import time

    from zerodp.config import Config
    from zerodp.demo.train import add_arguments, to_argv

    nproc = check_nproc(args.nproc)
    if args.config:
        if not os.path.isfile(args.config):
            raise UsageError(f"--config {args.config}: no such file")
        try:  # a bad file is a one-line usage error here, not a traceback from every rank
            Config.from_file(args.config)
        except Exception as e:  # ConfigError, JSON/YAML syntax
            raise UsageError(f"--config {args.config}: {e}") from None
    if args.resume and not args.ckpt_dir and not args.out:
        raise UsageError("--resume needs --ckpt-dir (or the --out of the run to continue)")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: use 0 or more")
    if args.max_restarts and not args.ckpt_every:
        raise UsageError("--max-restarts needs --ckpt-every N: a restarted run resumes from the newest checkpoint")
    args.out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    if args.max_restarts:
        args.resume = True  # every attempt resumes from the newest complete checkpoint, if there is one
    template = argparse.ArgumentParser(add_help=False)
    add_arguments(template)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max-restarts", str(args.max_restarts), "-m", "zerodp.demo.train", *to_argv(args, template)]
    status = run_child(cmd, torchrun_env())
    if status != 0:
        return fail("zerodp train", f"training failed (exit status {status}); the ranks' messages are above",
                    status)
    return 0


# -- estimate -------------------------------------------------------------------------------
def parse_size(text: str) -> float:
    """'32GB' -> 32e9 (the paper's GB), '80GiB' -> 80 * 2**30, '16e9' -> 16e9 bytes."""
    units = {"tib": 2**40, "gib": 2**30, "mib": 2**20, "tb": 1e12, "gb": 1e9, "mb": 1e6, "t": 1e12,
             "g": 1e9, "m": 1e6, "b": 1}
    t = text.strip().lower()
    for suffix, factor in units.items():
        if t.endswith(suffix):
            number, scale = t[: -len(suffix)], factor
            break
    else:
        number, scale = t, 1
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 32GB, 80GiB or 16e9") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a device memory must be positive")
    return value


def parse_count(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count such as 7.5e9") from None
    if value < 1 or value != value:
        raise argparse.ArgumentTypeError(f"{text!r}: a parameter count must be at least 1")
    return int(round(value))


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


def cmd_estimate(args: argparse.Namespace, argv: list[str]) -> int:
    from zerodp.memory import estimator as est

    if args.tp_size < 1:
        raise UsageError(f"--tp-size {args.tp_size}: must be >= 1 (1 = no tensor parallelism)")
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
    for n in args.world_sizes:
        if n < 1:
            raise UsageError(f"--world-sizes: {n} is not a world size (must be >= 1)")
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


# -- launch ---------------------------------------------------------------------------------
def torchrun_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc_checked)]
    multi_node = args.nnodes != "1" or args.rdzv_endpoint or args.master_addr
    if not multi_node:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", args.nnodes]
        if args.rdzv_endpoint:
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id]
        else:
            cmd += ["--node-rank", str(args.node_rank), "--master-addr", args.master_addr,
                    "--master-port", str(args.master_port)]
    if args.module:
        cmd.append("-m")
    return cmd + [args.script, *args.script_args]


def cmd_launch(args: argparse.Namespace, argv: list[str]) -> int:
    args.nproc_checked = check_nproc(args.nproc)
    if args.nnodes != "1" and not (args.rdzv_endpoint or args.master_addr):
        raise UsageError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT "
                         "(or --master-addr with --node-rank)")
    if args.master_addr and args.rdzv_endpoint:
        raise UsageError("give --rdzv-endpoint or --master-addr, not both")
    if not args.module and not os.path.isfile(args.script):
        raise UsageError(f"{args.script}: no such script (use -m for a module)")
    return run_child(torchrun_command(args), torchrun_env())


# -- bench, export --------------------------------------------------------------------------
def find_bench() -> Optional[Path]:
    here = Path(__file__).resolve().parents[2]  # the source checkout, for an editable install
    for root in (Path.cwd(), here):
        path = root / "benchmarks" / "bench.py"
        if path.is_file():
            return path
    return None


def cmd_bench(argv: list[str]) -> int:
    path = find_bench()
    if path is None:
        return fail("zerodp bench", "benchmarks/bench.py not found (looked in the current directory and "
                    "the zerodp source checkout): run it from a zerodp source checkout that has benchmarks/")
    return run_child([sys.executable, str(path), *argv], torchrun_env())


def cmd_export(args: argparse.Namespace, argv: list[str]) -> int:
    import zerodp

    export = zerodp.export
    if not os.path.exists(args.checkpoint):
        raise UsageError(f"{args.checkpoint}: no such checkpoint")
    try:
        export(args.checkpoint, args.out_file)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        return fail("zerodp export", f"{type(e).__name__}: {e}")
    print(f"wrote {args.out_file}")
    return 0


# -- the parser -----------------------------------------------------------------------------
def build_parser() -> Parser:
    from zerodp.memory import estimator
    from zerodp.demo.train import add_arguments

    p = Parser(prog=PROG, description="ZeRO data parallelism for PyTorch (arXiv 1910.02054).")
    p.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    sub = p.add_subparsers(dest="command", metavar="{train,estimate,launch,bench,export}")

    t = sub.add_parser("train", help="train the bundled GPT on the bundled corpus with ZeRO (the demo)",
                       description="Train the bundled GPT on the bundled corpus with ZeRO, one process per "
                                   "rank under torchrun (gloo on CPU, NCCL on GPUs).")
    add_arguments(t)

    e = sub.add_parser("estimate", help="model-state memory per device (the paper's model)",
                       description="Bytes per device of parameters, gradients and optimizer states for "
                                   "each ZeRO stage and world size (ZeRO §5, Table 1).")
    e.add_argument("--params", type=parse_count, help="parameter count, e.g. 7.5e9")
    e.add_argument("--model", help=f"a model: {', '.join(estimator.PAPER_MODELS)} (paper) or a zerodp GPT preset")
    e.add_argument("--model-config", help="a GPT-2 style Hugging Face config.json")
    e.add_argument("--world-sizes", type=int, nargs="+", default=list(estimator.TABLE_1_WORLD_SIZES),
                   metavar="N", help="data-parallel degrees (default: Table 1's); with --tp-size the world "
                                     "is each of these x the TP degree")
    e.add_argument("--tp-size", type=int, default=1, metavar="N",
                   help="tensor-parallel degree (default 1): each rank holds the model states of Ψ/N "
                        "parameters, which ZeRO partitions over the data-parallel ranks; world = DP x TP")
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

    la = sub.add_parser("launch", help="run a script on several processes or nodes (a thin torchrun wrapper)",
                        description="zerodp launch --nproc 4 train.py ARGS  ==  torchrun --standalone "
                                    "--nproc_per_node 4 train.py ARGS. Flags go before the script.")
    la.add_argument("--nproc", type=int, default=None, help="processes on this node (default: GPUs, else 2)")
    la.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic (default 1)")
    la.add_argument("--node-rank", type=int, default=0, help="this node's rank (with --master-addr)")
    la.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (multi-node)")
    la.add_argument("--rdzv-id", default="zerodp", help="rendezvous job id (default zerodp)")
    la.add_argument("--master-addr", help="address of node 0 (static rendezvous, with --node-rank)")
    la.add_argument("--master-port", type=int, default=29500, help="port on node 0 (default 29500)")
    la.add_argument("-m", "--module", action="store_true", help="the script is a Python module (python -m)")
    la.add_argument("script", help="the training script (or module with -m)")
    la.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    sub.add_parser("bench", add_help=False, help="run benchmarks/bench.py (arguments are passed through)")

    x = sub.add_parser("export", help="write a checkpoint as one consolidated .safetensors file",
                       description="Consolidate a sharded zerodp checkpoint into one safetensors file.")
    x.add_argument("checkpoint", help="checkpoint directory (e.g. runs/.../ckpt/step_000250)")
    x.add_argument("out_file", help="output .safetensors file")
    return p


def _package_version() -> str:
    from zerodp import __version__

    return __version__


COMMANDS = {"train": cmd_train, "estimate": cmd_estimate, "launch": cmd_launch, "export": cmd_export}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after `bench` belongs to bench.py
        return cmd_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command](args, argv[1:])
    except UsageError as e:
        sys.stderr.write(f"{PROG} {args.command}: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
