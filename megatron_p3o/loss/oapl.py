"""OAPL (seed 004): regress β2·log(πθ/πb) of each sequence onto its optimal advantage.

    V*_p = β1 · ln( (1/G) Σ_i exp(r_i/β1) ),  A*_i = r_i − V*_p      (no gradient)
    loss = mean_i ( β2 · Σ_t (ℓθ_it − ℓb_it) − A*_i )²             (sequence-mean)
No ratio, no clip; the rollout policy is refreshed every L optimizer steps (trainer knob).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_p3o.loss.terms import LossInputs, StepStats, masked_log_ratio


@dataclass(frozen=True)
class OAPLConfig:
    """Attributes:
    beta1: temperature of the soft value V* (1.0).
    beta2: scale of the sequence log-ratio (1e-3).
    """

    beta1: float = 1.0
    beta2: float = 1e-3


def oapl_advantages(rewards: Tensor, group_ids: Tensor, beta1: float = 1.0) -> Tensor:
    """A*_i = r_i − β1·ln(mean_{j∈group(i)} exp(r_j/β1)), ``[B]`` float64."""
    r = rewards.double()
    out = torch.empty_like(r)
    for g in group_ids.unique():
        sel = group_ids == g
        v = beta1 * (torch.logsumexp(r[sel] / beta1, 0) - math.log(int(sel.sum())))
        out[sel] = r[sel] - v
    return out


def oapl_terms(inp: LossInputs, stats: StepStats, h: OAPLConfig):
    """Uses ``rewards``+``group_ids`` when given, else per-sequence A* in ``advantages``."""
    m = inp.mask
    has = (m.sum(-1) > 0).to(inp.logprobs.dtype)
    if inp.rewards is not None:
        a_star = oapl_advantages(inp.rewards, inp.group_ids, h.beta1).to(inp.logprobs.dtype)
    else:
        a_star = (inp.advantages * m).sum(-1) / m.sum(-1).clamp_min(1)
    seq_lr = masked_log_ratio(inp.logprobs, inp.behavior_logprobs, m).sum(-1)
    resid = h.beta2 * seq_lr - a_star.detach()
    return (resid * resid * has).sum(), {
        "oapl_abs_residual": ((resid.abs() * has).sum().detach(), has.sum())
    }
