import json

import pytest

from zerodp.memory.estimator import (
    GB,
    MemoryRow,
    activation_bytes,
    estimate,
    format_gb,
    format_table,
    largest_model,
    model_state_bytes,
    paper_table_1,
    params_from_config,
    resolve_num_params,
)

PSI = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}


def _formula_gb(psi: float, n: int, stage: int, k: float = 12) -> float:
    # ZeRO, arXiv 1910.02054, §5 / Figure 1, written out independently.
    return {
        0: (2 + 2 + k) * psi,
        1: 2 * psi + 2 * psi + k * psi / n,
        2: 2 * psi + (2 + k) * psi / n,
        3: (2 + 2 + k) * psi / n,
    }[stage] / GB


# Table 1 as this library renders it; the 7.5B N=64 row is quoted in the paper's text.
EXPECTED_TABLE_1 = {
    "7.5B": {
        1: ("120", "120", "120"),
        4: ("52.5", "41.3", "30"),
        16: ("35.6", "21.6", "7.5"),
        64: ("31.4", "16.6", "1.88"),
        256: ("30.4", "15.4", "0.47"),
        1024: ("30.1", "15.1", "0.12"),
    },
    "128B": {
        1: ("2048", "2048", "2048"),
        4: ("896", "704", "512"),
        16: ("608", "368", "128"),
        64: ("536", "284", "32"),
        256: ("518", "263", "8"),
        1024: ("514", "258", "2"),
    },
    "1T": {
        1: ("16000", "16000", "16000"),
        4: ("7000", "5500", "4000"),
        16: ("4750", "2875", "1000"),
        64: ("4188", "2219", "250"),
        256: ("4047", "2055", "62.5"),
        1024: ("4012", "2014", "15.6"),
    },
}


def test_table_1_has_54_cells_matching_the_formulas():
    rows = paper_table_1()
    assert len(rows) == 54
    keys = {(r.model, r.world_size, r.stage) for r in rows}
    assert keys == {(m, n, s) for m in PSI for n in (1, 4, 16, 64, 256, 1024) for s in (1, 2, 3)}
    for r in rows:
        assert r.num_params == PSI[r.model]
        assert r.gb == pytest.approx(_formula_gb(PSI[r.model], r.world_size, r.stage), rel=1e-12)


def test_cells_quoted_in_the_paper():
    # ZeRO §5 text: 7.5B on 64 GPUs -> 31.4 GB (P_os), 16.6 GB (P_os+g), 1.88 GB (P_os+g+p).
    cells = {(r.model, r.world_size, r.stage): r for r in paper_table_1()}
    assert cells["7.5B", 64, 1].gb == pytest.approx(31.40625)
    assert cells["7.5B", 64, 2].gb == pytest.approx(16.640625)
    assert cells["7.5B", 64, 3].gb == pytest.approx(1.875)
    assert [format_gb(cells["7.5B", 64, s].gb) for s in (1, 2, 3)] == ["31.4", "16.6", "1.88"]
    # Baseline DP: 16 bytes per parameter, 120 GB for 7.5B (§3.1).
    assert model_state_bytes(7_500_000_000, 64, 0) == 120 * GB


def test_every_formatted_cell():
    for r in paper_table_1():
        assert format_gb(r.gb) == EXPECTED_TABLE_1[r.model][r.world_size][r.stage - 1], r


@pytest.mark.parametrize(
    "gb, text",
    [
        (120.0, "120"),
        (41.25, "41.3"),
        (1.875, "1.88"),
        (0.46875, "0.47"),
        (7.5, "7.5"),
        (0.0, "0"),
        (0.001, "0"),
        (999.5, "1000"),
    ],
)
def test_format_gb_rounding_rule(gb, text):
    assert format_gb(gb) == text


def test_format_table_renders_rows():
    text = format_table(paper_table_1())
    lines = text.splitlines()
    assert len(lines) == 1 + 18
    assert lines[0].split() == ["model", "DP", "P_os", "P_os+g", "P_os+g+p"]
    assert "7.5B 64 31.4 16.6 1.88" in [" ".join(line.split()) for line in lines]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [1, 3, 64, 1024])
@pytest.mark.parametrize("device_bytes", [0, 1, 32 * GB, 80 * GB + 7])
def test_largest_model_is_the_inverse(stage, n, device_bytes):
    psi = largest_model(device_bytes, n, stage)
    assert model_state_bytes(psi, n, stage) <= device_bytes
    assert model_state_bytes(psi + 1, n, stage) > device_bytes


def test_largest_model_paper_claims():
    # §5.4 / Table 1: with P_os+g+p, 1024 V100s (32 GB) hold the 1T model's states.
    assert largest_model(32 * GB, 1024, 3) >= 1_000_000_000_000
    # Plain DP on 32 GB: 2B parameters at 16 bytes each (§3.1).
    assert largest_model(32 * GB, 64, 0) == 2_000_000_000


def test_estimate_rows():
    rows = estimate("gpt2-xl", world_sizes=(1, 8), stages=(0, 3))
    assert [(r.world_size, r.stage) for r in rows] == [(1, 0), (1, 3), (8, 0), (8, 3)]
    assert all(isinstance(r, MemoryRow) and r.num_params == 1_500_000_000 for r in rows)
    assert rows[0].gb == pytest.approx(24.0)  # §3.1: 1.5B GPT-2 -> 24 GB of model states
    assert rows[3].gb == pytest.approx(3.0)
    assert estimate(1000, (2,), (1,))[0].nbytes == 4000 + 6000


def test_config_json_is_resolved(tmp_path):
    cfg = {"n_layer": 48, "n_embd": 1600, "vocab_size": 50257, "n_positions": 1024, "n_head": 25}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    expected = 12 * 48 * 1600**2 + (50257 + 1024) * 1600
    assert params_from_config(path) == expected
    _label, psi = resolve_num_params(str(path))
    assert psi == expected and 1.5e9 < psi < 1.6e9
    assert estimate(path, (1,), (0,))[0].num_params == expected


def test_config_json_missing_keys(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(ValueError, match="n_layer"):
        params_from_config(path)


def test_activation_bytes_matches_the_paper():
    # §3.2: 1.5B GPT-2 (48 layers, hidden 1600), seq 1K, batch 32: "about 60 GB".
    assert activation_bytes(48, 1600, 1024, 32) / GB == pytest.approx(60.4, abs=0.1)
    # One fp16 checkpoint of seq x batch x hidden per layer.
    assert activation_bytes(48, 1600, 1024, 32, checkpointing=True) == 48 * 1024 * 32 * 1600 * 2


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: model_state_bytes(-1, 1, 0), "num_params=-1"),
        (lambda: model_state_bytes(10, 0, 0), "world_size=0"),
        (lambda: model_state_bytes(10, 1, 4), "stage=4"),
        (lambda: model_state_bytes(10, 1.5, 1), "world_size=1.5"),
        (lambda: model_state_bytes(10, 1, 1, k=-2), "k=-2"),
        (lambda: largest_model(-5, 1, 0), "device_bytes=-5"),
        (lambda: largest_model(5, 1, 0, k=0, param_bytes=0, grad_bytes=0), "all 0"),
        (lambda: resolve_num_params("13B"), "'13B'"),
        (lambda: resolve_num_params(-3), "model=-3"),
        (lambda: estimate("gpt2-xl", world_sizes=(0,)), "world_size=0"),
        (lambda: activation_bytes(0, 1, 1, 1), "n_layer=0"),
        (lambda: format_gb(-1.0), "gb=-1.0"),
    ],
)
def test_bad_inputs_raise_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_placements_move_the_optimizer_off_the_device():
    from zerodp.memory.estimator import largest_model_placed, placement_bytes

    # 7.5B, N = 8, stage 3, mixed-precision Adam: 2 + 2 bytes on the device per Ψ/N; host
    # offload adds the fp32 master, an fp32 gradient copy and 8 bytes of states (16), disk K = 12.
    host = placement_bytes(7.5e9, 8, 3, "host")
    assert host == {"device": 7.5e9 * 4 / 8, "host": 7.5e9 * 16 / 8, "disk": 0.0}
    disk = placement_bytes(7.5e9, 8, 3, "disk")
    assert disk == {"device": 7.5e9 * 4 / 8, "host": 0.0, "disk": 7.5e9 * 12 / 8}
    assert placement_bytes(7.5e9, 8, 3, "none")["device"] == 7.5e9 * 16 / 8
    # The tightest limit decides: 32 GB of device (64B) against 256 GB of host (128B).
    assert largest_model_placed(8, 3, "host", {"device": 32e9, "host": 256e9}) == 64 * 10**9
    assert largest_model_placed(8, 3, "host", {"device": 32e9, "host": 64e9}) == 32 * 10**9
    with pytest.raises(ValueError, match="stage 1, 2 or 3"):
        placement_bytes(1e9, 8, 0, "host")
