"""M2PO (arXiv 2510.01161): a second-moment trust region, as a token mask over the whole step.

With δ_t = ℓold_t − ℓb_t (the trainer's policy at the start of the step against the rollout
engine's behaviour policy) over the N valid tokens of the optimizer step (every micro-batch,
DP and CP rank), the tokens with the largest δ² leave the loss until the second moment of the
rest is below τ:

    sort δ² descending: v_1 ≥ … ≥ v_N;  k* = min{k : mean(v_{k+1}, …, v_N) < τ}  (N − 1 if none)
    keep_t = 1[δ_t² < v_{k*}]     (k* = 0: every token kept; ties at the cut leave with it)
    loss   = Σ_t keep_t · ρ_t · s_t / Σ_t keep_t,   ρ_t = sg(exp(δ_t)),
    s_t    = −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t),  r_t = exp(ℓθ_t − ℓold_t)

This is AReaL's M2PO (``grpo_loss_fn`` with ``m2_threshold``: the mask replaces the loss mask of
its decoupled PPO loss, so the mean is over the kept tokens) as its shipped configuration runs it
(``gsm8k_m2po.yaml``: ρ enters through its rejection sampling), except that its statistic is
taken per micro-batch there and over the step's global token set here — e_B's set.
The paper's objective (the token mean of M·(πθ/π_behav)·A) is the gradient of this loss at the
first update of a rollout batch (r = 1, ρ·r = πθ/πb). τ = 0.04 as in every experiment of the
paper. The authors' own code instead turns the budget into an adaptive PPO clip range; that
variant is not this objective (docs/objectives.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch
from torch import Tensor

from .terms import LossInputs, StepStats, clip_fraction, clipped_surrogate, masked_log_ratio


@dataclass(frozen=True)
class M2POConfig:
    """Attributes: tau (τ, the second-moment budget of (ℓold − ℓb)², 0.04), eps_low / eps_high
    (the PPO clip of r = πθ/πold on the kept tokens, AReaL's default 0.2)."""

    tau: float = 0.04
    eps_low: float = 0.2
    eps_high: float = 0.2

    def __post_init__(self):
        if not self.tau > 0:
            raise ValueError(f"tau={self.tau} must be > 0")


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


def m2_values(inp: LossInputs) -> Tensor:
    """δ² ``[n]`` of the valid tokens of ``inp`` (row-major), float64."""
    d = masked_log_ratio(
        inp.old_logprobs.detach().double(), inp.behavior_logprobs.double(), inp.mask
    )
    return (d * d)[inp.mask > 0]


def m2po_keep(inp: LossInputs, cut: float) -> Tensor:
    d = masked_log_ratio(
        inp.old_logprobs.detach().double(), inp.behavior_logprobs.double(), inp.mask
    )
    return ((d * d < cut) & (inp.mask > 0)).to(inp.mask.dtype)


def m2po_terms(inp: LossInputs, stats: StepStats, h: M2POConfig):
    m = inp.mask
    keep = m2po_keep(inp, stats.m2po_cut)
    old = inp.old_logprobs.detach()
    ratio = torch.exp(masked_log_ratio(inp.logprobs, old, m))
    rho = torch.exp(masked_log_ratio(old, inp.behavior_logprobs, m)).detach()
    adv = inp.advantages.detach()
    per_tok = keep * rho * clipped_surrogate(ratio, adv, h.eps_low, h.eps_high)
    return per_tok.sum(), {
        "mask_frac": (((1 - keep) * m).sum(), m.sum()),
        "clip_frac": (clip_fraction(ratio.detach(), adv, h.eps_low, h.eps_high, keep), keep.sum()),
    }
