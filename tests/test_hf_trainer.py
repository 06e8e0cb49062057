"""Hugging Face's Trainer with zerodp (zerodp.integrations.hf.Trainer).

- The grid (hf_trainer_cases.py, one spawned world of 2 ranks): stages 0-3 x
  reduce_each_micro_batch True / False x fp32 / bf16, 2 micro-batches per step, against the
  plain transformers.Trainer under torch DDP on the same data from the same seed, the
  losses and gradient norms the Trainers log at every step; an epoch that ends with a short
  window; the Trainer under tensor parallelism against DDP on the same global batches; a run
  that fails while it saves a checkpoint, resumed.
- The example script as the README runs it (`zerodp launch --nproc 2 examples/hf_trainer.py`):
  a tiny Llama, the Trainer's AdamW, warmup and decay, accumulation over 3 micro-batches
  with short windows at epoch ends, clipping, evaluation and a checkpoint every 3 steps;
  resumed from its step-3 checkpoint, bit for bit the run that went straight on.
"""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from hf_trainer_cases import GRID  # noqa: E402
from tp_slices import CHAIN_ROUNDING, sgd_bound  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--max-steps", 6, "--save-steps", 3, "--accumulation", 3, "--train-windows", 20]


# -- the grid --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grid(tmp_path_factory, pool):
    from hf_trainer_cases import trainer_world

    return pool.run(2, trainer_world, str(tmp_path_factory.mktemp("grid")), timeout_s=400)


def fp32_loss_bound(ddp: dict, step: int, numel: int) -> float:
    """How far a step's loss can be from DDP's in fp32 ([Note: rounding bounds of the
    tensor-parallel tests], tests/tp_slices.py; this model's sums are as narrow as the notes':
    hidden 32, MLP 64, heads of 16, 16 tokens, a vocabulary of 256, 64 tokens a step, so
    CHAIN = 2000 holds). The first step's loss comes from the same weights, so only the
    forward's sums differ: CHAIN_ROUNDING of the magnitudes in play, the loss's. Later, the
    weights are apart by at most W, SGD's bound (step 5 of the note; no momentum; clipping
    does not act, and the largest gradient element is at most the gradient's norm, which the
    Trainer logs), and the loss moves by at most ||grad||_1 W <= sqrt(P) ||grad||_2 W (first
    order; the second is W^2-small)."""
    from hf_trainer_cases import LR

    forward = CHAIN_ROUNDING * (1 + abs(ddp["loss"][step]))
    if step == 1:
        return forward
    apart = sgd_bound(LR["fp32"], 0.0, [ddp["grad_norm"][j] for j in range(1, step)], clipped_numel=numel)
    return forward + math.sqrt(numel) * ddp["grad_norm"][step] * apart


def fp32_norm_rtol(numel: int) -> float:
    """The first step's gradient norm: the same weights, sums in another order (steps 2-4)."""
    from tp_slices import rounding

    return rounding(numel)


# bf16 trains at lr 0 (hf_trainer_cases.LR): zerodp computes in bf16 weights and activations
# with an fp32 master, DDP's Trainer under autocast (fp32 weights, bf16 matmuls, the residual
# stream and norms in fp32). The two round at other places, so no rounding-order argument
# ties them as in fp32, and a weight difference would grow with no bound one can state; at
# lr 0 every step computes at the same weights, and the bound is that of one forward and
# backward:
# - each stored bf16 value is within u = 2^-9 of what it rounds (8 significant bits). Along
#   the longest path to a logit a run rounds at most R = 30 times (embedding; per layer the
#   norm, q/k/v, rotary, scores, softmax, attention, output, residual, norm, gate/up, the
#   product, down, residual: 13; the final norm and the head) and R more back to a weight's
#   gradient. The layers renormalise (RMSNorm), so relative errors add along the path; two
#   runs, each within R u of the exact value: 2 R u apart, relative to the magnitudes in play;
# - a logit's magnitudes are sum_i |h_i W_i| <= ||h|| ||W_row||: h is the final norm's
#   output, RMS 1 at these weights (the norm's weight is 1 at initialisation and lr is 0), so
#   ||h|| = sqrt(32); W_row the head's row, read from the model (`head_row_norm`); the
#   cross-entropy moves by at most twice its logits' largest change;
# - the gradient's norm, relative to itself (step 4 of the note), by 2 x 2 R u.
BF16_U, BF16_ROUNDINGS = 2.0 ** -9, 30


def bf16_loss_bound(head_row_norm: float) -> float:
    return 2 * (2 * BF16_ROUNDINGS * BF16_U) * math.sqrt(32) * head_row_norm


BF16_NORM_RTOL = 2 * 2 * BF16_ROUNDINGS * BF16_U


def head_row_norm() -> float:
    from hf_trainer_cases import build_model

    return float(build_model().lm_head.weight.norm(dim=1).max())


def check_against_ddp(got: dict, ddp: dict, precision: str, numel: int) -> list:
    """Every (what, step, ours, DDP's, bound) beyond its bound."""
    wrong = []
    assert sorted(got["loss"]) == sorted(ddp["loss"]) == [1, 2, 3], (got, ddp)
    for step, want in ddp["loss"].items():
        bound = fp32_loss_bound(ddp, step, numel) if precision == "fp32" else bf16_loss_bound(head_row_norm())
        if not abs(got["loss"][step] - want) <= bound:
            wrong.append(("loss", step, got["loss"][step], want, bound))
    steps = [1] if precision == "fp32" else [1, 2, 3]  # fp32's later weights differ: see fp32_loss_bound
    for step in steps:
        rtol = fp32_norm_rtol(numel) if precision == "fp32" else BF16_NORM_RTOL
        if not abs(got["grad_norm"][step] - ddp["grad_norm"][step]) <= rtol * ddp["grad_norm"][step]:
            wrong.append(("grad_norm", step, got["grad_norm"][step], ddp["grad_norm"][step], rtol))
    return wrong


@pytest.mark.parametrize("stage,each,precision", GRID,
                         ids=[f"{s}-{'reduce_each_micro_batch' if e else 'reduce_at_boundary'}-{p}" for s, e, p in GRID])
def test_trainer_grid_matches_ddp_s_trainer(grid, stage, each, precision):
    """The Trainer clears gradients with model.zero_grad(), never optimizer.zero_grad(): a
    gradient kept from one step into the next doubles the next step (every step here trains on
    the same 8 sequences), which moves fp32's loss by about lr ||grad||^2 ~ 0.3 and doubles
    the gradient norm in either precision, far beyond the bounds."""
    for r in grid:
        wrong = check_against_ddp(r[(stage, each, precision)], r["ddp"][precision], precision, r["numel"])
        assert not wrong, wrong


def test_the_grid_s_bounds_leave_room_for_a_doubled_step(grid):
    """The bounds can fail: a step doubled at step 2 moves step 3's loss by about one more
    step's move (DDP's step 2 to 3); the fp32 loss bound stays below half of that, and bf16's
    gradient-norm bound below the doubling."""
    ddp = grid[0]["ddp"]["fp32"]
    assert fp32_loss_bound(ddp, 3, grid[0]["numel"]) < 0.5 * (ddp["loss"][2] - ddp["loss"][3])
    assert BF16_NORM_RTOL < 0.5


def test_a_short_accumulation_window_matches_ddp(grid):
    """An epoch of 3 micro-batches per rank at 2 per step ends with a window of 1: the Trainer
    divides by 1 there and zerodp's step must come after that one backward."""
    for r in grid:
        wrong = check_against_ddp(r["short"]["zerodp"], r["short"]["ddp"], "fp32", r["numel"])
        assert not wrong, wrong


def test_tensor_parallel_trainer_reads_one_batch_per_group_and_matches_ddp(grid):
    """Config(tensor_parallel_size=2) on both ranks: one data-parallel rank, reading with twice
    the per-device batch what DDP's two ranks read together. Before, each rank read its own
    half of the batch: the input check ([Note: tensor-parallel input fingerprint]) raises on
    that, and without it the two ranks trained on a mixture. Evaluation gathers one copy per
    tensor-parallel group, from the weights both start from: the eval loss is DDP's within the
    forward's rounding (a copy of each group's would count each batch twice, and the dataset's
    remainder of 10 % 4 = 2 would be cut from the wrong places; an evenly padded last batch
    would count sequences twice)."""
    for r in grid:
        ddp, tp = r["ddp"]["fp32"], r["tp"]
        wrong = check_against_ddp(tp, ddp, "fp32", r["numel"])
        assert not wrong, wrong
        want = ddp["eval_loss"][0]
        assert abs(tp["eval_loss"][0] - want) <= CHAIN_ROUNDING * (1 + abs(want)), (tp["eval_loss"], want)


def test_tensor_parallel_trainer_saves_and_resumes(grid):
    """Under tensor parallelism the Trainer checkpoints every step (zerodp's checkpoint under
    tensor parallelism, [Note: tensor-parallel pieces]); a fresh Trainer resumed from
    checkpoint-1 on the same layout logs the very losses of the run it resumes."""
    for r in grid:
        t = r["tp_resume"]
        steps = sorted(t["full"]["loss"])
        assert t["listing"] == [f"checkpoint-{s}" for s in steps], t["listing"]
        assert steps[1:] and all(t["resumed"]["loss"][s] == t["full"]["loss"][s] for s in steps[1:]), t


def test_tensor_parallel_trainer_refuses_what_it_cannot_serve(grid):
    """At construction: a size that does not divide the world; when the data loader is built:
    accelerate's dispatch_batches (an iterable dataset's default), which reads on one process
    and sends each its own part. Every rank raises, naming the fix."""
    for r in grid:
        e = r["refusals"]
        assert e["divide"].startswith("ConfigError") and "does not divide the 2 processes" in e["divide"], e["divide"]
        assert e["dispatch"].startswith("ConfigError") and "'dispatch_batches': False" in e["dispatch"], e["dispatch"]


def test_a_save_that_fails_leaves_no_checkpoint_and_resume_takes_the_last_complete_one(grid):
    """The save of checkpoint-2 fails after the model and zerodp's shards are written (as a job
    killed there): no checkpoint-2 appears, only the staging folder. resume_from_checkpoint=True
    then takes checkpoint-1, passing over checkpoint-9 (a model and no Trainer state, as a
    kill left them before), and the run goes on bit for bit as the uninterrupted one
    (the grid's stage-1 fp32 cell at the same reduce_each_micro_batch default). Before, the
    Trainer resumed from the half-written checkpoint-2 and failed on its missing
    trainer_state.json."""
    from hf_trainer_cases import FAULT_STAGE, STAGING_DIR

    for r in grid:
        fault = r["fault"]
        assert fault["failed"] == "killed while saving checkpoint-2"
        assert fault["left"] == [STAGING_DIR, "checkpoint-1"] and fault["staged"] == ["checkpoint-2"], fault
        assert fault["resumed"]["loss"] == r[(FAULT_STAGE, True, "fp32")]["loss"]
        assert fault["resumed"]["grad_norm"] == r[(FAULT_STAGE, True, "fp32")]["grad_norm"]
        assert fault["after"] == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-9"], fault["after"]


# -- the example script ----------------------------------------------------------------------
def launch(out: Path, *extra) -> list:
    log = out.with_suffix(".json")
    cmd = [sys.executable, "-m", "zerodp", "launch", "--nproc", "2", str(ROOT / "examples" / "hf_trainer.py"),
           *map(str, ARGS), "--output-dir", str(out), "--log-json", str(log), *map(str, extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(log.read_text())


def by_step(history: list, key: str) -> dict:
    return {e["step"]: e[key] for e in history if key in e}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    out = {"z3": launch(tmp / "z3", "--stage", 3)}
    # Resume: drop the step-6 checkpoint and go on from step 3's.
    shutil.rmtree(tmp / "z3" / "checkpoint-6")
    out["z3_resumed"] = launch(tmp / "z3", "--stage", 3, "--resume")
    out["dir"] = tmp
    return out


def test_resumed_trainer_equals_uninterrupted(runs):
    assert sorted(by_step(runs["z3"], "eval_loss")) == [3, 6]
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        resumed, straight = by_step(runs["z3_resumed"], key), by_step(runs["z3"], key)
        assert resumed == straight, key  # same world size and stage: bit for bit


def test_trainer_checkpoints_are_loadable(runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = runs["dir"] / "z3" / "checkpoint-6"
    files = set(os.listdir(ckpt))
    assert {"model.safetensors", "config.json", "trainer_state.json", "scheduler.pt", "zerodp"} <= files
    assert "optimizer.pt" not in files  # the optimizer lives in zerodp/, sharded
    assert (ckpt / "zerodp" / "COMPLETE").exists()
    # Only complete checkpoints in the output dir, rotated to save_total_limit=2; no staging left.
    assert sorted(p.name for p in (runs["dir"] / "z3").iterdir() if p.is_dir()) == ["checkpoint-3", "checkpoint-6",
                                                                                    "final"]
    final = AutoModelForCausalLM.from_pretrained(runs["dir"] / "z3" / "final")
    saved = load_file(ckpt / "model.safetensors")  # step 6's weights, the final ones
    for name, p in final.named_parameters():
        assert (p.detach() == saved[name]).all(), name
