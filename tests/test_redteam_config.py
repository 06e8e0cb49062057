"""Configuration refused where it is given, in one error naming what and how to fix it: Config
files whose content breaks the parser or the validation (YAML aliases, deep nesting),
`zerodp train` flags that every rank would fail on or that would do nothing, and ranks that
disagree on the tensor-parallel plan (redteam_config_cases.py, world of 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import zerodp
from redteam_config_cases import plan_disagreement
from zerodp import cli
from zerodp.config import Config, ConfigError

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# -- Config files -----------------------------------------------------------------------
def _laughs(field: str, levels: int) -> str:
    """One field whose value's last item stands for 9**levels strings, through YAML aliases,
    in a few hundred bytes."""
    items = ['&l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    items += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return f"{field}: [{', '.join(items)}]\n"


# (file name, content, the field the message must name, or None where the parser cannot tell)
BAD_FILES = [
    ("alias_to_itself.yaml", "mixed_precision: &a [*a]\n", "mixed_precision"),
    ("alias_to_a_list.yaml", "unit_modules: &u [Block]\nmixed_precision: *u\n", "mixed_precision"),
    ("alias_to_a_mapping.yaml", "stage: 3\nquantize_grads: &q {bits: 8}\n", "quantize_grads"),
    ("alias_to_many.yaml", _laughs("stage", 7), "stage"),
    ("deep_list.json", "[" * 100_000, None),
    ("deep_mapping.json", '{"bucket_bytes": 1024, "stage": ' + '{"a": ' * 100_000, "stage"),
    ("deep_list.yaml", "[" * 100_000, None),
    ("deep_mapping.yaml", "bucket_bytes: 1024\nstage:\n" + "".join("  " * i + "a:\n" for i in range(1, 2000)),
     "stage"),
]


@pytest.mark.parametrize("name,content,field", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_config_file_that_breaks_the_parser_is_a_config_error_naming_file_field_and_fix(tmp_path, name, content,
                                                                                          field):
    path = tmp_path / name
    path.write_text(content)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        Config.from_file(path)
    msg = str(e.value)
    assert repr(str(path)) in msg, msg[:2000]
    if field is not None:
        assert f"Config.{field}" in msg, msg[:2000]
    assert "use " in msg or "fix the file" in msg, msg[:2000]
    # A value an alias made huge, or self-containing, is shown by its first items only.
    assert len(msg) < 1000 and time.perf_counter() - start < 2.0


@pytest.mark.parametrize("field", ["mixed_precision", "reduce_dtype", "quantize_grads"])
def test_a_list_or_mapping_where_a_name_is_expected_is_a_config_error(field):
    for value in (["bf16"], {"bf16": 1}):
        with pytest.raises(ConfigError, match=f"Config.{field}="):
            Config(**{field: value})


# -- zerodp train -------------------------------------------------------------------------
def _train(argv: list, capsys, monkeypatch) -> tuple[int, str, list]:
    """`zerodp train ARGV` in this process: (exit status, stderr, the torchrun commands it ran)."""
    launched = []
    monkeypatch.setattr(cli, "run_child", lambda cmd, env=None: launched.append(cmd) or 0)
    try:
        code = cli.main(["train", "--model", "tiny", *map(str, argv)])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err, launched


def _config(tmp_path, **fields) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


# (flags, a part of the one line) for runs every rank would fail, or whose flag would do nothing.
REFUSED = [
    (["--replicate-size", 3, "--nproc", 1], "--nproc 1: Config.replicate_size=3 needs that many ranks"),
    (["--replicate-size", 3, "--nproc", 4], "--nproc 4: Config.replicate_size=3 does not divide the 4"),
    (["--replicate-size", 2, "--nproc", 2, "--config", {"tensor_parallel_size": 2}],
     "Config.replicate_size=2 does not divide the 1 data-parallel ranks"),
    (["--nproc", 3, "--config", {"tensor_parallel_size": 2}], "tensor_parallel_size=2 does not divide the world "
                                                              "size 3"),
    (["--nproc", 4, "--config", {"tensor_parallel_size": 4}], "--model tiny has n_head=2, which does not split "
                                                              "into 4"),
    (["--nproc", 2, "--ckpt-every", 5, "--config", {"tensor_parallel_size": 2}], "run without --ckpt-every"),
    (["--nproc", 2, "--steps", 10, "--simulate-failure-at", 11, "--max-restarts", 1, "--ckpt-every", 2],
     "--simulate-failure-at 11: the run stops at --steps 10"),
    (["--nproc", 2, "--steps", 10, "--simulate-failure-at", 5], "--simulate-failure-at 5 tries --max-restarts"),
    (["--nproc", 2, "--steps", 10, "--simulate-failure-at", 5, "--ckpt-every", 2], "tries --max-restarts"),
    (["--nproc", 1, "--steps", 10, "--simulate-failure-at", 5, "--max-restarts", 1, "--ckpt-every", 2],
     "--nproc 1 has rank 0 only"),
]


@pytest.mark.parametrize("argv,expected", REFUSED, ids=[" ".join(str(a) for a in r[0] if not isinstance(a, dict))
                                                         for r in REFUSED])
def test_train_refuses_before_launching_in_one_line(argv, expected, tmp_path, capsys, monkeypatch):
    argv = [_config(tmp_path, **a) if isinstance(a, dict) else a for a in argv] + ["--out", tmp_path / "run"]
    code, err, launched = _train(argv, capsys, monkeypatch)
    assert not launched, f"launched ranks that each fail or ignore the flag; stderr: {err}"
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zerodp train: error: ") and expected in lines[0], err


def test_simulated_failure_before_the_checkpoint_resumed_from_is_refused(tmp_path, capsys, monkeypatch):
    """Every attempt resumes from the newest checkpoint; past the step, rank 1 never fails."""
    ckpt = tmp_path / "ckpt"
    monkeypatch.setattr(zerodp, "latest", lambda directory: str(ckpt / "step_000008")
                        if os.fspath(directory) == str(ckpt) else None)
    base = ["--nproc", 2, "--steps", 10, "--max-restarts", 1, "--ckpt-every", 2, "--ckpt-dir", ckpt]
    code, err, launched = _train(base + ["--simulate-failure-at", 6], capsys, monkeypatch)
    assert code == 2 and not launched
    assert "resumes from" in err and "step_000008" in err and "use a step from 9 to 10" in err, err
    code, err, launched = _train(base + ["--simulate-failure-at", 9], capsys, monkeypatch)
    assert code == 0 and len(launched) == 1, err


@pytest.mark.parametrize("argv", [
    ["--replicate-size", 2, "--nproc", 2],
    ["--replicate-size", "nodes", "--nproc", 2],
    ["--nproc", 4, "--replicate-size", 2, "--config", {"tensor_parallel_size": 2}],
    ["--nproc", 2, "--steps", 10, "--simulate-failure-at", 10, "--max-restarts", 1, "--ckpt-every", 2],
], ids=["hybrid", "nodes", "hybrid_tp", "failure_at_the_last_step"])
def test_train_launches_what_the_world_can_run(argv, tmp_path, capsys, monkeypatch):
    argv = [_config(tmp_path, **a) if isinstance(a, dict) else a for a in argv] + ["--out", tmp_path / "run"]
    code, err, launched = _train(argv, capsys, monkeypatch)
    assert code == 0 and len(launched) == 1, err


def test_a_mesh_larger_than_the_world_is_one_line_from_the_command(tmp_path):
    """The command itself, as a user runs it: no rank starts, so no rank's traceback."""
    proc = subprocess.run([sys.executable, "-m", "zerodp", "train", "--replicate-size", "3", "--nproc", "1",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "zerodp train: error: --nproc 1: Config.replicate_size=3 needs that many ranks at least; this is a single "
        "process: use 1"], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


# -- ranks that disagree on the tensor-parallel plan (world of 2) --------------------------------
@pytest.mark.parametrize("how", ["other_style", "fewer_modules", "hf_base_plan"])
def test_ranks_with_another_tensor_parallel_plan_fail_initialize_naming_it(pool, how):
    errors = pool.run(2, plan_disagreement, how, timeout_s=120)
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank}: initialize passed with the ranks' plans differing"
        assert error.startswith("ValueError: ") and "ranks disagree on the tensor-parallel plan" in error, error
        assert "rank 0 vs rank 1" in error and "Every rank must build the same" in error, error


def test_ranks_with_the_same_tensor_parallel_plan_pass_initialize(pool):
    assert pool.run(2, plan_disagreement, "same", timeout_s=120) == [None, None]
