"""Lightning's Trainer and Fabric with zerodp (zerodp.integrations.lightning).

One torchrun world of 2 CPU ranks (lightning_cases.py) trains the same MLP under Lightning's
"ddp" and under zerodp's strategies (Trainer: stages 1-3, automatic and manual optimization,
one step at bf16-mixed and bf16-true; Fabric: stage 3), saves and resumes; then one process
resumes the N=2 stage-3 checkpoint at stage 1.

[Note: why the Lightning runs differ from DDP's at all]
N = 2: every reduction is order-free (a + b = b + a, halving is exact), and each rank's two
micro-batches of a window are the same samples (lightning_cases.Data), so zerodp's reduction
of each micro-batch at stages 2-3, (a1 + b1) + (a2 + b2), is DDP's (a1 + a2) + (b1 + b2) bit for
bit: at equal weights both runs hold the same gradient. The one difference is the clipping
coefficient max_norm / ||g||: torch sums the squares per tensor then across tensors in fp32,
zerodp over its shards; the norms are within δ = λ sqrt(P) u of each other (tests/tp_slices.py,
step 3). Step 0's losses come from the same weights on the same batches: equal bit for bit.

SGD with momentum μ, per step k at lr_k, from weights D_k apart (L2) and momentum buffers B_k
apart: clipping is a projection onto the ball of radius max_norm, so it never moves two
gradients further apart, and the clipped gradients differ by at most H D_k + δ_k, with
δ_k = δ max_norm (the coefficient) and H the curvature; a stable run has H < 1 / lr (as
tests/test_ddp_script.py and tests/test_accelerate.py assume), so H D_k <= D_k / LR. Then
B_{k+1} <= μ B_k + D_k / LR + δ_k and D_{k+1} <= D_k + lr_k B_{k+1} (`apart`). Step k's loss,
the mean over the ranks (whose gradient is the reduced gradient before clipping, whose norm
each run records), moves by at most ||grad|| D_k to first order, plus the forward's rounding
at other weights, CHAIN_ROUNDING (1 + |loss|) (tp_slices, step 2).

The one-process resume reads the same weights, and computes each step's gradient over the 8
samples in one batch where the two ranks summed two batches of 4: reordered sums, each element
within CHAIN_ROUNDING of the magnitudes in play (tp_slices, step 2), at most the gradient's
norm: δ_k gains sqrt(P) CHAIN_ROUNDING ||g_k|| (in L2).
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tp_slices import CHAIN_ROUNDING, LAMBDA, U  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
N = 2
STEPS, STEPS_PER_EPOCH, LR, MOMENTUM, MAX_NORM = 4, 2, 0.05, 0.9, 1.0  # lightning_cases' values
U16 = 2.0 ** -9  # bf16 unit roundoff
RUNS = [1, 2, 3, ("manual", 1), ("fabric", 3)]
REFERENCE = {1: "ddp", 2: "ddp", 3: "ddp", ("manual", 1): ("manual", "ddp"), ("fabric", 3): ("fabric", "ddp")}


def launch(out: Path, nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "tests" / "lightning_cases.py"), str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """Every rank's results from the 2-rank world, then the one-process resume's."""
    out = tmp_path_factory.mktemp("lightning")
    launch(out, N)
    launch(out, 1, "resume")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(N)]
    return {"ranks": ranks, "n1": torch.load(out / "resumed-n1.pt", weights_only=False)}


def mean_losses(seen, key) -> list:
    """Per micro-batch, the mean over the ranks of their losses."""
    runs = [r[key]["losses"] for r in seen["ranks"]]
    return [sum(losses) / len(losses) for losses in zip(*runs)]


def apart(lrs: list, deltas: list) -> list:
    """D_k, k = 0..len(lrs): how far (L2) two SGD runs' weights can be before step k when the
    clipped gradients of step k differ by deltas[k] at equal weights (module docstring)."""
    d, b, out = 0.0, 0.0, [0.0]
    for lr, delta in zip(lrs, deltas):
        b = MOMENTUM * b + d / LR + delta
        d = d + lr * b
        out.append(d)
    return out


def delta(numel: int) -> float:
    return LAMBDA * math.sqrt(numel) * U * MAX_NORM


def distance(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return math.sqrt(sum(float((a[n].double() - b[n].double()).square().sum()) for n in b))


def loss_bound(reference: dict, mean_loss: float, step: int, d: float) -> float:
    return CHAIN_ROUNDING * (1 + abs(mean_loss)) + reference["norms"][step] * d


def test_the_model_is_sharded_in_place_and_the_schedule_moved(seen):
    for r in seen["ranks"]:
        assert (r["ddp"]["model"], r["ddp"]["optimizer"]) == ("DistributedDataParallel", "SGD")
        for stage in (1, 2, 3):
            run = r[stage]
            assert (run["model"], run["optimizer"], run["config"].stage) == ("Net", "ZeroOptimizer", stage)
            assert run["scheduler_on_trained"], "the StepLR configure_optimizers built was not moved"
            assert run["lrs"] == r["ddp"]["lrs"] and len(run["lrs"]) == STEPS
        assert r[("fabric", 3)]["model"] == "Sequential" and r[("fabric", "ddp")]["model"] == "DistributedDataParallel"
        assert r["registered"] == {"trainer": ("ZeroStrategy", 3), "fabric": ("ZeroFabricStrategy", 2)}


def test_accumulation_enters_the_models_no_sync(seen):
    """Lightning's accumulation turns the model's DDP flag off for the first micro-batch of
    each window, and zerodp acts on it: at stage 1 one reduce-scatter of the P gradient
    elements per step (not one per micro-batch), also under manual optimization, whose
    toggle_model comes after the model's call began; stages 2-3 reduce each micro-batch by
    design (Config.reduce_each_micro_batch), stage 3 gathering each unit once per forward and
    backward."""
    numel = seen["ranks"][0]["ddp"]["numel"]
    for r in seen["ranks"]:
        for key in (1, 2, 3, ("manual", 1)):
            assert r[key]["sync"] == [False, True] * STEPS, key
        for key in (1, ("manual", 1)):
            assert r[key]["ledger"]["by_op"] == {"reduce_scatter/backward": numel, "all_gather/step": numel}, key
        assert r[2]["ledger"]["by_op"] == {"reduce_scatter/backward": 2 * numel, "all_gather/step": numel}
        assert r[3]["ledger"]["by_op"] == {"reduce_scatter/backward": 2 * numel, "all_gather/forward": 2 * numel,
                                           "all_gather/backward": 2 * numel}


@pytest.mark.parametrize("key", RUNS, ids=str)
def test_per_step_equal_to_lightning_ddp(seen, key):
    """Losses per step within the bound of the module docstring; step 0 bit for bit; the
    recorded gradient norm of step 0 within δ; clipping acted at every step."""
    ref_key = REFERENCE[key]
    ref = seen["ranks"][0][ref_key]
    numel = seen["ranks"][0]["ddp"]["numel"]
    d = apart(ref["lrs"], [delta(numel)] * STEPS)
    for r in seen["ranks"]:
        assert r[key]["losses"][:2] == r[ref_key]["losses"][:2]
    norms = seen["ranks"][0][key]["norms"]
    assert len(norms) == STEPS and abs(norms[0] - ref["norms"][0]) <= delta(numel) * ref["norms"][0]
    assert all(n > MAX_NORM for n in ref["norms"]), "clipping must act for the test to check it"
    got, want = mean_losses(seen, key), mean_losses(seen, ref_key)
    for step in range(1, STEPS):
        for micro in (2 * step, 2 * step + 1):
            assert abs(got[micro] - want[micro]) <= loss_bound(ref, want[micro], step, d[step]), (step, micro)


@pytest.mark.parametrize("key", RUNS, ids=str)
def test_final_weights_equal_to_lightning_ddp(seen, key):
    r = seen["ranks"][0]
    ref = r[REFERENCE[key]]
    assert distance(r[key]["final"], ref["final"]) <= apart(ref["lrs"], [delta(r["ddp"]["numel"])] * STEPS)[STEPS]


def test_the_bounds_leave_room_for_a_wrong_step(seen):
    """Every step's loss bound stays below half of the fall of DDP's loss over that step: a
    lost, doubled or unsynchronised step moves the loss by about that much."""
    ref = seen["ranks"][0]["ddp"]
    d = apart(ref["lrs"], [delta(ref["numel"])] * STEPS)
    losses = mean_losses(seen, "ddp")
    for step in range(1, STEPS):
        fall = losses[2 * step - 2] - losses[2 * step]
        assert loss_bound(ref, losses[2 * step], step, d[step]) < 0.5 * fall, step


def test_trainer_resume_equals_the_uninterrupted_run(seen):
    """trainer.save_checkpoint after epoch 1, then a fresh model and Trainer with
    fit(ckpt_path=...): the same world and stage, so bit for bit (weights, momentum, the
    scheduler's rate, the loop's position)."""
    for r in seen["ranks"]:
        whole, first, resumed = r[3], r["first epoch"], r["resumed"]
        assert first["losses"] == whole["losses"][:2 * STEPS_PER_EPOCH]
        assert resumed["losses"] == whole["losses"][2 * STEPS_PER_EPOCH:]
        assert resumed["norms"] == whole["norms"][STEPS_PER_EPOCH:]
        assert resumed["lrs"] == whole["lrs"][STEPS_PER_EPOCH:]
        assert all(torch.equal(resumed["final"][n], whole["final"][n]) for n in whole["final"])
    files = seen["ranks"][0]["checkpoint files"]
    assert files["epoch1.ckpt"] == files["fabric.ckpt"] == ["lightning.pt", "zerodp"]
    assert files["every-step"] == ["epoch=0-step=2.ckpt"]  # ModelCheckpoint(save_top_k=1) removed step 1's


def test_validate_from_the_checkpoint(seen):
    """trainer.validate(ckpt_path=...) of the checkpoint after epoch 1: on the Trainer that just
    trained (the sharded model takes its weights, its optimizer untouched) and on a fresh
    Trainer with a plain model (zerodp.consolidate's weights). Each rank evaluates its 4
    batches of its same 4 samples at the epoch-1 weights, the forward training step 3 ran: the
    same losses bit for bit."""
    for r in seen["ranks"]:
        at_epoch1 = r[3]["losses"][2 * STEPS_PER_EPOCH]
        assert r["resumed"]["val"] == r["validated"] == [at_epoch1] * 2 * STEPS_PER_EPOCH


def test_trainer_resume_at_another_world_size(seen):
    """The N=2 stage-3 checkpoint resumed in one process at stage 1 (batch 8: the same global
    batch): its losses and weights within the module docstring's bounds of the N=2 run."""
    n1, whole = seen["n1"], seen["ranks"][0][3]
    numel = whole["numel"]
    assert n1["config"].stage == 1 and n1["lrs"] == whole["lrs"][STEPS_PER_EPOCH:]
    lrs, norms = whole["lrs"][STEPS_PER_EPOCH:], whole["norms"][STEPS_PER_EPOCH:]
    deltas = [delta(numel) + math.sqrt(numel) * CHAIN_ROUNDING * n for n in norms]
    d = apart(lrs, deltas)
    want = mean_losses(seen, 3)[2 * STEPS_PER_EPOCH:]
    for step in range(STEPS - STEPS_PER_EPOCH):
        for micro in (2 * step, 2 * step + 1):
            bound = CHAIN_ROUNDING * (1 + abs(want[micro])) + norms[step] * d[step]
            assert abs(n1["losses"][micro] - want[micro]) <= bound, (step, micro)
    assert distance(n1["final"], whole["final"]) <= d[-1]


def test_fabric_resume_equals_the_uninterrupted_run(seen):
    """fabric.save after epoch 1, fabric.load into a fresh setup: bit for bit. fabric.load(path)
    with no state gives the weights just loaded, whole; load_raw is refused."""
    for r in seen["ranks"]:
        whole, resumed = r[("fabric", 3)], r[("fabric", 3, "resumed")]
        assert resumed["everything"] == (["model", "scheduler", "step"], STEPS_PER_EPOCH, True)
        assert "fabric.load(path, {'model'" in resumed["load_raw"]
        assert resumed["losses"] == whole["losses"][2 * STEPS_PER_EPOCH:]
        assert resumed["norms"] == whole["norms"][STEPS_PER_EPOCH:]
        assert resumed["lrs"] == whole["lrs"][STEPS_PER_EPOCH:]
        assert all(torch.equal(resumed["final"][n], whole["final"][n]) for n in whole["final"])


def test_bf16_mixed_is_autocast_over_fp32_shards(seen):
    """bf16-mixed keeps zerodp in fp32 under Lightning's autocast, as DDP runs it: step 0 bit for
    bit, and after one step the weights within lr δ max_norm (same gradient, the clipping
    coefficient apart)."""
    for r in seen["ranks"]:
        ddp, zero = r[("ddp", "bf16-mixed")], r[(2, "bf16-mixed")]
        assert (zero["config"].mixed_precision, zero["param_dtype"], zero["dtypes"]) == \
            ("fp32", "torch.float32", {"torch.bfloat16"})
        assert zero["losses"] == ddp["losses"]
        assert distance(zero["final"], ddp["final"]) <= LR * delta(r["ddp"]["numel"])


def test_bf16_true_keeps_bf16_weights_over_an_fp32_master(seen):
    """bf16-true: the module and inputs in bf16 (Lightning's cast), zerodp's Config bf16 with an
    fp32 master. Step 0 bit for bit. After one step each weight is within one bf16 ulp of its
    value plus lr 4 U16 max_norm of DDP's: the same bf16 gradient, clipped by a coefficient DDP
    computes in bf16 (3 roundings) and applies in bf16 (1), zerodp in fp32; each run rounds its
    updated weight to bf16 once."""
    for r in seen["ranks"]:
        ddp, zero = r[("ddp", "bf16-true")], r[(2, "bf16-true")]
        assert (zero["config"].mixed_precision, zero["param_dtype"], zero["master_dtype"]) == \
            ("bf16", "torch.bfloat16", "torch.float32")
        assert zero["losses"] == ddp["losses"]
        for name, want in ddp["final"].items():
            ulp = torch.ldexp(torch.ones_like(want), torch.frexp(want.abs())[1] - 8)
            assert bool(((zero["final"][name] - want).abs() <= ulp + LR * 4 * U16 * MAX_NORM).all()), name


def test_what_is_refused(seen):
    refused = seen["ranks"][0]["refusals"]
    assert "GradScaler" in refused["16-mixed"] and "skip" in refused["16-mixed"]
    assert "loss scale" in refused["16-true"] and "loss scale" in refused["fabric 16-true"]
    assert "64-true" in refused["64-true"]
    assert "disagree" in refused["fp16 config"] and "disagree" in refused["bf16 config at 32-true"]
    assert "accumulate_grad_batches" in refused["grad_accumulation_steps"]
    assert "['find_unused_parameters'] configure DistributedDataParallel" in refused["ddp option"]
    assert "['static_graph'] configure DistributedDataParallel" in refused["fabric ddp option"]
