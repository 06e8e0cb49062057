"""Hugging Face Accelerate's custom loops with zerodp (zerodp.integrations.accelerate.Accelerator).

One torchrun world of 2 CPU ranks (accelerate_cases.py, ACCELERATE_USE_CPU=1) runs
run_clm_no_trainer.py's loop, shrunk, on a tiny GPT-2: under the plain accelerate.Accelerator
with DDP, and under zerodp's at stages 0-3 (SGD) and 1, 3 (AdamW): gradient accumulation over
2 micro-batches with a short last window per epoch, clipping to norm 1 (it acts at the full
windows' steps), a linear LR schedule built on the script's optimizer before prepare,
save_state after step 4, and a fresh run that load_states it and goes on (also at another
stage), gather_for_metrics and save_pretrained at the end; and what is refused (the plain
Accelerator given a zerodp model).

[Note: why zerodp's loop and DDP's differ at all]
With N = 2 ranks every reduction is order-free: a + b = b + a, and halving is exact, so DDP's
all-reduce mean and zerodp's reduce(-scatter) of the same two gradients are the same bits. At
stages 2-3 zerodp reduces each micro-batch, (a1 + b1) + (a2 + b2), where DDP sums the window
first, (a1 + a2) + (b1 + b2); here the two micro-batches of a window are the same sequences
at the same weights (accelerate_cases.Sequences), a1 = a2 and b1 = b2, and both sums are
2 (a1 + b1) exactly. So at equal weights both runs hold the same gradient, bit for bit, and
the one difference is the clipping coefficient max_norm / ||g||: torch takes each tensor's
norm and then their norm, in fp32, zerodp sums the squares in fp64 over its shards; the two
norms are within δ = λ sqrt(P) u of each other (tests/tp_slices.py, step 3 of [Note: rounding
bounds of the tensor-parallel tests]). Step 0's losses come from the same weights: equal bit
for bit.

SGD (the strict check). Clipping is the projection onto the ball of radius max_norm, so it
never moves two gradients further apart, and the two clipped gradients differ by at most
δ max_norm at equal weights. Weights D apart (L2) change the gradient by at most H D, and
SGD at lr with curvature H < 1 / lr (a stable run; as tests/test_ddp_script.py assumes) at
most doubles D per step, weight decay adding lr wd D: D_{k+1} <= (2 + lr_k wd) D_k +
lr_k δ max_norm. Step k's loss (the mean over the ranks, whose gradient is DDP's reduced
gradient before clipping, scaled back from accelerate's division by the accumulation steps)
then moves by at most ||grad|| D_k to first order, plus the forward's rounding at other
weights, CHAIN_ROUNDING (1 + |loss|) (tp_slices step 2).

AdamW divides by sqrt(v): an element whose gradient is near zero can step ~lr either way under
any rounding (tp_slices step 6), so its bound, taken per element from DDP's gradients
(tp_slices.adamw_bound) and summed against the loss's gradient, only catches gross errors (a
lost state, a wrong parameter); the SGD loop is the strict check.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from tp_slices import CHAIN_ROUNDING, LAMBDA, U, adamw_bound  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
N = 2
STEPS, SAVE_AT, MAX_NORM, ACCUMULATION, WEIGHT_DECAY = 6, 4, 1.0, 2, 0.01  # accelerate_cases' values
LR = {"sgd": 0.05, "adamw": 1e-3}
RUNS = [(stage, "sgd") for stage in (0, 1, 2, 3)] + [(stage, "adamw") for stage in (1, 3)]


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """Every rank's results from one torchrun world (accelerate_cases.main)."""
    out = tmp_path_factory.mktemp("accelerate")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(N),
           str(ROOT / "tests" / "accelerate_cases.py"), str(out)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(N)]


def by_step(run: dict) -> dict:
    """Step -> the micro-batch losses of its window, in order."""
    out = {}
    for (step, _epoch, _batch), loss in sorted(run["losses"].items()):
        out.setdefault(step, []).append(loss)
    return out


def mean_loss(seen: list, key, step: int) -> float:
    """Step `step`'s loss: the mean over the ranks (every micro-batch of a window is the same)."""
    return sum(by_step(r[key])[step][0] for r in seen) / len(seen)


def loss_grad_norm(ddp: dict, step: int) -> float:
    """||grad|| of the ranks' mean loss at `step`: DDP's clipped-from norm holds the window's w
    backward passes of loss / ACCUMULATION each."""
    window = len(by_step(ddp)[step])
    return ddp["norms"][step] * ACCUMULATION / window


def sgd_apart(ddp: dict) -> list:
    """D_k, k = 0..STEPS: how far (L2) zerodp's weights can be from DDP's before step k."""
    delta = LAMBDA * math.sqrt(ddp["numel"]) * U
    apart = [0.0]
    for step in range(STEPS):
        lr = max(ddp["lrs"][step])
        apart.append((2 + lr * WEIGHT_DECAY) * apart[-1] + lr * delta * MAX_NORM)
    return apart


def sgd_loss_bound(seen: list, step: int) -> float:
    ddp = {**seen[0][("ddp", "sgd")], "numel": seen[0]["numel"]}
    return CHAIN_ROUNDING * (1 + abs(mean_loss(seen, ("ddp", "sgd"), step))) + \
        loss_grad_norm(ddp, step) * sgd_apart(ddp)[step]


def adamw_apart(seen: list, steps: int) -> dict:
    """Per parameter, the most AdamW can move each element from DDP's in `steps` steps
    (tp_slices.adamw_bound over DDP's clipped gradients)."""
    ddp, numel = seen[0][("ddp", "adamw")], seen[0]["numel"]
    coef = [min(1.0, MAX_NORM / (ddp["norms"][j] + 1e-6)) for j in range(steps)]
    grad_max = [coef[j] * max(float(g.abs().max()) for g in ddp["grads"][j].values()) for j in range(steps)]
    return {name: adamw_bound(LR["adamw"], [ddp["grads"][j][name] * coef[j] for j in range(steps)], grad_max,
                              clipped_numel=numel)
            for name in ddp["grads"][0]}


def adamw_loss_bound(seen: list, step: int) -> float:
    ddp = seen[0][("ddp", "adamw")]
    scale = ACCUMULATION / len(by_step(ddp)[step])  # the window's gradient back to the mean loss's
    apart = adamw_apart(seen, step)
    first_order = sum(float((ddp["grads"][step][name].abs() * scale * apart[name]).sum()) for name in apart)
    return CHAIN_ROUNDING * (1 + abs(mean_loss(seen, ("ddp", "adamw"), step))) + first_order


def test_prepare_shards_in_place_and_never_wraps_in_ddp(seen):
    for r in seen:
        assert r[("ddp", "sgd")]["prepared"]["model"] == "DistributedDataParallel"  # what plain accelerate does
        for stage, kind in RUNS:
            prepared = r[(stage, kind)]["prepared"]
            assert prepared == {"model": "GPT2LMHeadModel", "unwrapped_is_model": True,
                                "optimizer": "ZeroAcceleratedOptimizer", "inner": "ZeroOptimizer",
                                "scheduler_on": "ZeroOptimizer", "scheduler_on_prepared": True,
                                "script_optimizer_kept": True}, (stage, kind, prepared)


@pytest.mark.parametrize("stage,kind", RUNS)
def test_the_loop_matches_accelerate_with_ddp(seen, stage, kind):
    """Per step, the ranks' mean loss within the bound of the module docstring; step 0 and
    every window's micro-batches (nothing steps before the boundary) bit for bit; the rates the
    scheduler set in zerodp's optimizer are DDP's."""
    wrong = []
    for r in seen:
        ddp, zero = r[("ddp", kind)], r[(stage, kind)]
        assert sorted(zero["losses"]) == sorted(ddp["losses"])
        assert zero["lrs"] == ddp["lrs"]
        assert by_step(zero)[0] == by_step(ddp)[0]
        for step, losses in by_step(zero).items():
            assert len(set(losses)) == 1, (step, losses)
        assert len(zero["eval"]) == 5  # gather_for_metrics dropped the padding of the last batch
    # Step 0's norm: the same gradient, its squares summed in another order (the docstring's δ).
    got, want = seen[0][(stage, kind)]["norms"][0], seen[0][("ddp", kind)]["norms"][0]
    assert abs(got - want) <= LAMBDA * math.sqrt(seen[0]["numel"]) * U * want, (got, want)
    for step in range(1, STEPS):
        bound = sgd_loss_bound(seen, step) if kind == "sgd" else adamw_loss_bound(seen, step)
        got, want = mean_loss(seen, (stage, kind), step), mean_loss(seen, ("ddp", kind), step)
        if not abs(got - want) <= bound:
            wrong.append((step, got, want, bound))
    assert not wrong, wrong


@pytest.mark.parametrize("stage,kind", RUNS)
def test_final_weights_match_ddp(seen, stage, kind):
    """accelerator.get_state_dict (the whole model, gathered) against DDP's module: SGD in L2
    within D_STEPS, AdamW per element within tp_slices.adamw_bound."""
    ddp, zero = seen[0][("ddp", kind)]["final"], seen[0][(stage, kind)]["final"]
    assert sorted(zero) == sorted(ddp)
    if kind == "sgd":
        apart = sgd_apart({**seen[0][("ddp", "sgd")], "numel": seen[0]["numel"]})[STEPS]
        grads = seen[0][("ddp", "sgd")]["grads"][0]
        distance = math.sqrt(sum(float((zero[n] - ddp[n]).double().square().sum()) for n in grads))
        assert distance <= apart, (distance, apart)
    else:
        for name, bound in adamw_apart(seen, STEPS).items():
            assert bool(((zero[name] - ddp[name]).abs() <= bound).all()), name


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_save_pretrained_at_stage_3_writes_the_whole_model(seen, kind):
    """run_clm_no_trainer's `accelerator.unwrap_model(model).save_pretrained(dir,
    is_main_process=..., save_function=accelerator.save)` on every rank: the file holds the
    whole weights, the ones get_state_dict gathered (GPT-2's tied head once)."""
    from safetensors.torch import load_file

    out = Path(seen[0]["out"]) / f"pretrained-3-{kind}" / "model.safetensors"
    written, final = load_file(str(out)), seen[0][(3, kind)]["final"]
    assert set(written) <= set(final) and "transformer.wte.weight" in written
    assert all(torch.equal(written[k], final[k]) for k in written)


def test_the_sgd_bounds_leave_room_for_a_wrong_step(seen):
    """The SGD bounds can fail: every step's bound stays below half of the fall of DDP's loss
    over that step (a lost, doubled or unsynchronised step moves the loss by about that much)."""
    for step in range(1, STEPS):
        fall = mean_loss(seen, ("ddp", "sgd"), step - 1) - mean_loss(seen, ("ddp", "sgd"), step)
        assert sgd_loss_bound(seen, step) < 0.5 * fall, (step, sgd_loss_bound(seen, step), fall)


@pytest.mark.parametrize("stage,kind", RUNS)
def test_the_resumed_run_equals_the_uninterrupted_one(seen, stage, kind):
    """save_state after step 4, then a fresh run (another seed, a new model, optimizer, data
    loader and Accelerator) that load_states it and goes on: the same world and stage, so bit
    for bit; its random states too (only load_state can have set them)."""
    for r in seen:
        whole, resumed = r[(stage, kind)], r[(stage, kind, "resumed")]
        assert min(k[0] for k in resumed["losses"]) == SAVE_AT
        assert resumed["losses"] == {k: v for k, v in whole["losses"].items() if k[0] >= SAVE_AT}
        assert resumed["norms"] == {k: v for k, v in whole["norms"].items() if k >= SAVE_AT}
        assert resumed["lrs"] == {k: v for k, v in whole["lrs"].items() if k >= SAVE_AT}
        assert torch.equal(resumed["eval"], whole["eval"])
        assert all(torch.equal(resumed["final"][n], whole["final"][n]) for n in whole["final"])
        # Right after load_state, as right after save_state (the loop then draws differently:
        # a new DataLoader iterator draws its seed).
        assert torch.equal(resumed["rng"][0], whole["rng"][0]) and resumed["rng"][1:] == whole["rng"][1:]


def test_a_run_at_another_stage_goes_on_from_the_checkpoint(seen):
    """Stage 3 load_states stage 1's folder: the weights are the saved ones (step 4's losses
    are stage 1's bit for bit), and the rest stays within DDP's bounds."""
    for r in seen:
        moved, source = r[(3, "sgd", "from stage 1")], r[(1, "sgd")]
        assert by_step(moved)[SAVE_AT] == by_step(source)[SAVE_AT]
    for step in range(SAVE_AT, STEPS):
        got, want = mean_loss(seen, (3, "sgd", "from stage 1"), step), mean_loss(seen, ("ddp", "sgd"), step)
        assert abs(got - want) <= sgd_loss_bound(seen, step), (step, got, want)


def test_what_is_refused(seen):
    for r in seen:
        refused = r["refusals"]
        # The plain Accelerator (and DDP itself) given a model zerodp.initialize returned: at
        # once, on every rank, before DDP's first collective.
        for key in ("plain_accelerator", "plain_ddp_direct"):
            assert refused[key].startswith("TypeError: this GPT2LMHeadModel was passed to zerodp.initialize"), \
                refused[key]
            assert "from zerodp.integrations.accelerate import Accelerator" in refused[key]
        assert refused["scheduler_left_out"].startswith("ValueError: an LR scheduler was built on this SGD"), \
            refused["scheduler_left_out"]
        # load_state of a folder plain accelerate wrote: refused, nothing loaded (plain
        # accelerate would have restored whatever its files held, or skipped the model).
        assert refused["load_plain_folder"].startswith("FileNotFoundError: ") and \
            "holds no complete zerodp checkpoint" in refused["load_plain_folder"], refused["load_plain_folder"]


def test_save_state_writes_one_folder_whole(seen):
    """zerodp's checkpoint beside accelerate's own files (RNG states of each rank, the
    scheduler, the registered position), nothing else beside the folder; a save over an
    existing folder replaces it whole, and what a killed save left in staging is gone."""
    for r in seen:
        for stage, kind in RUNS:
            beside, inside = r[(stage, kind)]["saved"]
            assert beside == [f"step_{SAVE_AT}"], beside
            assert inside == ["custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl",
                              "scheduler.bin", "zerodp"], inside
        assert r["refusals"]["resaved"] == (["checkpoint"], ["random_states_0.pkl", "random_states_1.pkl", "zerodp"])
