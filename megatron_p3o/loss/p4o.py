"""P4O (FeynRL): P3O with two anchors, the behaviour policy and the proximal policy.

e = min(e_b, e_prox)     (both global ESS of the step: πθ/πb and πθ/πprox)
loss_t = −sg(min(ρ_t, e)) · A_t · ℓθ_t + (1 − e) · k3(ℓθ_t, ℓmix_t)
ℓmix = logsumexp(ln(w_b+δ) + ℓb, ln(w_p+δ) + ℓprox) − ln(w_b + w_p + 2δ),
w_b = 1 − e_b, w_p = 1 − e_prox; the trust-region term is skipped when 1 − e < 1e-6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_p3o.loss.terms import (
    LossInputs,
    StepStats,
    capped_weight_share,
    k3,
    masked_log_ratio,
)


@dataclass(frozen=True)
class P4OConfig:
    """Attributes:
    delta: δ, smoothing of the mixture weights.
    k3_clamp: clamp inside exp() of k3.
    """

    delta: float = 1e-6
    k3_clamp: float = 10.0


def p4o_terms(inp: LossInputs, stats: StepStats, h: P4OConfig):
    m = inp.mask
    # floats (scope "step": known before the pass) or device scalars (scope "microbatch": the
    # branch below is then a multiplication by 0 or 1, not a host read)
    dev = torch.is_tensor(stats.ess) or torch.is_tensor(stats.ess_prox)
    if dev:
        e_b, e_p = (
            torch.as_tensor(x, dtype=torch.float64, device=m.device)
            for x in (stats.ess, stats.ess_prox)
        )
        e, log = torch.minimum(e_b, e_p), torch.log
    else:
        e_b, e_p = float(stats.ess), float(stats.ess_prox)
        e, log = min(e_b, e_p), math.log
    rho = torch.exp(masked_log_ratio(inp.logprobs, inp.behavior_logprobs, m)).detach()
    per_tok = -torch.clamp(rho, max=e) * inp.advantages.detach() * inp.logprobs
    if dev or 1.0 - e >= 1e-6:
        wb, wp = 1.0 - e_b, 1.0 - e_p
        dt = torch.promote_types(inp.logprobs.dtype, torch.float32)
        lb = inp.behavior_logprobs.to(dt) + log(wb + h.delta)
        lp = inp.old_logprobs.to(dt) + log(wp + h.delta)
        mix = torch.logaddexp(lb, lp) - log(wb + wp + 2 * h.delta)
        w = (1.0 - e) * (1.0 - e >= 1e-6) if dev else 1.0 - e
        per_tok = per_tok + w * k3(inp.logprobs, mix, m, h.k3_clamp)
    metrics = {
        "frac_rho_above_ess": (((rho > e).float() * m).sum(), m.sum()),
        "capped_weight_share": capped_weight_share(rho, e, inp.advantages, m),
    }
    return (per_tok * m).sum(), metrics
