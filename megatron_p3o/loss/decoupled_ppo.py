"""Decoupled PPO (AReaL): clip against a proximal policy, correct to the behaviour policy.

    u = exp(ℓθ − ℓprox),  w = sg(exp(ℓprox − ℓb))
    loss_t = w · max(−A·u, −A·clip(u, 1−ε, 1+ε_h));  tokens with w > c_w dropped (or w truncated)
Token-mean; dropped tokens stay in the step's token count (they contribute zero).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_p3o.loss.terms import LossInputs, StepStats, clip_fraction, masked_log_ratio


@dataclass(frozen=True)
class DecoupledPPOConfig:
    """Attributes:
    eps: lower clip ε of u.
    eps_high: upper clip (None = ε).
    behav_weight_cap: c_w, cap on w = πprox/πb (None = no cap).
    cap_mode: "drop" tokens above the cap, or "truncate" w to it.
    """

    eps: float = 0.2
    eps_high: Optional[float] = None
    behav_weight_cap: Optional[float] = 5.0
    cap_mode: str = "drop"

    def __post_init__(self):
        if self.cap_mode not in ("drop", "truncate"):
            raise ValueError(f"cap_mode={self.cap_mode!r}: use drop or truncate")


def decoupled_ppo_terms(inp: LossInputs, stats: StepStats, h: DecoupledPPOConfig):
    m = inp.mask
    prox = inp.old_logprobs.detach()
    u = torch.exp(masked_log_ratio(inp.logprobs, prox, m))
    w = torch.exp(masked_log_ratio(prox, inp.behavior_logprobs, m)).detach()
    eh = h.eps if h.eps_high is None else h.eps_high
    adv = inp.advantages.detach()
    per_tok = w * torch.maximum(-adv * u, -adv * torch.clamp(u, 1.0 - h.eps, 1.0 + eh))
    metrics = {"clip_frac": (clip_fraction(u.detach(), adv, h.eps, eh, m), m.sum())}
    if h.behav_weight_cap is not None:
        over = (w > h.behav_weight_cap).to(m.dtype)
        metrics["behav_capped_frac"] = ((over * m).sum(), m.sum())
        if h.cap_mode == "drop":
            per_tok = per_tok * (1 - over)
        else:
            per_tok = per_tok * torch.clamp(w, max=h.behav_weight_cap) / w.clamp_min(1e-30)
    return (per_tok * m).sum(), metrics
