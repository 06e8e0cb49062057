"""The memory model of ZeRO (arXiv 1910.02054): bytes per device for model states.

With mixed-precision Adam, a model of Ψ parameters keeps 2Ψ bytes of fp16
parameters, 2Ψ bytes of fp16 gradients and KΨ bytes of optimizer state, where
K = 12 (fp32 master parameters, momentum and variance, 4 bytes each)
(ZeRO, arXiv 1910.02054, §3.1). Data parallelism over N ranks replicates all of
it; each ZeRO stage partitions one more of the three across the ranks
(ZeRO, §5.1-5.3, Figure 1):

    stage 0 (plain DP)        (2 + 2 + K) Ψ
    stage 1 (P_os)            2Ψ + 2Ψ + KΨ / N
    stage 2 (P_os+g)          2Ψ + (2 + K) Ψ / N
    stage 3 (P_os+g+p)        (2 + 2 + K) Ψ / N

Table 1 of the paper evaluates these for Ψ = 7.5B, 128B and 1T; GB there means
1e9 bytes. Activations are not model states; ``activation_bytes`` estimates
them separately (ZeRO, §3.2).

The arithmetic is exact (``fractions.Fraction``) so that ``largest_model`` is the
exact inverse of ``model_state_bytes``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

logger = logging.getLogger(__name__)

GB = 10**9  # the paper's GB (Table 1: 16 x 7.5e9 bytes = "120" GB)
STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}

# Model sizes the paper uses: GPT-2 1.5B (§3), and the three columns of Table 1.
PAPER_MODELS: dict[str, int] = {
    "gpt2-xl": 1_500_000_000,
    "7.5B": 7_500_000_000,
    "128B": 128_000_000_000,
    "1T": 1_000_000_000_000,
}
TABLE_1_MODELS = ("7.5B", "128B", "1T")
TABLE_1_WORLD_SIZES = (1, 4, 16, 64, 256, 1024)
TABLE_1_STAGES = (1, 2, 3)


def _check(
    num_params: float, world_size: int, stage: int, k: float, param_bytes: float, grad_bytes: float
) -> None:
    if num_params < 0:
        raise ValueError(f"num_params={num_params}: must be >= 0")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: must be one of {STAGES}")
    for name, value in (("k", k), ("param_bytes", param_bytes), ("grad_bytes", grad_bytes)):
        if value < 0:
            raise ValueError(f"{name}={value}: must be >= 0")


def _bytes_per_param(
    world_size: int, stage: int, k: float, param_bytes: float, grad_bytes: float
) -> Fraction:
    """Bytes each device holds per model parameter (ZeRO, §5, Figure 1)."""
    n = world_size
    p, g, k = Fraction(param_bytes), Fraction(grad_bytes), Fraction(k)
    if stage == 0:
        return p + g + k
    if stage == 1:  # optimizer states partitioned (§5.1)
        return p + g + k / n
    if stage == 2:  # ... and gradients (§5.2)
        return p + (g + k) / n
    return (p + g + k) / n  # ... and parameters (§5.3)


def model_state_bytes(num_params: int, world_size: int, stage: int, k: float = 12, param_bytes: float = 2,
                      grad_bytes: float = 2) -> float:
    """Bytes of parameters, gradients and optimizer state on one of ``world_size`` devices."""
    _check(num_params, world_size, stage, k, param_bytes, grad_bytes)
    return float(
        Fraction(num_params) * _bytes_per_param(world_size, stage, k, param_bytes, grad_bytes)
    )


def largest_model(device_bytes: float, world_size: int, stage: int, k: float = 12, param_bytes: float = 2,
                  grad_bytes: float = 2) -> int:
    """Largest Ψ whose model states fit in ``device_bytes`` per device (ZeRO, §5.4).

    Activations and buffers are ignored, as in Table 1 and Figure 1 of the paper.
    """
    _check(0, world_size, stage, k, param_bytes, grad_bytes)
    if device_bytes < 0:
        raise ValueError(f"device_bytes={device_bytes}: must be >= 0")
    per_param = _bytes_per_param(world_size, stage, k, param_bytes, grad_bytes)
    if per_param == 0:
        raise ValueError("k, param_bytes and grad_bytes are all 0: every model fits")
    return math.floor(Fraction(device_bytes) / per_param)


PLACES = ("device", "host", "disk")


def placement_bytes(num_params: int, world_size: int, stage: int, offload: str = "none", k: float = 12,
                    param_bytes: float = 2, grad_bytes: float = 2, offload_params: str = "none") -> dict:
    """Bytes per rank in each place (device, host, disk) with `Config.offload_optimizer`
    = `offload` (docs/offload.md), stages 1-3. K holds the fp32 master (4 bytes) when the
    parameters are 16-bit, and the optimizer's states. "host": the device keeps the
    parameters and gradients of the stage; the host the fp32 master (a copy even in fp32),
    an fp32 gradient copy and the states: (4 + 4 + K - master) Ψ/N. "disk" (a CPU run:
    device = host memory): the parameters and gradients in memory, the master (16-bit
    runs; in fp32 the parameters are it) and the states on disk: K Ψ/N.
    `offload_params` (stage 3, Config.offload_params): the parameter and gradient shards,
    (P + G) Ψ/N, leave the device for that place; fp32 shards off the device are their own
    master, so the host placement then keeps no fp32 copy of them (K Ψ/N, not (8 + K) Ψ/N)."""
    _check(num_params, world_size, stage, k, param_bytes, grad_bytes)
    if offload not in ("none", "host", "disk") or offload_params not in ("none", "host", "disk"):
        raise ValueError(f"offload={offload!r}, offload_params={offload_params!r}: use 'none', 'host' or 'disk'")
    if offload_params != "none" and (stage != 3 or offload == "none"):
        raise ValueError("offload_params needs stage 3 and an offloaded optimizer (offload='host' or 'disk')")
    psi, n = Fraction(num_params), world_size
    if offload == "none":
        return {"device": float(psi * _bytes_per_param(n, stage, k, param_bytes, grad_bytes)), "host": 0.0,
                "disk": 0.0}
    if stage == 0:
        raise ValueError("offload needs stage 1, 2 or 3 (stage 0 keeps no shard of its own)")
    out = {"device": psi * _bytes_per_param(n, stage, 0, param_bytes, grad_bytes), "host": Fraction(0),
           "disk": Fraction(0)}  # the device: the stage without K
    if offload_params != "none":
        moved = psi * (Fraction(param_bytes) + Fraction(grad_bytes)) / n
        out["device"] -= moved
        out[offload_params] += moved
    master = 4 if param_bytes < 4 else 0
    if offload == "host":  # + an fp32 master and gradient copy, unless fp32 shards are already off the device
        out["host"] += psi * (Fraction(k) + (8 - master if master or offload_params == "none" else 0)) / n
    else:
        out["disk"] += psi * Fraction(k) / n
    return {place: float(v) for place, v in out.items()}


def largest_model_placed(world_size: int, stage: int, offload: str, limits: dict, k: float = 12,
                         param_bytes: float = 2, grad_bytes: float = 2, offload_params: str = "none") -> int:
    """Largest Ψ whose bytes fit every place's limit in `limits` (bytes per rank by place;
    a place without a limit is unbounded)."""
    per = placement_bytes(10**12, world_size, stage, offload, k, param_bytes, grad_bytes, offload_params)
    bound = [Fraction(limits[place]) * 10**12 / Fraction(per[place]) for place in PLACES
             if per[place] > 0 and limits.get(place) is not None]
    if not bound:
        raise ValueError("no place with bytes has a limit: give the device's (and host's or disk's) memory")
    return math.floor(min(bound))


def activation_bytes(
    n_layer: int,
    hidden: int,
    seq_len: int,
    batch_size: int,
    checkpointing: bool = False,
    dtype_bytes: int = 2,
) -> int:
    """Activation memory of a GPT-2-like transformer, as the ZeRO paper counts it.

    Without checkpointing: 12 x hidden x seq_len x batch x layers activations of
    ``dtype_bytes`` each (ZeRO, §3.2; for the 1.5B GPT-2 at seq 1K, batch 32 this
    gives 60.4 GB, the paper's "about 60 GB"). With checkpointing: one
    checkpoint per transformer layer, its seq_len x batch x hidden input
    (ZeRO, §6.1, "checkpoint a single activation for each transformer layer");
    that gives 5.0 GB for the same GPT-2, where the paper quotes "about 8 GB"
    because it also counts the recomputed layer's working set. That working
    set, and attention scores, are not counted here.
    """
    for name, value in (
        ("n_layer", n_layer),
        ("hidden", hidden),
        ("seq_len", seq_len),
        ("batch_size", batch_size),
        ("dtype_bytes", dtype_bytes),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an int >= 1")
    per_layer = seq_len * batch_size * hidden * (1 if checkpointing else 12)
    return per_layer * n_layer * dtype_bytes


def params_from_config(path: str | os.PathLike[str]) -> int:
    """Approximate Ψ of a GPT-2-style Hugging Face ``config.json``.

    Ψ ≈ 12·L·h² + (V + P)·h: per block 4h² for attention and 8h² for the 4x MLP,
    plus token and position embeddings (Kaplan et al., 2020, Table 1, with the
    embeddings added); biases and LayerNorms are ignored. Keys: ``n_layer``,
    ``n_embd``, ``vocab_size``, ``n_positions``.
    """
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    missing = [key for key in ("n_layer", "n_embd", "vocab_size", "n_positions") if key not in cfg]
    if missing:
        raise ValueError(
            f"config {os.fspath(path)!r} lacks {missing}: need GPT-2 style keys "
            "n_layer, n_embd, vocab_size, n_positions"
        )
    layers, h = cfg["n_layer"], cfg["n_embd"]
    return 12 * layers * h * h + (cfg["vocab_size"] + cfg["n_positions"]) * h


def resolve_num_params(model: int | str | os.PathLike[str]) -> tuple[str, int]:
    """Return ``(label, Ψ)`` for an int, a name in ``PAPER_MODELS`` or a config.json path."""
    if isinstance(model, int):
        if model < 0:
            raise ValueError(f"model={model}: a parameter count must be >= 0")
        return str(model), model
    if isinstance(model, str) and model in PAPER_MODELS:
        return model, PAPER_MODELS[model]
    if os.path.isfile(model):
        return os.fspath(model), params_from_config(model)
    raise ValueError(
        f"model={model!r} is neither a parameter count, one of {sorted(PAPER_MODELS)}, "
        "nor an existing config.json path"
    )


@dataclass(frozen=True)
class MemoryRow:
    """Model-state memory on one device for one (model, world size, stage)."""

    model: str
    num_params: int
    world_size: int
    stage: int
    nbytes: float

    @property
    def gb(self) -> float:
        return self.nbytes / GB


def estimate(
    model: int | str | os.PathLike[str],
    world_sizes: tuple[int, ...] = TABLE_1_WORLD_SIZES,
    stages: tuple[int, ...] = STAGES,
    k: float = 12,
) -> list[MemoryRow]:
    """Model-state bytes per device of ``model`` for every world size and stage."""
    label, num_params = resolve_num_params(model)
    return [
        MemoryRow(label, num_params, n, stage, model_state_bytes(num_params, n, stage, k))
        for n in world_sizes
        for stage in stages
    ]


def paper_table_1() -> list[MemoryRow]:
    """The 54 cells of ZeRO Table 1: 3 models x 6 DP degrees x stages 1-3, K = 12."""
    rows: list[MemoryRow] = []
    for name in TABLE_1_MODELS:
        rows += estimate(name, TABLE_1_WORLD_SIZES, TABLE_1_STAGES)
    return rows


def format_gb(gb: float) -> str:
    """Render GB as Table 1 does: 3 significant digits, at most 2 decimals, half up.

    Integer digits are never dropped and trailing zeros are stripped, which gives
    the paper's "120", "31.4", "16.6", "1.88" and "7.5".
    """
    if gb < 0:
        raise ValueError(f"gb={gb}: must be >= 0")
    value = Decimal(repr(gb))
    if value == 0:
        return "0"
    integer_digits = value.adjusted() + 1  # <= 0 below 1, so the 2-decimal cap applies
    decimals = min(max(3 - integer_digits, 0), 2)
    text = str(value.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_table(rows: list[MemoryRow]) -> str:
    """Render rows as a plain-text table: one line per (model, world size), GB per stage."""
    stages = sorted({r.stage for r in rows})
    header = ["model", "DP"] + [STAGE_NAMES[s] for s in stages]
    cells: dict[tuple[str, int], dict[int, str]] = {}
    for r in rows:
        cells.setdefault((r.model, r.world_size), {})[r.stage] = format_gb(r.gb)
    lines = [header] + [
        [model, str(n)] + [by_stage.get(s, "") for s in stages]
        for (model, n), by_stage in cells.items()
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))
        )
        for line in lines
    )
