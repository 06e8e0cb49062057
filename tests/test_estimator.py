import json

import pytest

from zerodp import cli
from zerodp.memory.estimator import (
    GB,
    MemoryRow,
    activation_bytes,
    checkpoint_bytes_per_rank,
    estimate,
    format_gb,
    format_table,
    largest_model,
    largest_model_placed,
    model_state_bytes,
    pa_allgather_numel,
    paper_table_1,
    params_from_config,
    placement_bytes,
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
        (lambda: model_state_bytes(10, 1, 1, tp_size=0), r"tp_size=0: .*1 = no tensor parallelism"),
        (lambda: largest_model(10, 1, 1, tp_size=2.0), "tp_size=2.0"),
        (lambda: estimate("gpt2-xl", tp_size=-4), "tp_size=-4"),
        (lambda: checkpoint_bytes_per_rank(0, 8, 8, 1), "n_layer=0: must be an int >= 1"),
        (lambda: checkpoint_bytes_per_rank(2, 8, 8, 1, tp_size=0), r"tp_size=0: .*1 = no tensor parallelism"),
        (lambda: checkpoint_bytes_per_rank(2, 8, 8.5, 1), "seq_len=8.5"),
        (lambda: checkpoint_bytes_per_rank(2, 8, 8, True), "batch_size=True"),
        (lambda: checkpoint_bytes_per_rank(2, 8, 8, 1, dtype_bytes=0), "dtype_bytes=0"),
        (lambda: checkpoint_bytes_per_rank(2, 8, 8, 1, partitioned="yes"), r"partitioned='yes': must be True"),
        (lambda: pa_allgather_numel(2, 8, 8, 1, tp_size=-1), "tp_size=-1"),
        (lambda: pa_allgather_numel(2, 0, 8, 1, tp_size=2), "hidden=0"),
    ],
)
def test_bad_inputs_raise_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_placements_move_the_optimizer_off_the_device():
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


# -- tensor parallelism and partitioned activation checkpoints (ZeRO §6.1, §8) ----------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n, tp", [(1, 1), (4, 2), (64, 16), (3, 8)])
def test_tp_divides_the_model_before_zero(stage, n, tp):
    # Ψ / tp per tensor-parallel rank, then the stage's formula over the N data-parallel ranks.
    psi = 128_000_000_000
    assert model_state_bytes(psi, n, stage, tp_size=tp) == pytest.approx(_formula_gb(psi / tp, n, stage) * GB,
                                                                         rel=1e-15)
    assert model_state_bytes(psi, n, stage, tp_size=tp) * tp == pytest.approx(model_state_bytes(psi, n, stage))
    # The default is no tensor parallelism: existing callers see the same bytes.
    assert model_state_bytes(psi, n, stage) == model_state_bytes(psi, n, stage, tp_size=1)


def test_tp_model_states_exact_values():
    # 7.5B at TP 4, DP 16: 1.875B parameters per TP rank. Stage 1: 4 x 1.875e9 + 12 x 1.875e9 / 16.
    assert model_state_bytes(7_500_000_000, 16, 1, tp_size=4) == 7.5e9 + 1.40625e9
    assert model_state_bytes(7_500_000_000, 16, 3, tp_size=4) == 16 * 1.875e9 / 16
    # The offload placement divides the same way (Ψ/tp, then the place's formula).
    assert placement_bytes(7.5e9, 8, 3, "host", tp_size=2) == {"device": 7.5e9 / 2 * 4 / 8,
                                                               "host": 7.5e9 / 2 * 16 / 8, "disk": 0.0}
    assert largest_model_placed(8, 3, "host", {"device": 32e9, "host": 256e9}, tp_size=2) == 128 * 10**9


@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("n, tp", [(1, 2), (64, 16), (3, 7)])
@pytest.mark.parametrize("device_bytes", [1, 32 * GB, 80 * GB + 7])
def test_largest_model_with_tp_is_the_inverse(stage, n, tp, device_bytes):
    psi = largest_model(device_bytes, n, stage, tp_size=tp)
    assert model_state_bytes(psi, n, stage, tp_size=tp) <= device_bytes
    assert model_state_bytes(psi + 1, n, stage, tp_size=tp) > device_bytes


def test_estimate_rows_carry_tp_and_the_table_shows_it():
    rows = estimate("7.5B", world_sizes=(16,), stages=(1, 3), tp_size=4)
    assert [(r.world_size, r.tp_size, r.stage) for r in rows] == [(16, 4, 1), (16, 4, 3)]
    assert rows[0].nbytes == model_state_bytes(7_500_000_000, 16, 1, tp_size=4)
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["model", "DP", "TP", "P_os", "P_os+g+p"]
    assert lines[1].split() == ["7.5B", "16", "4", "8.91", "1.88"]
    # Without tensor parallelism the table is the one it always was: no TP column.
    assert "TP" not in format_table(estimate("7.5B", (16,), (1,))).splitlines()[0].split()


def test_checkpoint_bytes_hand_computed_with_padding():
    # 3 layers, one checkpoint each of seq 7 x batch 1 x hidden 5 = 35 elements, fp16.
    assert checkpoint_bytes_per_rank(3, 5, 7, 1) == 3 * 35 * 2 == 210
    # Without Pa every TP rank holds the whole checkpoint, however many there are.
    assert checkpoint_bytes_per_rank(3, 5, 7, 1, tp_size=4) == 210
    # Pa over 4 ranks: 35 = 9 + 9 + 9 + 8, the last partition padded to 9 ([Note: Pa padding]).
    assert checkpoint_bytes_per_rank(3, 5, 7, 1, tp_size=4, partitioned=True) == 3 * 9 * 2 == 54
    assert pa_allgather_numel(3, 5, 7, 1, tp_size=4) == 3 * 9 * 4 == 108
    # Divisible: no padding, exactly 1/tp; fp32 doubles the bytes, not the elements.
    assert checkpoint_bytes_per_rank(2, 8, 4, 2, dtype_bytes=4, tp_size=4, partitioned=True) == 2 * 16 * 4
    assert pa_allgather_numel(2, 8, 4, 2, tp_size=4) == 2 * 64
    # Pa over one rank is the whole checkpoint; the ledger still counts a gather of it.
    assert checkpoint_bytes_per_rank(3, 5, 7, 1, partitioned=True) == 210
    assert pa_allgather_numel(3, 5, 7, 1) == 3 * 35


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 7, 16, 64])
@pytest.mark.parametrize("shape", [(1, 5, 7, 1), (4, 48, 33, 3), (48, 1600, 1024, 32)])
def test_pa_is_whole_over_tp_up_to_padding(shape, tp):
    whole = checkpoint_bytes_per_rank(*shape, tp_size=tp)
    pa = checkpoint_bytes_per_rank(*shape, tp_size=tp, partitioned=True)
    n_layer, dtype_bytes = shape[0], 2
    # tp partitions of pa bytes cover the whole, with less than one element per layer per rank of padding.
    assert whole <= pa * tp < whole + n_layer * tp * dtype_bytes
    assert (pa * tp == whole) == (shape[1] * shape[2] * shape[3] % tp == 0)
    # The gather collects exactly those tp partitions of every layer's checkpoint.
    assert pa_allgather_numel(*shape, tp_size=tp) * dtype_bytes == pa * tp
    # The same convention as activation_bytes with checkpointing.
    assert whole == activation_bytes(*shape, checkpointing=True)


def test_pa_allgather_is_a_twelfth_of_megatron():
    # ZeRO §8: one seq x batch x hidden all-gather per block against Megatron's 12 x seq x hidden.
    layers, hidden, seq, batch = 125, 8192, 1024, 32
    megatron = 12 * layers * seq * batch * hidden
    assert pa_allgather_numel(layers, hidden, seq, batch, tp_size=16) * 12 == megatron


def test_paper_section_6_1_figure():
    # ZeRO §6.1: 100B model, batch 32, seq 1024, MP 16, one checkpoint per layer: "about 33 GB"
    # per GPU, "about 2 GB" with Pa. Shape assumed (docs/estimator.md): 125 layers, hidden 8192,
    # 12 x 125 x 8192^2 = 100.7B parameters.
    assert 12 * 125 * 8192**2 == 100_663_296_000
    whole = checkpoint_bytes_per_rank(125, 8192, 1024, 32, tp_size=16)
    pa = checkpoint_bytes_per_rank(125, 8192, 1024, 32, tp_size=16, partitioned=True)
    assert whole == 125 * 1024 * 32 * 8192 * 2 == 67_108_864_000  # 67.1 GB in fp16
    assert pa == 4_194_304_000 and whole == 16 * pa  # 4.19 GB: the ratio is the MP degree exactly
    # The paper's 33 GB / 2 GB are these figures at one byte per value (or the element counts).
    one_byte = [checkpoint_bytes_per_rank(125, 8192, 1024, 32, 1, 16, pa) / GB for pa in (False, True)]
    assert [format_gb(x) for x in one_byte] == ["33.6", "2.1"]


def _estimate(argv, capsys):
    code = cli.main(["estimate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_tp_and_pa(capsys):
    code, out, err = _estimate(["--params", "7.5e9", "--world-sizes", "16", "--stages", "1", "3", "--tp-size",
                                "4", "--layers", "3", "--hidden", "5", "--seq-len", "7", "--batch-size", "1",
                                "--partition-activations"], capsys)
    assert code == 0, err
    assert "world = DP x 4 ranks" in out
    table = [" ".join(line.split()) for line in out.splitlines()]
    assert "7.5B 16 4 8.91 1.88" in table
    # 210 bytes whole, 54 with Pa (9 + 9 + 9 + 8 padded to 9, x 3 layers x 2 bytes), on the device.
    assert f"| whole on every TP rank (no Pa) | {format_gb(210 / GB)} | 0 |" in out
    assert "| Pa: 1/4 each, padded * | 0 | 0 |" in out  # 54 bytes rounds to 0 GB
    assert "all-gather of 108 elements" in out
    assert "host<->device" not in out


def test_cli_section_6_1(capsys):
    code, out, err = _estimate(["--params", "100.663296e9", "--world-sizes", "4", "--stages", "1", "--tp-size",
                                "16", "--layers", "125", "--hidden", "8192", "--seq-len", "1024", "--batch-size",
                                "32", "--partition-activations"], capsys)
    assert code == 0, err
    assert "| whole on every TP rank (no Pa) | 67.1 | 0 |" in out
    assert "| Pa: 1/16 each, padded * | 4.19 | 0 |" in out
    assert "all-gather of 33,554,432,000 elements (67.1 GB) per step" in out
    assert "8.3% of Megatron's TP all-reduces" in out


def test_cli_pa_on_host_and_the_device_budget(capsys):
    shape = ["--layers", "125", "--hidden", "8192", "--seq-len", "1024", "--batch-size", "32"]
    base = ["--params", "100e9", "--world-sizes", "64", "--stages", "2", "--tp-size", "16", "--device-memory",
            "32GB", *shape]
    code, out, _ = _estimate([*base, "--partition-activations", "--activations-on-host"], capsys)
    assert code == 0
    assert "| Pa: 1/16 each, padded * | 0 | 4.19 |" in out and "(Pa+cpu)" in out
    assert "host<->device copies: 4.19 GB" in out
    assert "device memory 32 GB\n" in out  # nothing of the checkpoints left on the device
    # Pa on the device: 4.19 GB of the 32 come off the model states' budget.
    code, out, _ = _estimate([*base, "--partition-activations"], capsys)
    assert code == 0 and "device memory 32 GB, 27.8 GB left for model states" in out
    # Pa+cpu without the partition: whole checkpoints on the host.
    code, out, _ = _estimate([*base, "--activations-on-host"], capsys)
    assert code == 0 and "| whole on every TP rank (no Pa) * | 0 | 67.1 |" in out


def test_cli_pa_over_one_rank_says_it_saves_nothing(capsys):
    code, out, _ = _estimate(["--params", "1.5e9", "--world-sizes", "8", "--stages", "3", "--layers", "48",
                              "--hidden", "1600", "--seq", "1024", "--batch", "32", "--partition-activations"], capsys)
    assert code == 0
    assert "| whole on every TP rank (no Pa) | 5.03 | 0 |" in out and "| Pa: 1/1 each, padded * | 5.03 | 0 |" in out
    assert "saves nothing and gathers nothing" in out
    assert "all-gather of" not in out  # no traffic claimed for a gather over one rank
    assert "TP=1:" in out and "world = DP x" not in out


def test_cli_without_the_new_flags_is_unchanged(capsys):
    code, out, _ = _estimate(["--params", "1.5e9", "--world-sizes", "8", "--stages", "3", "--layers", "48",
                              "--hidden", "1600", "--seq", "1024", "--batch", "32", "--checkpointing"], capsys)
    assert code == 0
    assert "activations: 5.03 GB per device (with activation checkpointing" in out
    assert "activation checkpoints per rank" not in out and "TP" not in out


@pytest.mark.parametrize("argv, expected", [
    (["--params", "1e9", "--partition-activations"],
     "--partition-activations needs all of --layers, --hidden, --seq-len and --batch-size"),
    (["--params", "1e9", "--activations-on-host", "--layers", "2"],
     "--activations-on-host needs all of --layers, --hidden, --seq-len and --batch-size (missing --hidden"),
    (["--params", "1e9", "--layers", "2", "--hidden", "3"], "(missing --seq-len, --batch-size)"),
    (["--params", "1e9", "--checkpointing"], "--checkpointing needs all of"),
    (["--params", "1e9", "--tp-size", "0"], "--tp-size 0: must be >= 1 (1 = no tensor parallelism)"),
    (["--params", "1e9", "--layers", "0", "--hidden", "1", "--seq-len", "1", "--batch-size", "1"],
     "--layers 0: must be >= 1"),
    (["--params", "1e9", "--offload", "host", "--partition-activations"], "--partition-activations needs"),
    (["--params", "1e9", "--tp-size", "two"], "argument --tp-size: invalid int value: 'two'"),
    (["--params", "1e9", "--layers", "2", "--hidden", "8", "--seq-len", "4", "--batch-size", "1", "--param-bytes",
      "0.5"], "--param-bytes 0.5: with --layers etc. it is the activations' element size too"),
])
def test_cli_estimate_usage_errors_are_one_line(argv, expected, capsys):
    try:
        code = cli.main(["estimate", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("zerodp estimate: error:") and expected in lines[0]
