"""GSPO: sequence-level ratios with tight clipping, and its token variant.

    s_i = exp( (1/|y_i|) Σ_t (ℓθ − ℓold) );  loss_i = −min(s_i·A_i, clip(s_i, 1−ε_l, 1+ε_h)·A_i)
sequence-mean. GSPO-token: s_it = sg(s_i)·exp(ℓθ_t − sg(ℓθ_t)), per-token clipped surrogate,
sequence-mean of token-means (same value as GSPO, per-token advantages allowed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_p3o.loss.terms import (
    LossInputs,
    StepStats,
    clip_fraction,
    clipped_surrogate,
    masked_log_ratio,
    seq_lengths,
    seq_mean_of_token_terms,
)


@dataclass(frozen=True)
class GSPOConfig:
    """Attributes:
    eps_low: lower clip of the sequence ratio (paper: 3e-4).
    eps_high: upper clip of the sequence ratio (paper: 4e-4).
    token_level: GSPO-token (per-token advantages) instead of GSPO.
    """

    eps_low: float = 3e-4
    eps_high: float = 4e-4
    token_level: bool = False


def gspo_terms(inp: LossInputs, stats: StepStats, h: GSPOConfig):
    m = inp.mask
    old = inp.old_logprobs if inp.old_logprobs is not None else inp.behavior_logprobs
    d = masked_log_ratio(inp.logprobs, old.detach(), m)
    has = (m.sum(-1) > 0).float()
    log_s = d.sum(-1) / seq_lengths(m)  # [B]
    s = torch.exp(log_s)
    if h.token_level:
        s_tok = s.detach()[:, None] * torch.exp(inp.logprobs - inp.logprobs.detach())
        per_tok = clipped_surrogate(s_tok, inp.advantages.detach(), h.eps_low, h.eps_high)
        n_clip = clip_fraction(s_tok.detach(), inp.advantages.detach(), h.eps_low, h.eps_high, m)
        return seq_mean_of_token_terms(per_tok, m), {"clip_frac": (n_clip, m.sum())}
    adv = (inp.advantages.detach() * m).sum(-1) / seq_lengths(m)
    per_seq = clipped_surrogate(s, adv, h.eps_low, h.eps_high) * has
    n_clip = clip_fraction(s.detach(), adv, h.eps_low, h.eps_high, has)
    return per_seq.sum(), {"seq_clip_frac": (n_clip, has.sum())}
