"""What tensor-parallel tests share: a reference parameter's slice on a tensor-parallel rank,
the elementwise difference to it, the rounding bounds they are held to, and an error's
message. Kept apart from tp_cases.py, whose transformers import costs seconds a world that
does not use it would pay.

[Note: rounding bounds of the tensor-parallel tests]
A tensor-parallel run computes the very expressions one process computes, with its sums in
another order: a row-parallel layer adds N_m partial sums through an all-reduce, a replicated
parameter's gradient arrives in per-rank pieces, and each BLAS kernel blocks its sums by the
shapes it is given (which is also why results move between CPUs: AVX2 or AVX-512 kernels
block differently). Nothing here is measured; every bound follows from these steps:

1. Reordering a sum of n fp32 terms moves it by at most 2 γ_n Σ|t_i|, γ_n = n u / (1 - n u),
   u = 2^-24, whatever the two orders (Higham, Accuracy and Stability of Numerical
   Algorithms, 2nd ed., §4.2): a bound for every kernel of every CPU.
2. A gradient element is the end of a chain of such sums; to first order the relative errors
   along a chain add, so it moves by at most 2 u Σn, Σn the widths of the chain's sums. The
   models of these tests are tiny: a block's sums are the norm (32 wide), q/k/v (32), the
   scores over a head (8), softmax and attention over the sequence (17), the output
   projection (32), the MLP (32 and 128 at most); two blocks, the head (32) and the
   cross-entropy over the vocabulary (64) give Σn < 1000 forward; backward, the same again
   plus the sum over the global batch's tokens (<= 68) for each weight gradient. CHAIN =
   2000 covers every model here: CHAIN_ROUNDING = 2 u CHAIN = 2.4e-4 of the magnitudes in play.
3. Clipping multiplies every element by max_norm / ||g||, and ||g||^2 sums all P elements.
   Its terms are positive, so the error is relative to the result; at P ~ 3e4 the worst case
   P u = 2e-3 is far from what any order reaches, and the probabilistic bound is used:
   λ sqrt(P) u, exceeded with probability below 2 exp(-λ^2 / 2) (Higham and Mary, SIAM J.
   Sci. Comput. 41(5), 2019, Thm 2.4); λ = 8 puts that below 3e-14. `rounding(P)`.
4. The magnitudes in play are taken at the gradient's scale: for an element, each step's
   largest gradient element in the one-process reference (clipped where the test clips), so
   a gradient element of step k differs between the runs by at most δ_k = rounding(P) x
   max|g_k|; for a norm of the gradient, the norm itself (it moves by at most rounding(P) of
   its value).
5. SGD (lr, momentum μ) turns gradient differences into weight differences linearly: after S
   steps at most lr Σ_k Σ_{j<=k} μ^{k-j} δ_j (`sgd_bound`). The weights' own differences
   feed later gradients, also to first order in the rounding; the margin of step 2 (every
   sum counted at its full width, every chain at the longest) is left for them.
6. AdamW divides each element's step by its gradient's running RMS: its step is
   lr m̂ / (sqrt(v̂) + eps) plus the decay, and |m̂| / sqrt(v̂) <= r (r = sqrt(Σ w_i^2 / v_i)
   over the weights of the bias-corrected averages: 1.0036 for 3 steps of betas (0.9,
   0.999)), so any two runs step an element at most 2 r lr apart per step, whatever the
   rounding: an element whose gradient is near zero (or zero in exact arithmetic and
   rounding noise in fp32) can move that far. Where every gradient of an element's history
   is well above the noise δ, each is off by at most ρ = δ / (min|g| - δ) of itself; m̂
   then moves by at most ρ Σ w_i |g_i| <= r ρ sqrt(v̂) and sqrt(v̂) by at most ρ sqrt(v̂),
   so the step by at most 2 r ρ lr. `adamw_bound` takes the smaller of the two per element:
   AdamW is checked strictly only where its gradients are not small; the strict check of
   every element is SGD's.
"""
from __future__ import annotations

import math

import torch

U = 2.0 ** -24
CHAIN = 2000
CHAIN_ROUNDING = 2 * U * CHAIN  # step 2 of the note: 2.4e-4 of the magnitudes in play
LAMBDA = 8.0  # step 3


def rounding(clipped_numel: int = 0) -> float:
    """Steps 2-3: how far apart the two runs' gradient elements can be, relative to the
    largest one; `clipped_numel`: the elements clipping's norm sums (0: not clipped)."""
    return CHAIN_ROUNDING + LAMBDA * math.sqrt(clipped_numel) * U


def expected_slice(name: str, full: torch.Tensor, local: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """The reference parameter's part that tensor-parallel rank `tp_rank` holds: whole where
    the shapes agree (replicated), else its slice of the dim that was split (GPT's fused
    q, k, v split each of the three)."""
    if full.shape == local.shape:
        return full
    dim = next(d for d in range(full.dim()) if full.shape[d] != local.shape[d])
    parts = 3 if "c_attn" in name else 1
    packed = full.unflatten(dim, (parts, full.shape[dim] // parts))
    return packed.chunk(tp, dim=dim + 1)[tp_rank].flatten(dim, dim + 1)


def diffs_to_reference(result: dict, ref: dict, tp_rank: int, tp: int) -> dict:
    """Per parameter, elementwise |local - reference slice| / (1 + |reference|)."""
    out = {}
    for name, local in result["params"].items():
        want = expected_slice(name, ref["params"][name], local, tp_rank, tp)
        out[name] = (local.float() - want).abs() / (1 + want.abs())
    return out


def max_diff_to_reference(result: dict, ref: dict, tp_rank: int, tp: int) -> float:
    """Worst elementwise |local - reference slice| / (1 + |reference|) over the parameters."""
    return max(float(d.max()) for d in diffs_to_reference(result, ref, tp_rank, tp).values())


def sgd_bound(lr: float, momentum: float, grad_max: list, clipped_numel: int = 0) -> float:
    """Step 5 of [Note: rounding bounds of the tensor-parallel tests]: the most SGD can move a
    weight apart from the reference, given each step's largest gradient element there."""
    velocity = total = 0.0
    for g in grad_max:
        velocity = momentum * velocity + rounding(clipped_numel) * g
        total += velocity
    return lr * total


def adam_ratio(steps: int, betas=(0.9, 0.999)) -> float:
    """r of step 6: the largest |m̂| / sqrt(v̂) over histories of up to `steps` gradients."""
    b1, b2 = betas
    worst = 0.0
    for t in range(1, steps + 1):
        w = [(1 - b1) * b1 ** (t - i) / (1 - b1 ** t) for i in range(1, t + 1)]
        v = [(1 - b2) * b2 ** (t - i) / (1 - b2 ** t) for i in range(1, t + 1)]
        worst = max(worst, math.sqrt(sum(a * a / b for a, b in zip(w, v))))
    return worst


def adamw_bound(lr: float, grads: list, grad_max: list, clipped_numel: int = 0, betas=(0.9, 0.999)) -> torch.Tensor:
    """Step 6: per element, the most AdamW can move it apart from the reference in
    len(grads) steps; `grads` are the reference's gradients of the element's tensor per step,
    `grad_max` the largest gradient element of the whole model per step."""
    steps = len(grads)
    r = adam_ratio(steps, betas)
    noise = rounding(clipped_numel) * max(grad_max)
    smallest = torch.stack([g.abs() for g in grads]).min(dim=0).values
    rho = noise / (smallest - noise).clamp_min(1e-30)
    return steps * 2 * r * lr * torch.where(smallest > 2 * noise, rho.clamp(max=1.0), torch.ones_like(rho))


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        return f"{type(e).__name__}: {e}"
    return "no error"
