"""Config.offload_optimizer="host" (ZeRO-Offload): the master, the optimizer's states and
its step on the host. Results from the core world (test_core.py's fixture) at N = 1, 2, 4."""
import pytest

from test_core import BF16_TOL, FP32_TOL, world  # noqa: F401  (the shared N = 1, 2, 4 worlds)


def test_offloaded_step_is_the_device_step_bit_for_bit_and_ddps(world):  # noqa: F811
    n, results = world
    for r in results:
        for key, case in r["offload"].items():
            if not isinstance(key, tuple) or len(key) != 3:
                continue
            stage, precision, opt = key
            # The same fp32 maths on the same values, only in other memory: the same bits.
            assert case["same_as_device"] and case["losses_equal"], (n, key)
            tol = FP32_TOL if precision == "fp32" else BF16_TOL
            assert case["diff"] <= tol and case["loss_diff"] <= tol, (n, key, case["diff"], case["loss_diff"])


def test_the_ledger_counts_what_the_host_holds(world):  # noqa: F811
    n, results = world
    for r in results:
        for key, case in r["offload"].items():
            if not isinstance(key, tuple) or len(key) != 3:
                continue
            # Host: the fp32 master, the fp32 gradient copied down beside it and the states,
            # 4 + 4 + K bytes per owned element, even in fp32 (the parameters stay on the device).
            per = 4 + 4 + case["state_bytes"]
            assert case["host"] == per * case["shard_numel"], (n, key, case["host"], case["shard_numel"])
            assert case["master"] == 4 * case["shard_numel"] and case["device_host"] == 0, (n, key)


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_with_accumulation_and_clipping_equals_ddp(world, stage):  # noqa: F811
    n, results = world
    for r in results:
        case = r["offload"][("accumulation", stage)]
        assert case["diff"] <= FP32_TOL and case["norm_gap"] <= FP32_TOL, (n, stage, case)


def test_checkpoints_move_between_offloaded_and_not_bit_for_bit(world):  # noqa: F811
    n, results = world
    for r in results:
        for (saved, stage), case in r["offload"]["checkpoint"].items():
            assert case["resumed"], (n, saved, stage)
