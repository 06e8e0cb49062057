"""torch.compile with zerodp at stages 0-3 (cases: compile_cases.py): every way a user
compiles trains with eager zerodp's results; no compiled graph takes a shard; no graph is
compiled after the first step; graphs per unit, counted ([Note: hooks stay eager] in
schedule/base.py, docs/compile.md)."""
import pytest

import compile_cases as cases
from tolerances import BF16_ULP, LM_GRAD_BOUND, U16, U32

# -- The tolerance, derived. Compiled and eager zerodp run the same model on the same
# weights, batches and collectives; inductor changes only the floating-point order:
# it reassociates reductions and fuses pointwise chains (keeping the intermediates of a
# fused chain in fp32 instead of rounding each op's output). Per element:
# - a reduction of length <= K in another order moves its result by <= K u sum|terms|;
#   K = 256, the longest reduction in these models (the vocabulary's log-sum-exp; widths
#   <= 128 and ROWS x SEQ = 32 tokens summed into a weight gradient are shorter);
# - a fused chain skips at most one rounding per op it fuses, u each: at most D = 64 ops on
#   one element's path through forward and backward (<= 32 pointwise ops per block, with its
#   layer norms, tanh-GELU, softmax and residuals and their backward, x 2 blocks).
# So each gradient element differs by <= (K u32 + D u) G, G = LM_GRAD_BOUND (the per-element
# sum|terms| bound of the checkpoint LM, tolerances.py) and u the compute dtype's unit
# roundoff (fp32: U32, bf16: U16; bf16 matmuls and reductions accumulate in fp32 on both
# sides, so K keeps U32): 1.9e-5 at fp32. SGD without momentum moves a parameter by lr x
# that per step, over STEPS = 3 at lr 0.05: 2.9e-6; x16 for the feedback of those differences through
# later gradients and for other CPUs (as tolerances.FP32_TOL): 4.6e-5. bf16: 1.9e-2, plus
# one bf16 ulp of the compared parameter (BF16_ULP): 2.3e-2. A gradient not reduced, reduced
# twice or taken from a shard moves the update by >= lr |g| ~ 1e-2 relative on the largest
# elements at fp32 (200x above); the bf16 bound only catches such gross errors.
# Losses are computed by the same reductions and chains from parameters that differ by the
# bound above: the forward's own reordering is <= 16 (K u32 + D u) relative, and a parameter
# difference d moves an O(1) loss by at most d sum|dL/dtheta|, with sum|dL/dtheta| <= 1/lr x
# the loss drop of one SGD step (<= 1 here, losses ~5.5 falling ~0.1 per step): <= d / lr.
K, D, STEPS, LR = 256, 64, cases.STEPS, cases.LR


def _grad_err(u):
    return (K * U32 + D * u) * LM_GRAD_BOUND


PARAM_TOL = {"fp32": 16 * STEPS * LR * _grad_err(U32), "bf16": STEPS * LR * _grad_err(U16) + BF16_ULP}
LOSS_TOL = {"fp32": 16 * _grad_err(U32) + PARAM_TOL["fp32"] / LR, "bf16": _grad_err(U16) + PARAM_TOL["bf16"] / LR}

N = 2
# Which compiled ways each row runs, and why no more: stages 0-2 share one backward (the
# reducer's post-accumulate-grad hooks, schedule/reducer.py), stage 1 differing from stage 0
# only in the collective launched by the same hook, so stage 1 has no row; stage 2 reduces
# inside backward. Every way ("whole", the blocks before or after wrapping, "units") runs
# once on the bundled GPT at stage 3, where the hooks gather and free; the other rows run
# the ways their variable (a Hugging Face model, bf16, a checkpointing mode) can change.
# Hugging Face's GPT-2 (a compile of it costs several of the bundled GPT's) runs the way
# users are pointed to, "units", at stage 3 where the hooks act, in bf16 with reentrant
# checkpointing: the grid's bf16 row (each variable's fp32 row is the bundled GPT's); a Hugging
# Face Llama of 10 layers runs it in fp32 below (one graph for every layer).
GRID = [
    # (model, precision, stage, activation checkpointing, the compiled ways)
    ("gpt", "fp32", 0, "", ("whole", "units")),
    ("gpt", "fp32", 2, "", ("blocks_after", "units")),
    ("gpt", "fp32", 3, "", cases.MODES),
    ("gpt", "fp32", 3, "non_reentrant", ("whole", "units")),
    ("gpt", "fp32", 3, "reentrant", ("blocks_after", "units")),
    ("gpt2", "bf16", 3, "reentrant", ("units",)),
]


def _id(case) -> str:
    return "-".join(str(v) for v in case[:4] if v != "")


@pytest.mark.parametrize("name,precision,stage,checkpointing,modes", GRID, ids=map(_id, GRID))
def test_compiled_trains_as_eager(pool, name, precision, stage, checkpointing, modes):
    for rank, r in enumerate(pool.run(N, cases.parity_case, name, precision, stage, checkpointing, modes,
                                      timeout_s=600)):
        for mode in modes:
            m = r[mode]
            assert m["params"] <= PARAM_TOL[precision], (rank, mode, m)
            assert m["loss"] <= LOSS_TOL[precision], (rank, mode, m)
            # Something was compiled, and every parameter a graph took had its full shape.
            assert m["graphs"][-1] >= 1 and m["param_shapes_ok"], (rank, mode, m)
            # Nothing compiled after the first step (no recompilation).
            assert m["graphs"][1:] == m["graphs"][:1] * (STEPS - 1), (rank, mode, m)
            # At most one graph per unit per direction (dynamo's graph is compiled with its
            # backward by AOTAutograd) plus the root's, and one more per graph break (a break
            # splits a frame's graph in two): blocks of one class share their graph.
            # Reentrant checkpointing runs each block's forward under no_grad, then again in
            # backward with gradients: a graph for each.
            per_unit = 2 if checkpointing == "reentrant" else 1
            bound = per_unit * max(m["units"], 1) + 1 + sum(m["breaks"].values())
            assert m["graphs"][-1] <= bound, (rank, mode, m)
            # zerodp breaks graphs only at its own hooks, run eagerly; other breaks are the
            # model's own (Hugging Face's logger calls).
            ours = [k for k in m["breaks"] if "zerodp" in k]
            assert all("zerodp hook" in k for k in ours), (rank, mode, m["breaks"])


@pytest.mark.parametrize("variant", sorted(cases.COMPOSE))
def test_compile_units_composes(pool, variant):
    for rank, r in enumerate(pool.run(N, cases.compose_case, variant, timeout_s=600)):
        assert r["params"] <= PARAM_TOL["fp32"] and r["loss"] <= LOSS_TOL["fp32"], (rank, r)
        assert r["graphs"][-1] >= 1 and r["param_shapes_ok"] and r["param_inputs"] > 0, (rank, r)
        assert r["graphs"][1:] == r["graphs"][:1] * (STEPS - 1), (rank, r)


@pytest.mark.parametrize("name,stage", [("gpt_patched", 0), ("gpt_patched", 3), ("llama_deep", 3)])
def test_compile_units_on_what_users_bring(pool, name, stage):
    """A forward set on the instance (accelerate's hooks, a user's patch: here each halves an
    output) is the one compiled; a 10-layer Hugging Face decoder with `use_cache` at its
    default compiles one graph for all its layers ([Note: no KV cache in compiled units] in
    schedule/compile.py): with a cache each layer made its own, and past dynamo's recompile
    limit (8) the later layers ran eagerly."""
    for rank, r in enumerate(pool.run(N, cases.parity_case, name, "fp32", stage, "", ("units",), timeout_s=600)):
        m = r["units"]
        assert m["params"] <= PARAM_TOL["fp32"] and m["loss"] <= LOSS_TOL["fp32"], (rank, m)
        assert m["graphs"][1:] == m["graphs"][:1] * (STEPS - 1), (rank, m)
        if name == "llama_deep":
            # One block class: one graph for the blocks, one for the root, one per break.
            assert m["blocks"] == 10 and m["graphs"][-1] <= 2 + sum(m["breaks"].values()), (rank, m)
