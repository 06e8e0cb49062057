"""The `zerodp` command: an end-to-end training run, the estimator's output, launch's
command line, and one-line usage errors."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

import zerodp
from zerodp import cli

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def zerodp_cmd(*args, timeout=120, cwd=None):
    """Run `python -m zerodp ARGS` (the same entry point as the console script)."""
    return subprocess.run([sys.executable, "-m", "zerodp", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=cwd)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One 2-rank run of the tiny GPT, shared by the tests that inspect its outputs."""
    out = tmp_path_factory.mktemp("run")
    stage = 3
    args = ["train", "--model", "tiny", "--nproc", 2, "--stage", stage, "--steps", 24, "--lr", "1e-2",
            "--eval-every", 8, "--sample-tokens", 16, "--out", out]
    args += ["--ckpt-dir", out / "ckpt", "--ckpt-every", 12]
    proc = zerodp_cmd(*args, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc, stage


def test_train_end_to_end(tiny_run):
    out, proc, stage = tiny_run
    s = json.loads((out / "summary.json").read_text())
    assert s["stage"] == stage and s["world_size"] == 2 and s["model"] == "tiny"
    assert len(s["losses"]) == 24 and len(s["val_losses"]) == 3
    # The loss falls clearly: from ln(256) = 5.5 for uniform bytes to well under 4.
    assert s["loss"]["first"] > 5.0
    assert s["loss"]["last"] < s["loss"]["first"] - 1.5
    assert s["val_losses"][-1][1] < s["val_losses"][0][1]
    # Model state per rank is the stage's formula, below DDP's, and the step's volume the paper's.
    psi = s["numel"]
    assert psi == 34_688
    assert s["memory"]["model_state"] < s["model_state_ddp_nbytes"]
    assert s["model_state_ddp_nbytes"] == 16 * psi  # fp32 AdamW: 4 + 4 + 8 bytes per parameter
    assert abs(s["memory"]["model_state"] - s["model_state_formula_nbytes"]) <= 16 * 2  # padding to N
    assert abs(s["volume_numel_last_step"] - s["volume_factor"] * psi) <= s["volume_factor"] * 2
    assert (out / "summary.png").stat().st_size > 10_000
    assert s["sample"].startswith("LOVE, n.")
    assert "model state / rank" in proc.stdout and "comm / step" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_train_checkpoint_resume_and_export(tiny_run, tmp_path):
    out, _, stage = tiny_run
    ckpts = sorted(os.listdir(out / "ckpt"))
    assert ckpts == ["step_000012", "step_000024"]
    assert zerodp.latest(out / "ckpt").endswith("step_000024")
    proc = zerodp_cmd("train", "--model", "tiny", "--nproc", 2, "--stage", stage, "--steps", 28, "--lr", "1e-2",
                      "--eval-every", 8, "--sample-tokens", 0, "--out", tmp_path / "more",
                      "--ckpt-dir", out / "ckpt", "--resume")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "resumed from" in proc.stdout and "at step 24" in proc.stdout
    s = json.loads((tmp_path / "more" / "summary.json").read_text())
    assert [step for step, _ in s["losses"]] == list(range(28))  # history carried over, 4 new steps
    target = tmp_path / "model.safetensors"
    assert cli.main(["export", str(out / "ckpt" / "step_000024"), str(target)]) == 0
    from safetensors.torch import load_file

    from zerodp.demo.models import GPT

    GPT("tiny").load_state_dict(load_file(str(target)), strict=True)


# Stage 3 only: what is killed and resumed is the checkpoint's writing and reading, which
# every stage shares (each stage's save and load is tested bit for bit in test_checkpoint.py).
@pytest.mark.parametrize("stage, plan", [(3, ["save", "step"])], ids=["stage3"])
def test_sigkill_mid_save_and_mid_step_restarts_and_resumes_bit_for_bit(stage, plan, tiny_run, tmp_path):
    """`zerodp train --max-restarts`, passed through to torchrun: a random rank SIGKILLed twice,
    seeded: while a checkpoint is being written, then at a random moment of training in the
    run resumed from the save before it. torchrun restarts the workers, each attempt resumes
    from the newest complete checkpoint, and the losses equal the uninterrupted run's (tiny_run's:
    the same run but for how often it saves and samples, which draw nothing from the training's
    RNG) bit for bit; no unfinished save is left behind, and --keep-last leaves the 2 newest."""
    from faults import run_with_kills

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zerodp", "train", "--model", "tiny", "--nproc", "2", "--stage", str(stage),
           "--steps", "24", "--lr", "1e-2", "--eval-every", "8", "--sample-tokens", "0", "--ckpt-every", "1",
           "--keep-last", "2", "--max-restarts", str(len(plan)), "--out", str(out)]
    reference = json.loads((tiny_run[0] / "summary.json").read_text())["losses"]
    proc, kills = run_with_kills(cmd, ENV, str(out / "ckpt"), plan, seed=stage, nproc=2, timeout=240)
    assert proc.returncode == 0, (kills, proc.stderr[-5000:])
    assert [k["kind"] for k in kills] == plan
    assert sum(k["was_saving"] for k in kills) >= plan.count("save"), kills
    assert proc.stdout.count("resumed from") == len(plan), proc.stdout[-3000:]
    got = json.loads((out / "summary.json").read_text())["losses"]
    assert got == reference, (kills, got, reference)
    assert sorted(os.listdir(out / "ckpt")) == ["step_000023", "step_000024"]


def two_torchrun_nodes(tmp_path, *args: str) -> dict:
    """Two torchrun launches, --nnodes 2 with two processes each, static rendezvous on
    127.0.0.1, of the demo with `args`; returns its summary."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = ["-m", "zerodp.demo.train", "--model", "tiny", "--stage", "3", "--steps", "8", "--lr", "1e-2",
           "--batch-size", "4", "--eval-every", "8", "--sample-tokens", "0", "--out", str(tmp_path / "two"), *args]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               *job], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
             for r in (0, 1)]
    outs = [n.communicate(timeout=150) for n in nodes]
    for n, (out, err) in zip(nodes, outs):
        assert n.returncode == 0, err[-4000:]
    s = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert s["world_size"] == 4 and s["stage"] == 3 and len(s["losses"]) == 8
    return s


def test_two_torchrun_nodes_train_stage_3_and_resume_on_one_node(tmp_path):
    """Stage 3 with hybrid sharding by node (Config.replicate_size="nodes": the mesh's rows
    are what torchrun calls nodes) and ZeRO++'s quantized weight gathers, from a --config
    file the flags add to, trains to completion across two torchrun "nodes": the gathers stay
    inside each launch's two ranks, the gradients' replica all-reduce crosses. Its checkpoint
    then resumes without either on one node at world size 1. (hpZ and qgZ split the shard
    axis by node, which hybrid sharding already keeps inside one: their bytes per link with
    nodes as torchrun numbers them are test_zeropp.py's, the same ranks_per_node.)"""
    config = tmp_path / "zeropp.json"
    config.write_text(json.dumps({"stage": 3, "quantize_weights": True}))
    s = two_torchrun_nodes(tmp_path, "--config", str(config), "--replicate-size", "nodes", "--ckpt-every", "4")
    assert s["mesh"] == {"replicate": 2, "shard": 2} and s["config"]["replicate_size"] == 2
    assert s["config"]["quantize_weights"] is True
    link = s["nbytes_by_link_last_step"]
    assert link["intra_node"] > 0 and link["inter_node"] > 0, link
    assert s["losses"][-1][1] < s["losses"][0][1]
    assert sorted(os.listdir(tmp_path / "two" / "ckpt")) == ["step_000004", "step_000008"]
    proc = zerodp_cmd("train", "--model", "tiny", "--nproc", 1, "--stage", 3, "--steps", 10, "--lr", "1e-2",
                      "--eval-every", 10, "--sample-tokens", 0, "--ckpt-dir", tmp_path / "two" / "ckpt", "--resume",
                      "--out", tmp_path / "one", timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "at step 8" in proc.stdout
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert one["world_size"] == 1 and [step for step, _ in one["losses"]] == list(range(10))
    assert one["losses"][:8] == s["losses"]  # the history came with the checkpoint


def test_max_restarts_needs_checkpoints(capsys):
    assert cli.main(["train", "--max-restarts", "2"]) == 2
    assert "--max-restarts needs --ckpt-every" in capsys.readouterr().err


def test_estimate_paper_table_1(capsys):
    assert cli.main(["estimate", "--paper-table-1"]) == 0
    out = capsys.readouterr().out
    for cell in ("31.4", "16.6", "1.88", "120", "7.5B", "1T"):
        assert cell in out


def test_estimate_fits(capsys):
    assert cli.main(["estimate", "--params", "7.5e9", "--world-sizes", "1", "64", "--device-memory", "32GB"]) == 0
    out = capsys.readouterr().out
    assert "1.88" in out and "120" in out  # stage 3 at N=64, and DDP
    # 32 GB / 16 bytes = 2B parameters at DP=1; stage 3 at N=64 fits 128B.
    assert "2.00B" in out and "128.00B *" in out


@pytest.mark.parametrize("argv, expected", [
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--nproc", "100000"], "--nproc 100000 is larger than allowed"),
    (["train", "--stage", "7"], "invalid choice: 7"),
    (["train", "--precision", "fp8"], "invalid choice: 'fp8'"),
    (["estimate"], "give --params, --model or --model-config"),
    (["estimate", "--params", "lots"], "not a parameter count"),
    (["launch", "--nproc", "100000", "x.py"], "larger than allowed"),
    (["launch", "--nnodes", "2", "x.py"], "needs --rdzv-endpoint"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    # Issue 22 item 24: every number of every subcommand, for nan, inf, negatives and zero.
    (["estimate", "--params", "inf"], "'inf': a parameter count must be a finite number"),
    (["estimate", "--params", "nan"], "'nan': a parameter count must be a finite number"),
    (["estimate", "--params", "-5"], "a parameter count must be a finite number, at least 1"),
    (["estimate", "--params", "1e9", "-k", "nan"], "-k nan: use a finite number of bytes per parameter"),
    (["estimate", "--params", "1e9", "-k", "-20"], "-k -20: use a finite number"),
    (["estimate", "--params", "1e9", "--param-bytes", "0"], "--param-bytes 0: use a positive, finite number"),
    (["estimate", "--params", "1e9", "--param-bytes", "inf"], "--param-bytes inf: use a positive, finite"),
    (["estimate", "--params", "1e9", "--grad-bytes", "-2"], "--grad-bytes -2: use a finite number"),
    (["estimate", "--params", "1e9", "--device-memory", "nan"], "'nan': a memory size must be a positive, finite"),
    (["estimate", "--params", "1e9", "--device-memory", "inf"], "'inf': a memory size must be a positive, finite"),
    (["estimate", "--params", "1e9", "--device-memory", "0GB"], "a memory size must be a positive"),
    (["estimate", "--params", "1e9", "--offload", "host", "--host-memory", "infGB"], "a memory size must be"),
    (["estimate", "--params", "1e9", "--offload", "disk", "--disk", "nan"], "a memory size must be"),
    (["estimate", "--params", "1e9", "--offload", "host", "--world-sizes", "0"], "--world-sizes 0: not a world size"),
    (["estimate", "--params", "1e9", "--world-sizes", "-4"], "--world-sizes -4: not a world size"),
    (["train", "--lr", "-1"], "--lr -1: use a positive, finite learning rate"),
    (["train", "--lr", "0"], "--lr 0: use a positive, finite learning rate"),
    (["train", "--lr", "nan"], "--lr nan: use a positive, finite learning rate"),
    (["train", "--lr", "inf"], "--lr inf: use a positive, finite learning rate"),
    (["train", "--ckpt-every", "-5"], "--ckpt-every -5: use a number of steps >= 1, or 0"),
    (["train", "--eval-every", "0"], "--eval-every 0: use a number of steps >= 1"),
    (["train", "--eval-every", "-3"], "--eval-every -3: use a number of steps >= 1"),
    (["train", "--sample-tokens", "-1"], "--sample-tokens -1: use a number of bytes >= 0 (0: none)"),
    (["train", "--seed", "-1"], "--seed -1: use a seed from 0 to"),
    (["train", "--seed", str(2**64)], "use a seed from 0 to"),
    (["train", "--log-level", "loud"], "--log-level loud: use one of DEBUG"),
    (["train", "--block-size", "100000"], "--block-size 100000: the bundled corpus's validation split has"),
    (["train", "--steps", "0"], "'0' is not a positive integer"),
    (["train", "--grad-accum", "-1"], "'-1' is not a positive integer"),
    (["train", "--keep-last", "0"], "'0' is not a positive integer"),
    (["train", "--nproc", "0"], "--nproc 0: the world size must be at least 1"),
    (["train", "--max-restarts", "-1"], "--max-restarts -1: use 0 or more"),
    (["launch", "--nproc", "-2", "x.py"], "--nproc -2: the world size must be at least 1"),
    (["launch", "--nnodes", "abc", "x.py"], "--nnodes abc: use a number of nodes >= 1"),
    (["launch", "--nnodes", "0", "x.py"], "--nnodes 0: use a number of nodes >= 1"),
    (["launch", "--nnodes", "3:2", "x.py"], "MIN:MAX with 1 <= MIN <= MAX"),
    (["launch", "--node-rank", "-1", "x.py"], "--node-rank -1: use 0 to --nnodes - 1"),
    (["launch", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "x.py"], "--node-rank 2: use 0 to"),
    (["launch", "--master-port", "0", "x.py"], "--master-port 0: a port must be from 1 to 65535"),
    (["launch", "--master-port", "70000", "x.py"], "--master-port 70000: a port must be from 1 to 65535"),
    (["launch", "--nnodes", "2", "--rdzv-endpoint", "node0:0", "x.py"], "use HOST:PORT with a port from 1"),
    (["export", "/no/such/checkpoint", "out.safetensors"], "/no/such/checkpoint: no such checkpoint"),
])
def test_usage_errors_are_one_line(argv, expected, capsys):
    # In this process (the command line's own main); the entry point itself is run below.
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected in lines[0] and lines[0].startswith("zerodp")


def test_usage_error_from_the_entry_point():
    proc = zerodp_cmd("train", "--stage", "7", timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [l for l in proc.stderr.strip().splitlines() if "invalid choice: 7" in l]


def test_export_of_a_malformed_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    """Whatever the checkpoint layer raises for a damaged checkpoint reaches the user as one
    line, exit status 1, no traceback: its own ValueError, and any other error, even one
    whose text spans lines."""
    bad = tmp_path / "step_000001"
    bad.mkdir()
    (bad / "COMPLETE").write_text("{not json")
    (bad / "metadata.json").write_text("{}")
    assert cli.main(["export", str(bad), str(tmp_path / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerodp export: error: ") and str(bad) in err, err

    def damaged(checkpoint, out):
        raise TypeError("a piece that is not a list\nsecond line of detail")
    monkeypatch.setattr(zerodp, "export", damaged)
    assert cli.main(["export", str(bad), str(tmp_path / "out.safetensors")]) == 1
    err = capsys.readouterr().err
    assert err == "zerodp export: error: TypeError: a piece that is not a list second line of detail\n", err


def test_help(capsys):
    # In this process: the entry point itself is test_usage_error_from_the_entry_point's.
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for command in ("train", "estimate", "launch", "bench", "export"):
        assert command in out
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0 and "--grad-accum" in capsys.readouterr().out


def test_launch_command_line():
    p = cli.build_parser()
    args = p.parse_args(["launch", "--nproc", "2", "train.py", "--lr", "3e-4", "--nproc", "9"])
    args.nproc_checked = 2
    cmd = cli.torchrun_command(args)
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                       "train.py", "--lr", "3e-4", "--nproc", "9"]
    args = p.parse_args(["launch", "--nproc", "8", "--nnodes", "2", "--rdzv-endpoint", "node0:29400",
                         "-m", "mypkg.train"])
    args.nproc_checked = 8
    cmd = cli.torchrun_command(args)
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "node0:29400" and cmd[-2:] == ["-m", "mypkg.train"]
    args = p.parse_args(["launch", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "t.py"])
    args.nproc_checked = 1
    cmd = cli.torchrun_command(args)
    assert cmd[cmd.index("--node-rank") + 1] == "1" and cmd[cmd.index("--master-addr") + 1] == "10.0.0.1"


def test_train_forwards_full_flag_names():
    """torchrun's parser would claim --nproc (a prefix of its --nproc-per-node); the job gets
    the parsed flags re-stated in full, without --nproc."""
    from zerodp.demo.train import add_arguments, to_argv

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--nproc", "2", "--ste", "7", "--resume", "--precision", "bf16"])
    assert to_argv(args, p) == ["--precision", "bf16", "--steps", "7", "--resume"]


def test_launch_runs_example(tmp_path):
    proc = zerodp_cmd("launch", "--nproc", 2, "examples/ddp_to_zerodp.py", "--steps", 3,
                      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step 3" in proc.stdout


def test_bench_missing_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "find_bench", lambda: None)
    assert cli.main(["bench", "--quick"]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_train_refuses_a_config_file_that_the_flags_make_ineffective_in_one_line(tmp_path, capsys, monkeypatch):
    # `zerodp train` checks the Config before launching, so that a bad one is one usage line
    # rather than a traceback from every rank: the file with the flags applied on top (here
    # --precision bf16 over a file that tunes fp16's loss scale, which then has no effect).
    config = tmp_path / "fp16.json"
    config.write_text(json.dumps({"mixed_precision": "fp16", "loss_scale": 1024}))
    launched = []
    monkeypatch.setattr(cli, "run_child", lambda cmd, env=None: launched.append(cmd) or 0)
    try:
        code = cli.main(["train", "--nproc", "1", "--config", str(config), "--precision", "bf16",
                         "--out", str(tmp_path / "run")])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert not launched, "launched ranks that will each fail building the Config"
    assert code == 2 and "loss_scale" in err and "Traceback" not in err
