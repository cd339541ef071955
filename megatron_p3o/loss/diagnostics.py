"""Train–rollout mismatch diagnostics reported for every objective (per the formulas doc).

Ratio ρ = πθ/πb: mean, std, max and p50/p90/p99; mean k3(πθ‖πb); KL(πb‖πθ) estimated on the
engine's samples; mean and p99 (``abs_log_ratio_p99``) of |ℓθ − ℓb|; entropy; with a reference
model, ``kl_ref_k3``: the mean k3 of πθ to πref on the same samples (the "KL to the reference"
of verl and NeMo-RL, whatever the objective's own use of ℓref). Under reuse (``batch.epochs`` >
1), ``kl_prev_epoch``: KL from the policy one epoch earlier to πθ on the same tokens
(:func:`kl_prev_epoch_terms`).
"""

from __future__ import annotations

import torch

from megatron_p3o.loss.terms import LossInputs, k3, masked_log_ratio
from megatron_p3o.observability.metrics import StepMetrics


def add_mismatch_metrics(acc: StepMetrics, inp: LossInputs, entropy: bool = True) -> None:
    """Accumulates the mismatch metrics of ``inp`` as device tensors (no host read: this runs
    in every micro-batch); ``entropy=False`` when the entropy was already accumulated elsewhere
    (the trainer's ESS pre-pass)."""
    m = inp.mask.detach()
    n = m.sum()
    d = masked_log_ratio(inp.logprobs.detach().double(), inp.behavior_logprobs.detach().double(), m)
    rho = torch.exp(d) * m
    acc.add("ratio_mean", rho.sum(), n)
    acc.add("ratio_sq_mean", (rho * rho).sum(), n)
    # ρ ≥ 0 and 0 off the mask: the max over every position is the valid tokens' max (0 if none)
    acc.add_max("ratio_max", rho.max() if rho.numel() else 0.0)
    acc.add("k3_to_behavior", k3(inp.logprobs.detach(), inp.behavior_logprobs, m).sum(), n)
    # KL(πb‖πθ) from the engine's own samples: E_b[ρ − 1 − log ρ] (k3 with ρ = πθ/πb, ≥ 0)
    acc.add("kl_behavior_theta", ((rho - 1.0 - d) * m).sum(), n)
    acc.add("abs_logprob_diff", (d.abs() * m).sum(), n)
    acc.add_log_hist("ratio", d, mask=m)
    if inp.ref_logprobs is not None:
        acc.add("kl_ref_k3", k3(inp.logprobs.detach(), inp.ref_logprobs, m).sum(), n)
    if entropy and inp.entropy is not None:
        acc.add("entropy", (inp.entropy.detach() * m).sum(), n)


def kl_prev_epoch_terms(
    logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> tuple:
    """KL(πp‖πθ) between the policy one epoch earlier (πp, the ℓθ this micro-batch had in the
    previous epoch's step) and πθ, on the engine's samples y ~ πb: how far one epoch over the
    same rollout batch moved the policy on its tokens.

    KL(πp‖πθ) = E_p[r − 1 − log r] with r = πθ/πp (k3: ≥ 0 per token); on πb samples each
    token is importance-weighted by u = πp/πb and the sum self-normalised:
    ``Σ u·(r − 1 − log r)·m / Σ u·m`` (float64). Tokens where either ℓ is non-finite are left
    out.

    Shapes: ``logprobs``, ``prev_logprobs``, ``behavior_logprobs``, ``mask``: ``[B, T]``.
    Returns ``(numerator, denominator)`` device scalars, to sum over micro-batches and ranks.
    """
    lt, lp, lb = (x.detach().double() for x in (logprobs, prev_logprobs, behavior_logprobs))
    m = mask.detach().double() * (torch.isfinite(lt) & torch.isfinite(lp)).double()
    zero = torch.zeros((), dtype=torch.float64, device=lt.device)
    d = torch.where(m > 0, lt - lp, zero)  # log r
    u = torch.exp(torch.where(m > 0, lp - lb, zero)) * m
    return (u * (torch.exp(d) - 1.0 - d)).sum(), u.sum()


def finalize_mismatch(result: dict) -> dict:
    """Adds ``ratio_std`` and ``ratio_ess`` = mean(ρ)²/mean(ρ²) — the step's normalized ESS
    against πb, reported for every objective (P3O's e_B is the same number, used in its loss)."""
    if "ratio_mean" in result and "ratio_sq_mean" in result:
        var = max(result["ratio_sq_mean"] - result["ratio_mean"] ** 2, 0.0)
        result["ratio_std"] = var**0.5
        if result["ratio_sq_mean"] > 0:
            result["ratio_ess"] = result["ratio_mean"] ** 2 / result["ratio_sq_mean"]
    return result
