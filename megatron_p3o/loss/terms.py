"""Inputs shared by every objective, and the small per-token terms they are built from.

Shapes: B sequences × T response positions. ``mask`` is 1.0 at valid response tokens. All
log-ratios are formed in float32 or wider and padded positions are zeroed **before** ``exp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch (or of the whole step, single-process).

    Attributes:
        logprobs: ℓθ ``[B, T]`` fp32, differentiable (trainer, at the sampling temperature).
        behavior_logprobs: ℓb ``[B, T]`` from the rollout engine.
        advantages: ``[B, T]`` (already broadcast from per-sequence values).
        mask: ``[B, T]`` float, 1 at valid response tokens.
        old_logprobs: ℓold/ℓprox ``[B, T]`` recomputed at the start of the step, or None.
        ref_logprobs: ℓref ``[B, T]`` of the frozen reference model, or None.
        entropy: per-token entropy ``[B, T]`` of πθ, or None.
        rewards: ``[B]`` scalar rewards (OAPL), or None.
        group_ids: ``[B]`` prompt-group id of each sequence (OAPL), or None.
        values: V_θ(s₁) ``[B]``, the log-partition of the policy's logits where each sequence's
            first completion token is predicted (ReVal), differentiable; or None.
        ref_values: V_ref(s₁) ``[B]`` of the reference model (ReVal), or None.
        m2po_keep: M2PO's keep-mask ``[B, T]`` of this micro-batch (scope ``microbatch``),
            computed by the trainer before the gradient pass; None: computed from the inputs.
    """

    logprobs: Tensor
    behavior_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    old_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    rewards: Optional[Tensor] = None
    group_ids: Optional[Tensor] = None
    values: Optional[Tensor] = None
    ref_values: Optional[Tensor] = None
    m2po_keep: Optional[Tensor] = None


@dataclass(frozen=True)
class StepStats:
    """Quantities of the whole optimizer step, known before its gradient pass.

    Attributes:
        n_tokens: N_B, valid tokens over every micro-batch and DP×CP rank.
        n_seqs: sequences with at least one valid token, over the same set.
        ess: e_B of ρ = πθ/πb over the step (P3O, P4O), or None. A float (ESS scope
            "step"), or a device scalar (scope "microbatch": computed inside the micro-batch,
            never read on the host there).
        ess_prox: ESS of πθ/πprox over the step (P4O), or None; float or device scalar too.
        m2po_cut: M2PO's cut on (ℓold − ℓb)² over the step's tokens (inf: none masked), and
        m2po_kept: the step's count of kept tokens (its loss normalizer); None otherwise.
    """

    n_tokens: float
    n_seqs: float
    ess: Optional[Union[float, Tensor]] = None
    ess_prox: Optional[Union[float, Tensor]] = None
    m2po_cut: Optional[float] = None
    m2po_kept: Optional[float] = None


def masked_log_ratio(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """``a − b`` in float32+, zero at padded positions (so a later ``exp`` gives 1, never inf·0)."""
    d = a.float() - b.float() if a.dtype != torch.float64 else a - b.to(a.dtype)
    return torch.where(mask > 0, d, torch.zeros_like(d))


def k3(logprobs: Tensor, anchor_logprobs: Tensor, mask: Tensor, clamp: float = 10.0) -> Tensor:
    """Sampled-token k3 estimate of KL(πθ‖π_anchor): ``(ℓθ − ℓa) + exp(clamp(ℓa − ℓθ)) − 1``.

    Gradient flows through ``logprobs`` only. Zero at padded positions. ``[B, T]``.
    """
    d = masked_log_ratio(logprobs, anchor_logprobs.detach(), mask)
    return (d + torch.exp(torch.clamp(-d, -clamp, clamp)) - 1.0) * mask


def capped_weight_share(rho: Tensor, cap, adv: Tensor, mask: Tensor) -> tuple:
    """The share of an ESS-capped score term's weight carried by tokens at the cap (P3O, P4O).

    The score term's gradient is −Σ_t w_t·A_t·∇ℓθ_t / N with w_t = min(ρ_t, e); its weight on
    token t is |w_t·A_t|. Returns ``(Σ_t [ρ_t > e]·|w_t·A_t|·m_t, Σ_t |w_t·A_t|·m_t)`` (device
    scalars, summed over micro-batches and ranks): the share of the gradient's coefficients,
    not of its norm (the tokens' ∇ℓθ_t differ in size). ``rho``, ``adv``, ``mask``: ``[B, T]``;
    ``cap``: a float or a device scalar.
    """
    weight = (torch.clamp(rho, max=cap) * adv).abs().detach() * mask
    return ((rho > cap).float() * weight).sum(), weight.sum()


def clipped_surrogate(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """PPO's pessimistic surrogate per token: ``−min(r·A, clip(r, 1−ε_l, 1+ε_h)·A)``."""
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)


def clip_fraction(
    ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float, mask: Tensor
) -> Tensor:
    """Count of tokens where the clipped branch is active (its gradient is zero)."""
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    return (clipped.float() * mask).sum()


def seq_lengths(mask: Tensor) -> Tensor:
    """Valid tokens per sequence ``[B]`` (at least 1, so empty rows divide safely)."""
    return mask.sum(-1).clamp_min(1.0)


def seq_mean_of_token_terms(terms: Tensor, mask: Tensor) -> Tensor:
    """Σ_i (Σ_t terms_it / |y_i|): the numerator of a sequence-mean of token-means."""
    return ((terms * mask).sum(-1) / seq_lengths(mask)).sum()
