"""The clipped-ratio family: PPO, GRPO, DAPO, and the TIS / MIS train–rollout corrections.

    r = exp(ℓθ − ℓold)          (ℓold = ℓb when no recompute is given: "bypass")
    loss_t = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)  [+ β · k3(ℓθ, ℓref)]
GRPO aggregates a sequence-mean of token-means; PPO and DAPO a token-mean.
TIS multiplies each token's loss by min(v, C), v = sg(exp(ℓold − ℓb)); MIS drops tokens (or
whole sequences, by product or geometric mean of v) with v ∉ [C_low, C_high].
IcePop (``mis_weighted``, token level) multiplies the kept tokens by v itself:
    loss_t = 1[C_low ≤ v_t ≤ C_high] · v_t · s_t       (NeMo-RL ``icepop``, AReaL, slime)
seq-mask-TIS (``mis_weighted``, ``seq_geomean``) keeps whole sequences by the geometric mean:
    loss_t = 1[C_low ≤ exp(mean_t log v_t) ≤ C_high] · v_t · s_t     (NeMo-RL ``seq-mask-tis``)
with s_t the clipped surrogate; docs/objectives.md has the sources and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_p3o.loss.terms import (
    LossInputs,
    StepStats,
    clip_fraction,
    clipped_surrogate,
    k3,
    masked_log_ratio,
    seq_mean_of_token_terms,
)


@dataclass(frozen=True)
class ClipConfig:
    """Clipped-surrogate hyper-parameters.

    Attributes:
        eps_low: lower clip ε (ratio ≥ 1 − ε_low).
        eps_high: upper clip ε (ratio ≤ 1 + ε_high); DAPO's "clip-higher" uses 0.28.
        kl_coef: β, weight of k3 to the reference model (GRPO commonly 0.04; 0 = off).
        aggregation: "token_mean" or "seq_mean_token_mean" (GRPO).
        tis_cap: C of truncated importance sampling (None = off).
        mis_low / mis_high: masked-importance-sampling band [C_low, C_high] (None = off).
        mis_level: "token", "seq_product" or "seq_geomean".
        mis_weighted: the tokens MIS keeps are weighted by v (IcePop, seq-mask-TIS), not by 1.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    kl_coef: float = 0.0
    aggregation: str = "token_mean"
    tis_cap: float | None = None
    mis_low: float | None = None
    mis_high: float | None = None
    mis_level: str = "token"
    mis_weighted: bool = False

    def __post_init__(self):
        if self.aggregation not in ("token_mean", "seq_mean_token_mean"):
            raise ValueError(
                f"aggregation={self.aggregation!r}: use token_mean or seq_mean_token_mean"
            )
        if self.mis_level not in ("token", "seq_product", "seq_geomean"):
            raise ValueError(f"mis_level={self.mis_level!r}: use token, seq_product or seq_geomean")
        if (self.mis_low is None) != (self.mis_high is None):
            raise ValueError("mis_low and mis_high must be set together")
        if self.mis_low is not None and not 0 <= self.mis_low <= self.mis_high:
            raise ValueError(f"MIS band [{self.mis_low}, {self.mis_high}]: need 0 <= low <= high")
        if self.mis_weighted and self.mis_low is None:
            raise ValueError("mis_weighted needs the band mis_low / mis_high")


def _mis_keep(log_v, mask, h: ClipConfig):
    """The band is tested on the ratio itself, ``lo ≤ exp(·) ≤ hi``, as NeMo-RL, AReaL and slime
    test it (not ``log lo ≤ · ≤ log hi``: where ``exp`` rounds onto a bound the two disagree).
    The geometric mean is NeMo-RL's: ``exp(Σ_t log v_t / (n + 1e-8))``."""
    if h.mis_level == "token":
        lv = log_v
    elif h.mis_level == "seq_product":
        lv = (log_v * mask).sum(-1, keepdim=True)
    else:  # NeMo-RL's masked_mean(log v, token_mask, dim=-1)
        n = mask.sum(-1).to(log_v.dtype)
        lv = ((log_v * mask).sum(-1) / (n + 1e-8)).unsqueeze(-1)
    v = torch.exp(lv)
    return ((v >= h.mis_low) & (v <= h.mis_high)).expand_as(log_v).to(mask.dtype)


def clip_terms(inp: LossInputs, stats: StepStats, h: ClipConfig):
    m = inp.mask
    old = inp.old_logprobs if inp.old_logprobs is not None else inp.behavior_logprobs
    ratio = torch.exp(masked_log_ratio(inp.logprobs, old.detach(), m))
    adv = inp.advantages.detach()
    per_tok = clipped_surrogate(ratio, adv, h.eps_low, h.eps_high)
    metrics = {"clip_frac": (clip_fraction(ratio.detach(), adv, h.eps_low, h.eps_high, m), m.sum())}
    if h.tis_cap is not None or h.mis_low is not None:
        log_v = masked_log_ratio(old.detach(), inp.behavior_logprobs, m)
        if h.tis_cap is not None:
            per_tok = per_tok * torch.clamp(torch.exp(log_v), max=h.tis_cap)
        if h.mis_low is not None:
            keep = _mis_keep(log_v, m, h)
            metrics["mask_frac"] = (((1 - keep) * m).sum(), m.sum())
            if h.mis_level != "token":  # a sequence's tokens share its keep
                has = (m.sum(-1) > 0).to(m.dtype)
                metrics["seq_mask_frac"] = (((1 - keep[:, 0]) * has).sum(), has.sum())
            per_tok = per_tok * (keep * torch.exp(log_v) if h.mis_weighted else keep)
    if h.kl_coef:
        per_tok = per_tok + h.kl_coef * k3(inp.logprobs, inp.ref_logprobs, m)
    if h.aggregation == "seq_mean_token_mean":
        return seq_mean_of_token_terms(per_tok, m), metrics
    return (per_tok * m).sum(), metrics
