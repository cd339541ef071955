"""M2PO (arXiv 2510.01161): a second-moment trust region, as a token mask.

With δ_t = ℓold_t − ℓb_t (the trainer's policy at the start of the step against the rollout
engine's behaviour policy) over a set of N valid tokens, the tokens with the largest δ² leave
the loss until the second moment of the rest is below τ:

    sort δ² descending: v_1 ≥ … ≥ v_N;  k* = min{k : mean(v_{k+1}, …, v_N) < τ}  (N − 1 if none)
    loss = Σ_t keep_t · w_t · s_t / Σ_t keep_t,
    s_t  = −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t),  r_t = exp(ℓθ_t − ℓold_t)

This is AReaL's M2PO (``grpo_loss_fn`` with ``m2_threshold``: the keep-mask replaces the loss
mask of its decoupled PPO loss, so the mean is over the kept tokens). Two choices, as AReaL
names them (docs/objectives.md):

``scope``
    ``step`` (default, the project's): the set is the optimizer step's global token set (every
    micro-batch, DP and CP rank; e_B's set), ``keep_t = 1[δ_t² < v_{k*}]`` (ties at the cut
    leave with it: possibly more than k* tokens), one mean over the step's kept tokens.
    ``microbatch`` (AReaL's): the set is one micro-batch of one rank; exactly the k* first
    tokens of ``torch.sort(δ², descending=True)`` over its valid tokens (row-major) leave, as
    AReaL's ``_apply_m2po_masking``; each micro-batch is a mean over its kept tokens, weighted
    by its share of the step's valid tokens (AReaL's ``loss_weight_fn`` = the micro-batch's
    loss-mask count over the step's total).

``rejection_sampling``
    ``{metric: ratio, upper: 5.0}`` (default, AReaL's shipped ``gsm8k_m2po.yaml``): a kept token
    is weighted by ρ_t = sg(exp(δ_t)) if ``lower ≤ ρ_t ≤ upper`` (compared as AReaL does, on ρ),
    else by 0 — it stays in the denominator (AReaL counts its loss mask before the rejection).
    ``null`` (AReaL without rejection sampling): w_t = 1.
    ``{upper: .inf}``: weighted by ρ, never dropped.

The paper's objective (the token mean of M·(πθ/π_behav)·A) is the gradient of this loss at the
first update of a rollout batch (r = 1, ρ·r = πθ/πb). τ = 0.04 as in every experiment of the
paper. The authors' own code instead turns the budget into an adaptive PPO clip range; that
variant is not this objective (docs/objectives.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from megatron_p3o.loss.terms import (
    LossInputs,
    StepStats,
    clip_fraction,
    clipped_surrogate,
    masked_log_ratio,
)

SCOPES = ("step", "microbatch")
# AReaL's RejectionSamplingConfig fields and the values this objective supports
_RS_FIXED = {"level": "token", "action": "mask", "metric": "ratio"}
_RS_KEYS = (*_RS_FIXED, "agg", "upper", "lower")


def _shipped_rejection_sampling() -> Dict[str, Any]:
    # examples/math/gsm8k_m2po.yaml: rejection_sampling {metric: ratio, upper: 5.0}
    return {**_RS_FIXED, "upper": 5.0, "lower": None}


@dataclass(frozen=True)
class M2POConfig:
    """Attributes: tau (τ, the second-moment budget of (ℓold − ℓb)², 0.04), eps_low / eps_high
    (the PPO clip of r = πθ/πold on the kept tokens, AReaL's default 0.2), scope ("step" or
    "microbatch": the token set of the cut and of the mean), rejection_sampling (AReaL's token
    ratio rejection ``{upper, lower}`` weighting the kept tokens by ρ inside the band, 0
    outside; None: every kept token weighted by 1)."""

    tau: float = 0.04
    eps_low: float = 0.2
    eps_high: float = 0.2
    scope: str = "step"
    rejection_sampling: Optional[Dict[str, Any]] = field(
        default_factory=_shipped_rejection_sampling
    )

    def __post_init__(self):
        if not self.tau > 0:
            raise ValueError(f"tau={self.tau} must be > 0")
        if self.scope not in SCOPES:
            raise ValueError(f"scope={self.scope!r}: use step or microbatch")
        rs = self.rejection_sampling
        if rs is None:
            return
        if not isinstance(rs, dict):
            raise ValueError(
                f"rejection_sampling={rs!r}: a mapping such as {{metric: ratio, upper: 5.0}}, or "
                "null (kept tokens weighted by 1)"
            )
        for key in rs:
            if key not in _RS_KEYS:
                raise ValueError(
                    f"rejection_sampling.{key}: unknown key; known: {', '.join(_RS_KEYS)}"
                )
        for key, only in _RS_FIXED.items():
            if rs.get(key, only) != only:
                raise ValueError(f"rejection_sampling.{key}={rs[key]!r}: only {only!r} here")
        upper, lower = rs.get("upper", 5.0), rs.get("lower")
        for key, v in (("upper", upper), ("lower", lower)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"rejection_sampling.{key}={v!r} must be a number")
        if upper is None or not upper > 0:
            raise ValueError(f"rejection_sampling.upper={upper!r} must be > 0")
        if lower is not None and not 0 <= lower <= upper:
            raise ValueError(f"rejection_sampling.lower={lower!r}: need 0 <= lower <= upper")
        full = {**_RS_FIXED, "upper": float(upper), "lower": None if lower is None else lower}
        object.__setattr__(self, "rejection_sampling", full)


def m2_cut(sq: Tensor, tau: float) -> Tuple[float, int]:
    """``(cut, k*)`` for the squared log-ratios ``sq`` ``[N]`` of every valid token of the step:
    tokens with ``δ² ≥ cut`` are masked (``cut = inf``: none). float64; one host read."""
    n = sq.numel()
    if n == 0:
        return math.inf, 0
    v = torch.sort(sq.double(), descending=True).values
    # mean of the suffix v[k:], k = 0 … N−1
    suffix = torch.flip(torch.cumsum(torch.flip(v, [0]), 0), [0])
    means = suffix / torch.arange(n, 0, -1, dtype=torch.float64, device=v.device)
    below = torch.nonzero(means < tau)
    k = int(below[0]) if below.numel() else n - 1
    return (math.inf if k == 0 else float(v[k - 1])), k


def _delta(inp: LossInputs) -> Tensor:
    return masked_log_ratio(
        inp.old_logprobs.detach().double(), inp.behavior_logprobs.double(), inp.mask
    )


def m2_values(inp: LossInputs) -> Tensor:
    """δ² ``[n]`` of the valid tokens of ``inp`` (row-major), float64."""
    d = _delta(inp)
    return (d * d)[inp.mask > 0]


def m2po_keep(inp: LossInputs, cut: float) -> Tensor:
    """Scope ``step``: the tokens below the step's cut (every token tied with it leaves)."""
    d = _delta(inp)
    return ((d * d < cut) & (inp.mask > 0)).to(inp.mask.dtype)


def m2po_microbatch_keep(inp: LossInputs, tau: float) -> Tensor:
    """Scope ``microbatch``: AReaL's keep-mask of one micro-batch — its valid δ² in row-major
    order, ``torch.sort(descending=True)``, the first k* in that order leave (exactly k*, ties
    broken by the sort). Holds a data-dependent shape (one device sync): the trainer calls it
    before the gradient pass."""
    m = inp.mask > 0
    d = _delta(inp)
    sq = (d * d)[m]
    n = sq.numel()
    if n == 0:
        return torch.zeros_like(inp.mask)
    v, order = torch.sort(sq, descending=True)
    suffix = v.flip(0).cumsum(0).flip(0)
    means = suffix / torch.arange(n, 0, -1, device=v.device, dtype=v.dtype)
    below = means < tau
    pos = torch.arange(n, device=v.device)
    # k* = the first position whose suffix mean is below τ, n − 1 if none (no host read)
    k = torch.where(below.any(), torch.argmax(below.to(torch.int8)), n - 1)
    kept_sorted = pos >= k
    kept = torch.empty_like(kept_sorted).scatter_(0, order, kept_sorted)
    out = torch.zeros(inp.mask.shape, dtype=torch.bool, device=inp.mask.device)
    out[m] = kept
    return out.to(inp.mask.dtype)


def rejection_weight(rho: Tensor, h: M2POConfig) -> Tensor:
    """The weight of a kept token: ρ inside AReaL's band (compared on ρ, as AReaL), else 0;
    1 without rejection sampling."""
    rs = h.rejection_sampling
    if rs is None:
        return torch.ones_like(rho)
    inside = rho <= rs["upper"]
    if rs["lower"] is not None:
        inside = inside & (rho >= rs["lower"])
    return torch.where(inside, rho, torch.zeros_like(rho))


def m2po_terms(inp: LossInputs, stats: StepStats, h: M2POConfig):
    m = inp.mask
    if h.scope == "step":
        keep = m2po_keep(inp, stats.m2po_cut)
    elif inp.m2po_keep is not None:  # computed by the trainer before the gradient pass
        keep = inp.m2po_keep.to(m.dtype) * m
    else:
        keep = m2po_microbatch_keep(inp, h.tau)
    old = inp.old_logprobs.detach()
    ratio = torch.exp(masked_log_ratio(inp.logprobs, old, m))
    rho = torch.exp(masked_log_ratio(old, inp.behavior_logprobs, m)).detach()
    w = rejection_weight(rho, h) * keep
    adv = inp.advantages.detach()
    per_tok = w * clipped_surrogate(ratio, adv, h.eps_low, h.eps_high)
    total = per_tok.sum()
    if h.scope == "microbatch":
        # AReaL: mean over the micro-batch's kept tokens, times its loss-mask count (the caller
        # divides by the step's valid tokens: Σ_mb n_mb/N · mean_mb)
        total = total * m.sum() / keep.sum().clamp_min(1.0)
    metrics = {
        "mask_frac": (((1 - keep) * m).sum(), m.sum()),
        "clip_frac": (clip_fraction(ratio.detach(), adv, h.eps_low, h.eps_high, keep), keep.sum()),
    }
    if h.rejection_sampling is not None:
        metrics["rs_frac"] = ((keep * (w == 0).to(m.dtype)).sum(), keep.sum())
    return total, metrics
