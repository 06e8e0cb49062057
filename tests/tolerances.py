"""The parity tolerances shared by the test modules, each derived beside its value.

A bound here is derived from the model, optimizer, learning rate and steps of the grid that
uses it, never measured: BLAS kernels move the rounding 4-8x between CPUs, so a measured
number is only quoted as a sanity note. Module-specific bounds stay in their test module
when nothing else uses them.
"""
from checkpoint_cases import TRAIN

# -- The stage 0-2 grid (core_cases: Net, STEPS = 5, SGD lr 0.05 momentum 0.9, AdamW lr <= 1e-2),
# also the base of test_stage3, test_trust, test_hybrid, test_zeropp, test_hf_models.
# Errors are |a-b| / (1 + |b|) per element (core_cases.max_rel_diff). Every bound below is
# derived from the grid's model, optimizer, lr and steps (core_cases: Net, STEPS = 5, SGD lr
# 0.05 momentum 0.9, AdamW lr <= 1e-2), not measured: BLAS kernels move the rounding 4-8x
# between CPUs, so a measured number is only quoted as a sanity note.
U32 = 2.0**-24  # fp32 unit roundoff
U16 = 2.0**-9  # bf16 unit roundoff (8 significant bits)
BF16_ULP = 2.0**-8  # one bf16 ulp of |b| < 1, relative to 1 + |b| (the metric): never more
N_MAX = 4  # the largest world of these grids
SGD_LR, MOMENTUM, ADAMW_LR, STEPS = 0.05, 0.9, 1e-2, 5
# Per-element bound on the mean of the N ranks' |gradient| terms on Net; measured 0.38 (N=2)
# and 0.34 (N=4) at init over the 5 steps' batches, so 1.0 leaves a 2.6x margin.
GRAD_BOUND = 1.0


def adamw_tol(lr, steps):
    # AdamW divides by sqrt(v): an element whose gradient is near zero (or whose rank terms
    # cancel) may take a step of up to ~lr of either sign under any rounding difference, so
    # the two runs can be 2 lr apart per step. This bounds AdamW parity whatever the CPU; the
    # scale-sensitive check is the SGD case of the same grid. It still catches a swapped or
    # misplaced shard, an unrestored parameter, non-finite values (all O(0.3-1) apart).
    return 2 * lr * steps


# fp32 SGD (the strict check): the only difference from DDP is the order in which gloo sums
# the N gradients (bucket boundaries differ): per step each gradient element moves by at most
# N u sum|terms| <= N_MAX U32 GRAD_BOUND = 2.4e-7, an SGD update by lr times that, momentum
# by at most 1/(1 - 0.9) more, over 5 steps: 6.0e-7. x16 for the feedback of those
# differences through later gradients and for other CPUs: 9.5e-6. Measured: within the old
# 1e-6 on this machine. Still catches a wrong gradient scale (2x, 1/N: the update moves by
# >= lr |g| ~ 1e-2 on the largest element, 1000x above) or a lost micro-batch (~1e-3).
FP32_TOL = 16 * STEPS * SGD_LR / (1 - MOMENTUM) * N_MAX * U32 * GRAD_BOUND
ADAMW_FP32_TOL = adamw_tol(ADAMW_LR, STEPS)  # 0.1; measured within the old 1e-6 here
# bf16 SGD: summing N bf16 gradients in another order moves each by <= N U16 sum|terms|
# (3.9e-3 x GRAD_BOUND at N=4), the master by lr / (1 - momentum) times that per step, 5 steps:
# 2.0e-2; the compared bf16 parameter then rounds, one ulp (BF16_ULP = 3.9e-3) more: 2.3e-2.
# Measured worst (N=4; N=2 sums are order-free and bitwise equal): 1.6e-3 on this grid's
# parameters, 2.3e-3 on the stage-3 GPT, 2.8e-3 on eval outputs: 8x below. A wrong gradient
# scale (2x, 1/N at N=4) moves the SGD updates by >= lr / (1 - momentum) |g| ~ 0.1 over the
# 5 steps on the largest elements, 4x above; test_trust.BF16_SGD_TOL is the tighter check.
BF16_TOL = STEPS * SGD_LR / (1 - MOMENTUM) * N_MAX * U16 * GRAD_BOUND + BF16_ULP
# bf16 AdamW: the AdamW bound plus the final one-ulp rounding of the bf16 parameter: 0.104.
ADAMW_BF16_TOL = adamw_tol(ADAMW_LR, STEPS) + BF16_ULP
TOL = {("fp32", "sgd"): FP32_TOL, ("fp32", "adamw"): ADAMW_FP32_TOL,
       ("bf16", "sgd"): BF16_TOL, ("bf16", "adamw"): ADAMW_BF16_TOL}


# -- Checkpoint continuations (checkpoint_cases: TRAIN steps after a resume), also test_state_dict's.
# Continuation bounds, derived (the units and adamw_tol above). Each is absolute,
# per element (checkpoint_cases.max_abs), over the TRAIN = 3 steps after the resume.
#
# AdamW (adamw_groups: lr 1e-3, 3e-3 on the 1-D group): a resharded run sums the gradients in
# another order, and Adam divides by sqrt(v), so an element whose gradient is near zero may
# move by ~lr per step under any rounding difference: 2 lr steps = 0.018 for the largest lr.
# Weak by design; it still catches a swapped or misplaced shard, an unrestored parameter or
# non-finite values (all O(0.1-1) apart). A lost optimizer state (restored as zeros) or a step
# count off by one is caught exactly instead, by roundtrip_equal / roundtrip_meta_equal.
CKPT_ADAMW_LR_MAX = 3e-3
CKPT_ADAMW_TOL = adamw_tol(CKPT_ADAMW_LR_MAX, TRAIN)
# SGD with momentum (checkpoint_cases.sgd_continuation, from the loaded weights on both the
# saver's and the loader's side: lr 0.01, momentum 0.9, TRAIN = 3 steps), the strict check.
# The global batch is 4 x 16 = K = 64 tokens at every world size; a reshard regroups the sum
# of their 64 gradient contributions (within the matmuls, then across <= 4 ranks), so each
# gradient element moves by at most K u sum|terms| with u = U32 = 2^-24. sum|terms|
# (the per-token |contributions| summed, element by element) measured <= 0.20 on this LM over
# the continuation's batches, so LM_GRAD_BOUND = 1.0 leaves 5x: 3.8e-6 per step. An update moves
# by lr times that, momentum by at most 1/(1 - 0.9) more, over 3 steps: 1.1e-6; x16 for the
# feedback of those differences through later gradients, the forward's rounding at another
# batch size, and other CPUs (as FP32_TOL): 1.8e-5. Catches a wrong gradient scale (2x, 1/N:
# the first update alone moves by lr |g| ~ 1.2e-3 on the largest element, 65x above).
LM_TOKENS, LM_GRAD_BOUND, LM_SGD_LR = 64, 1.0, 0.01
CKPT_SGD_TOL = 16 * TRAIN * LM_SGD_LR / (1 - MOMENTUM) * LM_TOKENS * U32 * LM_GRAD_BOUND


# -- Gradients of the first step (parity.StepTrace, where a run exposes them: stage 0). Both
# runs start from the same weights and see the same batches, so each rank's local gradient is
# the same computation, bit for bit; only the order in which the N gradients are summed differs
# (bucket boundaries): per element N u sum|terms| <= N_MAX U32 GRAD_BOUND (fp32), and under
# bf16 the same with U16 plus one bf16 ulp of the compared value. Later steps' gradients also
# carry the parameters' differences (bounded step by step by TOL), so they are not compared.
FIRST_GRAD_TOL = {"fp32": N_MAX * U32 * GRAD_BOUND, "bf16": N_MAX * U16 * GRAD_BOUND + BF16_ULP}
