"""The `zerodp` command: train | estimate | launch | bench | export.

Usage errors print one line on stderr and exit with status 2; a command that fails at
run time prints one line and exits 1 (a failed training job exits with its own status).
Processes are always started by torchrun (`python -m torch.distributed.run`).
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

PROG = "zerodp"
MAX_WORLD_SIZE = 64  # one node; more ranks take several nodes (`zerodp launch --nnodes`)
CPU_OVERSUBSCRIPTION = 4  # on CPU at most this many processes per core

from .common import Parser, UsageError, fail, one_line, require
from .estimate import add_arguments as add_estimate_arguments, cmd_estimate


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
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MAX_SEED = 2**63 - 1  # torch's generators take 64-bit seeds; the validation split's is seed + 1


def check_train_flags(args: argparse.Namespace) -> None:
    """Values every rank of the job would fail on (a traceback per rank, or a run that
    trains nothing), refused here in one line before anything is launched."""
    from zerodp.demo import data

    # Each window of the validation split (the shorter one) needs one token more than it holds.
    tokens = len(data.load_splits().get("val")) if args.block_size is not None else 0
    require(("--lr", args.lr, math.isfinite(args.lr) and args.lr > 0,
             "use a positive, finite learning rate such as 2e-3"),
            ("--ckpt-every", args.ckpt_every, args.ckpt_every >= 0,
             "use a number of steps >= 1, or 0 to save only at the end"),
            ("--eval-every", args.eval_every, args.eval_every is None or args.eval_every >= 1,
             "use a number of steps >= 1 (default: --steps / 10)"),
            ("--sample-tokens", args.sample_tokens, args.sample_tokens >= 0, "use a number of bytes >= 0 (0: none)"),
            ("--seed", args.seed, 0 <= args.seed <= MAX_SEED, f"use a seed from 0 to {MAX_SEED}"),
            ("--log-level", args.log_level, args.log_level.upper() in LOG_LEVELS,
             f"use one of {', '.join(LOG_LEVELS)}"),
            ("--block-size", args.block_size, args.block_size is None or args.block_size < tokens,
             f"the bundled corpus's validation split has {tokens:,} tokens: use fewer per sequence"))


def check_simulated_failure(args: argparse.Namespace, nproc: int) -> None:
    """--simulate-failure-at exists to try --max-restarts: refused where no rank would fail, or
    where nothing would restart it, rather than accepted and then silently without effect."""
    step = args.simulate_failure_at
    if step is None:
        return
    if step > args.steps:
        raise UsageError(f"--simulate-failure-at {step}: the run stops at --steps {args.steps}, so no rank would "
                         f"fail: use a step from 1 to {args.steps}")
    if nproc < 2:
        raise UsageError(f"--simulate-failure-at {step}: rank 1 fails, and --nproc {nproc} has rank 0 only: use "
                         f"--nproc 2 or more")
    if not args.max_restarts:
        raise UsageError(f"--simulate-failure-at {step} tries --max-restarts, which is 0 here: add --max-restarts 1 "
                         f"and --ckpt-every N (N < {step} to resume from a checkpoint)")
    from zerodp import latest
    from zerodp.demo.train import checkpoint_step

    newest = latest(args.ckpt_dir or os.path.join(args.out, "ckpt"))
    done = checkpoint_step(newest) if newest else None
    if done is not None and done >= step:
        raise UsageError(f"--simulate-failure-at {step}: the run resumes from {newest}, after step {step}, so no rank "
                         f"would fail: use a step from {done + 1} to {args.steps}, or another --out/--ckpt-dir")


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    import time

    from zerodp.config import ConfigError
    from zerodp.config_world import check_world
    from zerodp.demo.train import add_arguments, build_config, check_run, standalone_world, to_argv

    nproc = check_nproc(args.nproc)
    check_train_flags(args)
    if args.config and not os.path.isfile(args.config):
        raise UsageError(f"--config {args.config}: no such file")
    # A bad file, flags that leave a setting of it without effect, or a Config this world
    # cannot run is one usage line here, not a traceback from every rank.
    try:
        cfg = build_config(args)  # a file's errors name the file; the flags' name the flags
        check_run(args, cfg)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    except OSError as e:  # the file exists but cannot be read
        raise UsageError(f"--config {args.config}: {e}") from None
    try:
        check_world(cfg, standalone_world(cfg, nproc))
    except ConfigError as e:
        raise UsageError(f"--nproc {nproc}: {e}") from None
    if args.resume and not args.ckpt_dir and not args.out:
        raise UsageError("--resume needs --ckpt-dir (or the --out of the run to continue)")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: use 0 or more")
    if args.max_restarts and not args.ckpt_every:
        raise UsageError("--max-restarts needs --ckpt-every N: a restarted run resumes from the newest checkpoint")
    args.out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    check_simulated_failure(args, nproc)
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


def check_launch_flags(args: argparse.Namespace) -> None:
    """torchrun's own numbers, checked before it is started (it answers with a traceback)."""
    bounds = args.nnodes.split(":")
    whole = len(bounds) <= 2 and all(b.isdigit() and int(b) >= 1 for b in bounds)
    port = args.rdzv_endpoint.rpartition(":")[2] if args.rdzv_endpoint and ":" in args.rdzv_endpoint else "1"
    require(("--nnodes", args.nnodes, whole and int(bounds[0]) <= int(bounds[-1]),
             "use a number of nodes >= 1, or MIN:MAX with 1 <= MIN <= MAX"),
            ("--node-rank", args.node_rank, args.node_rank >= 0 and not (whole and len(bounds) == 1
                                                                      and args.node_rank >= int(bounds[0])),
             "use 0 to --nnodes - 1"),
            ("--master-port", args.master_port, 1 <= args.master_port <= 65535, "a port must be from 1 to 65535"),
            ("--rdzv-endpoint", args.rdzv_endpoint, port.isdigit() and 1 <= int(port) <= 65535,
             "use HOST:PORT with a port from 1 to 65535"))


def cmd_launch(args: argparse.Namespace, argv: list[str]) -> int:
    args.nproc_checked = check_nproc(args.nproc)
    check_launch_flags(args)
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
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint fails in many ways; each is one line
        return fail("zerodp export", one_line(f"{type(e).__name__}: {e}"))
    print(f"wrote {args.out_file}")
    return 0


# -- the parser -----------------------------------------------------------------------------
def build_parser() -> Parser:
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
    add_estimate_arguments(e)


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
    except (UsageError, ValueError) as e:  # the estimator's ValueErrors too: all it gets is the command line
        if not isinstance(e, UsageError) and args.command != "estimate":
            raise
        return fail(f"{PROG} {args.command}", str(e), 2)


if __name__ == "__main__":
    sys.exit(main())
