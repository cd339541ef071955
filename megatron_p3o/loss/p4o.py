"""P4O (FeynRL): P3O with two anchors, the behaviour policy and the proximal policy.

e = min(e_b, e_prox)     (both global ESS of the step: πθ/πb and πθ/πprox)
loss_t = −sg(min(ρ_t, e)) · A_t · ℓθ_t + (1 − e) · k3(ℓθ_t, ℓmix_t)
ℓmix = logsumexp(ln(w_b + ε) + ℓb, ln(w_p + ε) + ℓprox) − ln(w_b + w_p),
w_b = max(0, 1 − e_b), w_p = max(0, 1 − e_prox), ε = 1e-30 (only so that ln 0 is finite: a
weight of 0 drops its anchor); the trust-region term is taken only when 1 − e > 1e-6.

The mixture is FeynRL's own at its newest commit (``algs/P4O/p4o.py``,
``P4O.compute_policy_loss``): the weights clamped at 0 (an all-reduced ESS a rounding above 1)
and ε inside the logs only; tests/unit/test_peer_p4o.py compares against numbers that function
computed (tools/record_peer_p4o.py).
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

EPS = 1e-30  # inside the mixture's logs only (FeynRL's eps_log)
GATE = 1e-6  # the trust-region term is taken where 1 − e exceeds it (FeynRL's eps_gate)


@dataclass(frozen=True)
class P4OConfig:
    """Attributes:
    k3_clamp: clamp inside exp() of k3.
    """

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
    if dev or 1.0 - e > GATE:
        if dev:
            wb, wp = (1.0 - e_b).clamp_min(0.0), (1.0 - e_p).clamp_min(0.0)
            total = (wb + wp).clamp_min(EPS)  # the gate below zeroes the term where it is 0
        else:
            wb, wp = max(0.0, 1.0 - e_b), max(0.0, 1.0 - e_p)
            total = wb + wp
        dt = torch.promote_types(inp.logprobs.dtype, torch.float32)
        lb = inp.behavior_logprobs.to(dt) + log(wb + EPS)
        lp = inp.old_logprobs.to(dt) + log(wp + EPS)
        mix = torch.logaddexp(lb, lp) - log(total)
        w = (1.0 - e) * (1.0 - e > GATE) if dev else 1.0 - e
        per_tok = per_tok + w * k3(inp.logprobs, mix, m, h.k3_clamp)
    metrics = {
        "frac_rho_above_ess": (((rho > e).float() * m).sum(), m.sum()),
        "capped_weight_share": capped_weight_share(rho, e, inp.advantages, m),
    }
    return (per_tok * m).sum(), metrics
