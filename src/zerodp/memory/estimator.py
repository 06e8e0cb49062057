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

With tensor parallelism (TP, the paper's MP: Megatron-LM) of degree ``tp_size``
each rank first holds Ψ / tp_size of the parameters, and ZeRO then partitions
that slice over the N data-parallel ranks: the formulas above with Ψ / tp_size
for Ψ, N the data-parallel degree, world = N x tp_size (ZeRO, Table 2: ZeRO-DP
combined with MP divides the model states by N_d x N_m at stage 3).
``checkpoint_bytes_per_rank`` and ``pa_allgather_numel`` give the activation
checkpoints one rank holds with and without partitioning them over the TP ranks
(Pa, ZeRO §6.1) and what Pa adds to the communication (§8).

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


def _check_ints(**values: int) -> None:
    """Each value must be an int >= 1 (a bool is not a count)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            hint = " (1 = no tensor parallelism)" if name == "tp_size" else ""
            raise ValueError(f"{name}={value!r}: must be an int >= 1{hint}")


def _check(
    num_params: float, world_size: int, stage: int, k: float, param_bytes: float, grad_bytes: float,
    tp_size: int = 1,
) -> None:
    if num_params < 0:
        raise ValueError(f"num_params={num_params}: must be >= 0")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be an int >= 1")
    _check_ints(tp_size=tp_size)
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
                      grad_bytes: float = 2, tp_size: int = 1) -> float:
    """Bytes of parameters, gradients and optimizer state on one of ``world_size`` devices.

    ``world_size`` is the data-parallel degree N. With ``tp_size`` > 1 each rank's
    tensor-parallel slice, Ψ / tp_size, is what ZeRO partitions over the N ranks
    (module docstring); the world is then N x tp_size ranks. The split is the ideal
    one: Megatron-LM divides the 12h² weights of each block, but replicates the
    LayerNorms and the biases of the row-parallel layers, a few h per block.
    """
    _check(num_params, world_size, stage, k, param_bytes, grad_bytes, tp_size)
    return float(
        Fraction(num_params) / tp_size * _bytes_per_param(world_size, stage, k, param_bytes, grad_bytes)
    )


def largest_model(device_bytes: float, world_size: int, stage: int, k: float = 12, param_bytes: float = 2,
                  grad_bytes: float = 2, tp_size: int = 1) -> int:
    """Largest Ψ whose model states fit in ``device_bytes`` per device (ZeRO, §5.4).

    Activations and buffers are ignored, as in Table 1 and Figure 1 of the paper.
    With ``tp_size`` > 1, Ψ is the whole model, of which each rank holds Ψ / tp_size.
    """
    _check(0, world_size, stage, k, param_bytes, grad_bytes, tp_size)
    if device_bytes < 0:
        raise ValueError(f"device_bytes={device_bytes}: must be >= 0")
    per_param = _bytes_per_param(world_size, stage, k, param_bytes, grad_bytes)
    if per_param == 0:
        raise ValueError("k, param_bytes and grad_bytes are all 0: every model fits")
    return math.floor(Fraction(device_bytes) * tp_size / per_param)


def moe_state_bytes(num_params: int, world_size: int, stage: int, expert_fraction: float, ep_size: int = 1,
                    k: float = 12, param_bytes: float = 2, grad_bytes: float = 2) -> dict:
    """Bytes of model states per rank of an MoE model whose experts are `expert_fraction`
    of its Ψ parameters, with expert parallelism over `ep_size` ranks (docs/moe.md, "What
    each rank holds"): the non-expert part as ZeRO's formula over the N ranks; each rank's
    fΨ/ep_size expert parameters by the same formula over the N/ep_size ranks that hold them
    ([Note: expert-parallel axes] in distributed/topology.py). Returns {"dense", "experts",
    "total", "gathered_bank_fraction"}: the last, at stage 3, the fraction of the experts a
    rank gathers while a layer runs (1/ep_size of its bank)."""
    _check(num_params, world_size, stage, k, param_bytes, grad_bytes)
    _check_ints(ep_size=ep_size)
    if not 0 <= expert_fraction <= 1:
        raise ValueError(f"expert_fraction={expert_fraction}: must be between 0 and 1")
    if world_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide world_size={world_size}")
    f, psi = Fraction(expert_fraction), Fraction(num_params)
    dense = (1 - f) * psi * _bytes_per_param(world_size, stage, k, param_bytes, grad_bytes)
    experts = f * psi / ep_size * _bytes_per_param(world_size // ep_size, stage, k, param_bytes, grad_bytes)
    return {"dense": float(dense), "experts": float(experts), "total": float(dense + experts),
            "gathered_bank_fraction": 1 / ep_size}


def moe_step_numel(num_params: int, expert_fraction: float, ep_size: int, moe_layers: int, tokens: int,
                   top_k: int, hidden: int) -> dict:
    """Elements one rank sends per stage-3 step (the comm ledger's count, ZeRO §7's for the
    gathers): without EP each bank is gathered twice and reduce-scattered once, 3 fΨ; with it
    3 fΨ / ep_size over the ranks that share it, plus the all-to-alls: each of the rank's
    `tokens` x `top_k` (token, expert) rows of `hidden` elements out and back in the forward,
    and their gradients in the backward, per MoE layer (docs/moe.md, "When EP pays")."""
    _check_ints(ep_size=ep_size, moe_layers=moe_layers, top_k=top_k, hidden=hidden)
    bank = 3 * expert_fraction * num_params
    a2a = 4 * moe_layers * tokens * top_k * hidden if ep_size > 1 else 0
    return {"dense": 3 * (1 - expert_fraction) * num_params, "experts": bank / ep_size, "all_to_all": a2a,
            "total": 3 * (1 - expert_fraction) * num_params + bank / ep_size + a2a}


PLACES = ("device", "host", "disk")


def placement_bytes(num_params: int, world_size: int, stage: int, offload: str = "none", k: float = 12,
                    param_bytes: float = 2, grad_bytes: float = 2, offload_params: str = "none",
                    tp_size: int = 1) -> dict:
    """Bytes per rank in each place (device, host, disk) with `Config.offload_optimizer`
    = `offload` (docs/offload.md), stages 1-3. K holds the fp32 master (4 bytes) when the
    parameters are 16-bit, and the optimizer's states. "host": the device keeps the
    parameters and gradients of the stage; the host the fp32 master (a copy even in fp32),
    an fp32 gradient copy and the states: (4 + 4 + K - master) Ψ/N. "disk" (a CPU run:
    device = host memory): the parameters and gradients in memory, the master (16-bit
    runs; in fp32 the parameters are it) and the states on disk: K Ψ/N.
    `offload_params` (stage 3, Config.offload_params): the parameter and gradient shards,
    (P + G) Ψ/N, leave the device for that place; fp32 shards off the device are their own
    master, so the host placement then keeps no fp32 copy of them (K Ψ/N, not (8 + K) Ψ/N).
    `tp_size`: Ψ / tp_size per tensor-parallel rank before ZeRO, as in `model_state_bytes`."""
    _check(num_params, world_size, stage, k, param_bytes, grad_bytes, tp_size)
    if offload not in ("none", "host", "disk") or offload_params not in ("none", "host", "disk"):
        raise ValueError(f"offload={offload!r}, offload_params={offload_params!r}: use 'none', 'host' or 'disk'")
    if offload_params != "none" and (stage != 3 or offload == "none"):
        raise ValueError("offload_params needs stage 3 and an offloaded optimizer (offload='host' or 'disk')")
    psi, n = Fraction(num_params) / tp_size, world_size
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
                         param_bytes: float = 2, grad_bytes: float = 2, offload_params: str = "none",
                         tp_size: int = 1) -> int:
    """Largest Ψ whose bytes fit every place's limit in `limits` (bytes per rank by place;
    a place without a limit is unbounded). With `tp_size` > 1, Ψ is the whole model."""
    per = placement_bytes(10**12, world_size, stage, offload, k, param_bytes, grad_bytes, offload_params,
                          tp_size)
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
    _check_ints(n_layer=n_layer, hidden=hidden, seq_len=seq_len, batch_size=batch_size, dtype_bytes=dtype_bytes)
    per_layer = seq_len * batch_size * hidden * (1 if checkpointing else 12)
    return per_layer * n_layer * dtype_bytes


# [Note: Pa padding]
# Pa (ZeRO, §6.1) keeps 1/tp_size of each activation checkpoint on each tensor-parallel
# rank instead of the whole replicated checkpoint. A checkpoint of numel elements is cut
# into tp_size equal partitions of ceil(numel / tp_size) elements, the last one padded,
# because an all-gather gathers equal pieces: that is also what the engine's memory
# ledger measures, so these functions count the padding rather than numel / tp_size.


def _partition_numel(numel: int, tp_size: int) -> int:
    return -(-numel // tp_size)  # ceil without floats: numel reaches 1e11 and more


def checkpoint_bytes_per_rank(
    n_layer: int,
    hidden: int,
    seq_len: int,
    batch_size: int,
    dtype_bytes: int = 2,
    tp_size: int = 1,
    partitioned: bool = False,
) -> int:
    """Bytes of activation checkpoints one rank holds: one checkpoint per transformer
    layer, its seq_len x batch x hidden input (ZeRO, §6.1; ``activation_bytes`` with
    checkpointing counts the same). ``batch_size`` is the micro-batch of one
    data-parallel rank, which every rank of its tensor-parallel group works on.

    Without partitioning every one of the ``tp_size`` ranks holds every checkpoint whole:
    n_layer x numel x dtype_bytes, numel = seq_len x batch x hidden, whatever tp_size is.
    With Pa (``partitioned=True``) each holds ceil(numel / tp_size) elements of each
    ([Note: Pa padding]): up to padding, the unpartitioned bytes / tp_size. Where they
    live, device or host (Pa+cpu), does not change the count.
    """
    _check_ints(n_layer=n_layer, hidden=hidden, seq_len=seq_len, batch_size=batch_size, dtype_bytes=dtype_bytes,
                tp_size=tp_size)
    if not isinstance(partitioned, bool):
        raise ValueError(f"partitioned={partitioned!r}: must be True (Pa) or False")
    numel = seq_len * batch_size * hidden
    held = _partition_numel(numel, tp_size) if partitioned else numel
    return n_layer * held * dtype_bytes


def pa_allgather_numel(n_layer: int, hidden: int, seq_len: int, batch_size: int, tp_size: int = 1) -> int:
    """Elements all-gathered per step that Pa adds, counted as the comm ledger counts
    volume (the gathered tensor's elements, ZeRO §7): each checkpoint is gathered once
    over the tensor-parallel ranks before its recomputation, tp_size padded partitions
    of ceil(numel / tp_size) ([Note: Pa padding]), so n_layer x ceil(numel / tp_size) x
    tp_size elements, numel = seq_len x batch x hidden.

    That is one seq x batch x hidden message per block against Megatron-LM's 12 per block
    (two all-reduces each in forward, recomputation and backward, an all-reduce moving
    twice its message): 1/12, "less than 10%" of tensor parallelism's own volume
    (ZeRO, §8). With tp_size = 1 the count is that of a gather over one rank, which
    moves nothing between ranks (the comm's world-size-1 shortcut records it the same way).
    """
    _check_ints(n_layer=n_layer, hidden=hidden, seq_len=seq_len, batch_size=batch_size, tp_size=tp_size)
    return n_layer * _partition_numel(seq_len * batch_size * hidden, tp_size) * tp_size


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
    """The data-parallel degree N; the world is world_size x tp_size ranks."""
    stage: int
    nbytes: float
    tp_size: int = 1
    """Tensor-parallel degree: each rank's states are those of Ψ / tp_size parameters."""

    @property
    def gb(self) -> float:
        return self.nbytes / GB


def estimate(
    model: int | str | os.PathLike[str],
    world_sizes: tuple[int, ...] = TABLE_1_WORLD_SIZES,
    stages: tuple[int, ...] = STAGES,
    k: float = 12,
    tp_size: int = 1,
) -> list[MemoryRow]:
    """Model-state bytes per device of ``model`` for every (data-parallel) world size and
    stage, with ``tp_size`` tensor-parallel ranks under each."""
    label, num_params = resolve_num_params(model)
    return [
        MemoryRow(label, num_params, n, stage, model_state_bytes(num_params, n, stage, k, tp_size=tp_size),
                  tp_size)
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
    """Render rows as a plain-text table: one line per (model, world size), GB per stage;
    a TP column only when some row has tensor parallelism."""
    stages = sorted({r.stage for r in rows})
    with_tp = any(r.tp_size != 1 for r in rows)
    header = ["model", "DP"] + (["TP"] if with_tp else []) + [STAGE_NAMES[s] for s in stages]
    cells: dict[tuple[str, int, int], dict[int, str]] = {}
    for r in rows:
        cells.setdefault((r.model, r.world_size, r.tp_size), {})[r.stage] = format_gb(r.gb)
    lines = [header] + [
        [model, str(n)] + ([str(tp)] if with_tp else []) + [by_stage.get(s, "") for s in stages]
        for (model, n, tp), by_stage in cells.items()
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))
        )
        for line in lines
    )


def format_checkpoints(n_layer: int, hidden: int, seq_len: int, batch_size: int, dtype_bytes: int = 2,
                       tp_size: int = 1, partitioned: bool = False, on_host: bool = False, mark: bool = True) -> str:
    """Render the checkpoints one rank holds without and with Pa, on the device or (``on_host``:
    Pa+cpu when ``partitioned``) the host, and what Pa adds to the traffic; ``mark`` stars the
    row ``partitioned`` chose. Text of `zerodp estimate`, docs/estimator.md."""
    nbytes = {pa: checkpoint_bytes_per_rank(n_layer, hidden, seq_len, batch_size, dtype_bytes, tp_size, pa)
              for pa in (False, True)}
    tp = tp_size
    lines = [f"activation checkpoints per rank (ZeRO §6.1): {n_layer} layers x one checkpoint of seq {seq_len} x "
             f"batch {batch_size} x hidden {hidden} (the layer's input; batch per DP rank), {dtype_bytes} bytes "
             f"each, TP={tp}, kept on the {'host' if on_host else 'device'}",
             "| checkpoints | device GB | host GB |", "|---|---:|---:|"]
    for pa, label in ((False, "whole on every TP rank (no Pa)"), (True, f"Pa: 1/{tp} each, padded")):
        held = format_gb(nbytes[pa] / GB)
        device, host = ("0", held) if on_host else (held, "0")
        lines.append(f"| {label}{' *' if mark and pa == partitioned else ''} | {device} | {host} |")
    if mark:
        lines.append("* = the flags given" + (" (Pa+cpu)" if on_host and partitioned else ""))
    if tp == 1:  # Pa over one rank keeps the whole checkpoint and gathers it from nobody
        lines.append("TP=1: Pa partitions each checkpoint over 1 rank, so it saves nothing and gathers nothing "
                     "(give --tp-size > 1)")
    else:
        gathered = pa_allgather_numel(n_layer, hidden, seq_len, batch_size, tp)
        # Megatron-LM: 2 all-reduces of seq x batch x hidden in each of forward, recomputation
        # and backward per layer, an all-reduce moving twice its message (ZeRO §8).
        megatron = 12 * n_layer * seq_len * batch_size * hidden
        lines.append(f"Pa adds an all-gather of {gathered:,} elements ({format_gb(gathered * dtype_bytes / GB)} GB) "
                     f"per step, one gather of each checkpoint before its recomputation (counted as the comm "
                     f"ledger does, in gathered elements); {100 * gathered / megatron:.1f}% of Megatron's TP "
                     f"all-reduces, 12 x seq x batch x hidden per layer (ZeRO §8)")
    if on_host:
        lines.append(f"host<->device copies: {format_gb(nbytes[partitioned] / GB)} GB out in the forward and back "
                     f"before the recomputation, per rank per step"
                     + (" (ZeRO §8: Pa+cpu's added data movement)" if partitioned else ""))
    return "\n".join(lines)
