"""P3O (seed 000, Eq. 11–12): ESS-capped policy gradient with an ESS-scaled k3 trust region.

    loss_t = −sg(min(ρ_t, e_B)) · sg(A_t) · ℓθ_t + (1 − e_B) · c_t · k3(ℓθ_t, ℓb_t)
             [+ η · k3(ℓθ_t, ℓref_t) − β_H · H_t]
ρ = exp(ℓθ − ℓb) against the rollout engine's log-probs; e_B is the step's global ESS (frozen).
Token-mean over the step. No clip range, no trust-region knob.

``kl_weight`` chooses c_t (no new number, a choice of estimator):
  * ``one`` (the paper): c_t = 1. On tokens sampled from πb, E_πb[k3] = E_πb[1/ρ − 1 + log ρ]
    = χ²(πb‖πθ) − KL(πb‖πθ), not KL(πθ‖πb); its gradient coefficient in ℓθ is 1 − 1/ρ_t,
    unbounded below as ρ_t → 0.
  * ``capped``: c_t = sg(min(ρ_t, e_B)), the score term's own weight. E_πb[ρ·k3] = KL(πθ‖πb)
    exactly (importance weighting of a πθ-sample estimator); with the cap the gradient
    coefficient min(ρ_t, e_B)·(1 − 1/ρ_t) lies in (−1, e_B). On-policy (ρ ≡ 1, e_B = 1) the term
    vanishes in both forms, so ``capped`` equals P3O there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_p3o.loss.terms import (
    LossInputs,
    StepStats,
    capped_weight_share,
    k3,
    masked_log_ratio,
)


@dataclass(frozen=True)
class P3OConfig:
    """P3O hyper-parameters (all optional extras; the paper's objective has none).

    Attributes:
        ref_kl_coef: η, weight of k3 to the frozen reference model (0 = off).
        entropy_coef: β_H, entropy bonus (0 = off).
        k3_clamp: clamp of ℓb − ℓθ inside exp() in k3 (FeynRL uses 10).
        kl_scale: ablation (stress studies only): multiplies the (1 − e_B)·k3 term; 0 removes it.
        kl_anchor: ablation: k3 toward πb ("behavior", the paper) or toward a recomputed πold.
        kl_weight: "one" (the paper) or "capped": weight each token's k3 by sg(min(ρ_t, e_B))
            (module docstring: what each form estimates).
    """

    ref_kl_coef: float = 0.0
    entropy_coef: float = 0.0
    k3_clamp: float = 10.0
    kl_scale: float = 1.0
    kl_anchor: Literal["behavior", "old"] = "behavior"
    kl_weight: Literal["one", "capped"] = "one"


def p3o_terms(inp: LossInputs, stats: StepStats, h: P3OConfig):
    """Σ_t loss_t over valid tokens ``[B, T]`` → scalar, plus metric (numerator, count) pairs."""
    # a float (scope "step": known before the pass) or a device scalar (scope "microbatch")
    e = stats.ess if torch.is_tensor(stats.ess) else float(stats.ess)
    m = inp.mask
    rho = torch.exp(masked_log_ratio(inp.logprobs, inp.behavior_logprobs, m)).detach()
    w = torch.clamp(rho, max=e)
    anchor = inp.old_logprobs if h.kl_anchor == "old" else inp.behavior_logprobs
    kl_b = k3(inp.logprobs, anchor, m, h.k3_clamp)
    if h.kl_weight == "capped":  # E_πb[ρ·k3] = KL(πθ‖πb); coefficient in (−1, e_B)
        kl_b = w * kl_b
    per_tok = -w * inp.advantages.detach() * inp.logprobs + h.kl_scale * (1.0 - e) * kl_b
    n = m.sum()
    metrics = {
        "frac_rho_above_ess": (((rho > e).float() * m).sum(), n),
        "capped_weight_share": capped_weight_share(rho, e, inp.advantages, m),
    }
    if h.ref_kl_coef:
        kl_ref = k3(inp.logprobs, inp.ref_logprobs, m, h.k3_clamp)
        per_tok = per_tok + h.ref_kl_coef * kl_ref
        metrics["kl_ref"] = ((kl_ref * m).sum().detach(), n)
    if h.entropy_coef:
        per_tok = per_tok - h.entropy_coef * inp.entropy
    return (per_tok * m).sum(), metrics
