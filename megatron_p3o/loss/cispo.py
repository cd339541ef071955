"""CISPO: clipped importance-sampling weights, never clipped gradients.

loss_t = −sg(clip(r, 1−ε_low, 1+ε_high)) · A_t · ℓθ_t,  r = exp(ℓθ − ℓold) with ℓold recomputed
(``loss.old_logprobs: recompute``, the default) or ℓb (``behaviour``, bypass); token-mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_p3o.loss.terms import LossInputs, StepStats, masked_log_ratio


@dataclass(frozen=True)
class CISPOConfig:
    """Attributes:
    eps_low: lower bound ε_low of the IS weight (None = no lower bound, the default).
    eps_high: upper bound ε_high (0.28).
    """

    eps_low: Optional[float] = None
    eps_high: float = 0.28


def cispo_terms(inp: LossInputs, stats: StepStats, h: CISPOConfig):
    m = inp.mask
    old = inp.old_logprobs if inp.old_logprobs is not None else inp.behavior_logprobs
    rho = torch.exp(masked_log_ratio(inp.logprobs, old, m)).detach()
    w = torch.clamp(rho, min=None if h.eps_low is None else 1.0 - h.eps_low, max=1.0 + h.eps_high)
    n_cap = ((rho > 1.0 + h.eps_high).float() * m).sum()
    return (-(w * inp.advantages.detach() * inp.logprobs) * m).sum(), {
        "is_capped_frac": (n_cap, m.sum())
    }
