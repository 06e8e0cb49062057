"""Stages 0-2 against torch DDP, a case per test in the session's worlds (cases: core_cases.py)."""
import pytest

import core_cases as cases
import offload_cases
from core_cases import SMALL_BUCKET, Net
from tolerances import ADAMW_BF16_TOL, ADAMW_FP32_TOL, FIRST_GRAD_TOL, FP32_TOL, TOL

SIZES = pytest.mark.parametrize("n", [1, 2, 4], ids=lambda n: f"N{n}")


def _id(case) -> str:
    return "-".join(str(v) for v in case)


@SIZES
@pytest.mark.parametrize("stage,precision,opt", cases.PARITY_GRID, ids=map(_id, cases.PARITY_GRID))
def test_parity_with_ddp_at_every_step(pool, n, stage, precision, opt):
    tol = TOL[precision, opt]  # a bound on the whole run, so on each of its steps (tolerances.py)
    for rank, r in enumerate(pool.run(n, cases.parity_case, stage, precision, opt)):
        per_step = r["per_step"]
        for step, (params, loss) in enumerate(zip(per_step["params"], per_step["losses"])):
            assert params <= tol, (n, rank, step, params)
            assert loss <= tol, (n, rank, step, loss)  # losses are O(1)
        first = per_step["grads"][0]
        assert (first is None) == (stage >= 1)  # only stage 0 holds the whole reduced gradient
        if first is not None:
            assert first <= FIRST_GRAD_TOL[precision], (n, rank, first)
        # The state dict keeps the model's own names (no wrapper prefix).
        assert r["names"] == list(Net().state_dict().keys())
        # stage 0 all-reduces (2Ψ), stages 1-2 reduce-scatter Ψ and all-gather Ψ; the padded
        # flat buffer adds fewer than N elements to each.
        padded = -(-171 // n) * n
        assert r["volume"] == 2 * padded, (stage, r)
        if stage == 0:
            assert r["by_op"] == {"all_reduce/backward": 2 * padded}
        else:
            assert r["by_op"] == {"reduce_scatter/backward": padded, "all_gather/step": padded}


@SIZES
@pytest.mark.parametrize("precision,stage", cases.MEMORY_GRID, ids=map(_id, cases.MEMORY_GRID))
def test_memory_ledger_matches_formula(pool, n, precision, stage):
    for r in pool.run(n, cases.memory_case, precision, stage):
        assert r["got"] == r["expect"], (n, precision, stage)
        assert r["padded"] - r["numel"] < n
        # The formula itself, spelled out: bf16 stage 2 holds 2Ψ params, 2Ψ/N grads, 4Ψ/N
        # master, 8Ψ/N Adam states; fp32 stage 1 4Ψ params and grads, no master, 8Ψ/N states.
        p = r["padded"]
        if (precision, stage) == ("bf16", 2):
            assert r["got"] == {"params": 2 * p, "grads": 2 * p // n, "master": 4 * p // n,
                                "optimizer_states": 8 * p // n}
        if (precision, stage) == ("fp32", 1):
            assert r["got"] == {"params": 4 * p, "grads": 4 * p, "master": 0, "optimizer_states": 8 * p // n}


@SIZES
def test_frozen_parameters_left_alone(pool, n):
    r = pool.run(n, cases.frozen_case)[0]
    assert r["frozen_unchanged"]
    assert r["numel"] == 171  # the frozen Linear(5, 5) is not in the flat buffers
    assert r["rel_diff"] <= ADAMW_FP32_TOL  # AdamW (core_cases.adamw_two_groups), 5 steps


@SIZES
@pytest.mark.parametrize("stage", [1, 2])
def test_model_smaller_than_world(pool, n, stage):
    for r in pool.run(n, cases.tiny_case, stage):
        assert max(r["params"]) <= FP32_TOL and max(r["losses"]) <= FP32_TOL, r  # plain SGD, every step


@SIZES
@pytest.mark.parametrize("stage,each", cases.ACCUMULATION_GRID, ids=map(_id, cases.ACCUMULATION_GRID))
def test_accumulation_equals_large_batch(pool, n, stage, each):
    padded = -(-171 // n) * n
    r = pool.run(n, cases.accumulation_case, stage, each)[0]
    # AdamW; a lost or doubled micro-batch is caught by the SGD accumulation checks
    # (test_offload_with_accumulation..., test_trust sgd3, test_hybrid).
    assert r["rel_diff"] <= ADAMW_FP32_TOL, r
    if stage < 2 or not each:
        # Stages 0-1 (and stage 2 with reduce_each_micro_batch=False) communicate only at the boundary.
        assert r["volume"] == 2 * padded
    else:  # stage 2 reduce-scatters each of the 2 micro-batches into the shard
        assert r["by_op"] == {"reduce_scatter/backward": 2 * padded, "all_gather/step": padded}


@SIZES
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_clip_grad_norm_equals_ddp(pool, n, stage):
    r = pool.run(n, cases.clip_case, stage)[0]
    assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-6)
    assert max(r["ref_norms"]) > 0.05  # clipping really happened
    assert r["rel_diff"] <= ADAMW_FP32_TOL  # AdamW; the clipped norms above are the strict check


@SIZES
def test_lr_scheduler_and_step_without_backward(pool, n):
    r = pool.run(n, cases.scheduler_case)[0]
    assert r["lr_after_sched"] == pytest.approx(0.05)
    assert "before a backward" in r["step_without_backward"]


@SIZES
def test_fp16_overflow_skips_on_every_rank(pool, n):
    for r in pool.run(n, cases.fp16_overflow):
        assert r["unchanged_after_skip"]
        assert r["scale_after_skip"] == 512.0  # 1024 halved
        assert r["skipped"] == 1
        assert r["changed_later"]
        assert r["scale_end"] == 2048.0  # grew twice after 2 clean steps each


@SIZES
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_reduce_dtype_fp32(pool, n, stage):
    r = pool.run(n, cases.reduce_fp32_case, stage)[0]
    assert r["rel_diff"] <= ADAMW_BF16_TOL  # AdamW in bf16
    # Stages 0-1 keep bf16 gradients (views autograd fills); stage 2 keeps the reduced
    # shard in the reduce dtype.
    expect = 2 * r["padded"] if stage < 2 else 4 * r["padded"] // n
    assert r["grads"] == expect, (stage, r)


@SIZES
def test_optimizer_steps_a_bucket_at_a_time_with_contiguous_states(pool, n):
    for c in pool.run(n, cases.chunked_step_case):
        # Parity with DDP at this bucket size is test_parity_with_ddp's; here: it really is
        # split (at least one call per SMALL_BUCKET bytes of master) and no piece is stepped twice.
        assert -(-c["master_bytes"] // SMALL_BUCKET) <= c["inner_calls"] <= c["pieces"], c
        # Hooks on the returned optimizer run once per step, as on any torch optimizer.
        assert c["hooks"] == ["global pre", "pre", "post", "global post"]
        if n <= 2:  # N=4's shard (43 elements) fits one bucket
            assert c["inner_calls"] > 1
        assert c["state_storages"] == {"exp_avg": c["shards"], "exp_avg_sq": c["shards"]}, c


# -- Config.offload_optimizer="host" (ZeRO-Offload, tests/offload_cases.py): the master, the
# optimizer's states and its step on the host.
OFFLOAD_CASES = [(n, *case) for n in (1, 2, 4) for case in offload_cases.offload_grid(n)]


@pytest.mark.parametrize("n,stage,precision,opt", OFFLOAD_CASES, ids=[f"N{c[0]}-{_id(c[1:])}" for c in OFFLOAD_CASES])
def test_offloaded_step_is_the_device_step_bit_for_bit_and_ddps(pool, n, stage, precision, opt):
    for r in pool.run(n, offload_cases.placements_case, stage, precision, opt):
        for place, case in r.items():
            key = (stage, precision, opt, place)
            # The same fp32 maths on the same values, only in other memory: the same bits.
            assert case["same_as_device"] and case["losses_equal"], (n, key)
            # Host buffers are filled as backward finalises each part, not at the step; disk
            # keeps the gradient where it is (nothing to stream).
            assert case["streamed"] == case["staged_pieces"] and (place != "host" or case["streamed"] > 0), (n, key)
            tol = TOL[precision, opt]
            assert case["diff"] <= tol and case["loss_diff"] <= tol, (n, key, case["diff"], case["loss_diff"])
            _check_ledger(n, key, case)


def _check_ledger(n, key, case):
    """The ledger counts what each placement holds."""
    stage, precision, opt, place = key
    owned, states = case["shard_numel"], case["state_bytes"] * case["shard_numel"]
    assert case["device_offloaded"] == 0, (n, key)
    if place.endswith("+params"):
        _check_params_offloaded(n, key, case)
        return
    if place == "host":
        # The fp32 master, the fp32 gradient copied down beside it and the states, 4 + 4 + K
        # bytes per owned element, even in fp32 (the parameters stay on the device).
        assert case["host"] == 8 * owned + states and case["disk"] == 0, (n, key, case)
    else:
        # In files: the states, and under bf16 the fp32 master (in fp32 the parameters are it).
        master = 4 * owned if precision == "bf16" else 0
        assert case["disk"] == master + states and case["host"] == 0, (n, key, case)
        assert case["file_bytes"] == case["disk"], (n, key, case)  # the files' own sizes
    assert case["master"] == (0 if place == "disk" and precision == "fp32" else 4 * owned), (n, key)
    # `zerodp estimate --offload`'s model of the same rank (Ψ/N = what this rank owns).
    from zerodp.memory.estimator import placement_bytes

    pbytes = 4 if precision == "fp32" else 2
    k = case["state_bytes"] + (4 if precision == "bf16" else 0)
    model = placement_bytes(owned * n, n, stage, place, k=k, param_bytes=pbytes, grad_bytes=pbytes)
    assert (model["host"], model["disk"]) == (case["host"], case["disk"]), (n, key, model, case)


def _check_params_offloaded(n, key, case):
    """Config.offload_params: every byte of the model states lies where the placement is,
    counted by the ledger, by the estimator and (disk) by the files' sizes."""
    from zerodp.memory.estimator import placement_bytes

    stage, precision, opt, place = key
    kind, other = (("host", "disk") if place.startswith("host") else ("disk", "host"))
    assert case["model_state"] == case[kind] and case[other] == 0, (n, key, case)
    pbytes = 4 if precision == "fp32" else 2
    k = case["state_bytes"] + (4 if precision == "bf16" else 0)
    owned = case["shard_numel"]
    model = placement_bytes(owned * n, n, stage, kind, k=k, param_bytes=pbytes, grad_bytes=pbytes,
                            offload_params=kind)
    assert model["device"] == 0, (n, key, model)
    # The estimator counts owned elements; the shards also hold the layout's padding, and on
    # disk each unit's two shards are rounded up to whole pages (at most a page each).
    extra = case[kind] - model[kind] - 2 * pbytes * (case["padded_shard"] - owned)
    slack = 2 * case["units"] * 4096 if kind == "disk" else 0
    assert 0 <= extra <= slack, (n, key, case, model)
    if kind == "disk":
        assert case["file_bytes"] == case["disk"], (n, key, case)



@SIZES
@pytest.mark.parametrize("key,stage,place", offload_cases.ACCUMULATION_GRID,
                         ids=map(_id, offload_cases.ACCUMULATION_GRID))
def test_offload_with_accumulation_and_clipping_equals_ddp(pool, n, key, stage, place):
    for case in pool.run(n, offload_cases.accumulation_case, key, stage, place):
        assert case["diff"] <= FP32_TOL and case["norm_gap"] <= FP32_TOL, (n, key, case)


@pytest.mark.parametrize("n", [1, 2], ids=lambda n: f"N{n}")  # resharding itself is test_checkpoint's
def test_checkpoints_move_between_offloaded_and_not_bit_for_bit(pool, n):
    for r in pool.run(n, offload_cases.checkpoint_both_ways):
        for (saved, loaded, stage), case in r.items():
            assert case["resumed"], (n, saved, loaded, stage)
        # host and disk, each way, stages 1 and 3; with the parameter shards too at stage 3
        assert len(r) == 10


@pytest.mark.parametrize("n", [1, 2], ids=lambda n: f"N{n}")
def test_delayed_update_follows_its_definition(pool, n):
    """Config.delayed_update_after against ZeRO-Offload's DPU written out on torch DDP."""
    for delayed in pool.run(n, offload_cases.delayed_update_cases):
        for key, case in delayed.items():
            if not isinstance(key, tuple):
                continue
            assert case["pending"], key  # the last step's update was still in flight
            # Same maths in the same order on the same values: fp32 tolerance (the DDP
            # reference averages the gradients in another order).
            tol = TOL["fp32", key[1]]  # key: (stage, "sgd" | "adamw", after)
            assert case["lagging_diff"] <= tol and case["master_diff"] <= tol, (n, key, case)
            assert case["loss_diff"] <= tol, (n, key, case)
            # Stale gradients give other losses than the synchronous run.
            assert case["differs_from_sync"] > 10 * FP32_TOL, (n, key, case)
        assert len([k for k in delayed if isinstance(k, tuple)]) == 4
        if n == 2:  # raised on rank 1 only, in the update's thread: every rank raises at the next step
            assert "injected failure in the update" in delayed["failed_update"], delayed["failed_update"]


def test_a_bad_offload_dir_fails_on_every_rank_at_initialize(pool):
    for rank, bad in enumerate(pool.run(2, offload_cases.bad_dir_case)):
        # Only rank 1's disk is full: both ranks raise, rank 0 naming rank 1's problem.
        assert "does not exist" in bad["missing"], (rank, bad["missing"])
        assert "is full" in bad["full"] and "bytes are needed" in bad["full"], (rank, bad["full"])
        assert "is full" in bad["full_params"], (rank, bad["full_params"])
        assert rank == 1 or "parameter shards" in bad["full_params"], bad["full_params"]
        if bad["read_only"] != "root ignores permissions":
            assert "is not writable" in bad["read_only"], (rank, bad["read_only"])
        assert "in use by another run" in bad["shared"] and bad["kept_alive"], (rank, bad["shared"])
