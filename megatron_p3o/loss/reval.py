"""ReVal (Wang, Li, Xu et al., arXiv 2603.23355): the policy's logits are soft Q-values.

    Q_θ(s, a) = z_θ(s, a),  V_θ(s) = log Σ_a exp z_θ(s, a),  π_θ = softmax(z_θ)
With reference shaping the soft Bellman residual telescopes over a trajectory
τ = (s₁, a₁ … a_H) with terminal reward r:
    δ(τ) = V_θ(s₁) − V_ref(s₁) + Σ_h [ℓθ(a_h|s_h) − ℓref(a_h|s_h)] − r(τ)/β
    L = mean_τ δ(τ)²                                                   (sequence-mean)
r, ℓref and V_ref(s₁) are constants. The loss as written differentiates V_θ(s₁) too
(``value_grad=True``); the paper's written gradient −2·E[δ·∇ℓθ] omits that path
(``value_grad=False``: V_θ(s₁) enters δ but is detached). No importance ratio, no clipping; the
logits *are* the Q-function, so sampling must be at temperature 1 over the full vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from megatron_p3o.loss.terms import LossInputs, StepStats, masked_log_ratio


@dataclass(frozen=True)
class ReValConfig:
    """Attributes:
    beta: β of r/β; shrink it as responses lengthen (paper: 0.002 for ~5k-token responses,
        0.02 for ~600).
    value_grad: differentiate V_θ(s₁) (the loss as written; default) or not (the paper's
        written gradient).
    reward: "centered" (r − group mean, no std: the paper's best) or "raw" (0/1).
    """

    beta: float = 0.02
    value_grad: bool = True
    reward: Literal["centered", "raw"] = "centered"

    def __post_init__(self):
        if not self.beta > 0:
            raise ValueError(f"beta={self.beta} must be > 0")
        if self.reward not in ("centered", "raw"):
            raise ValueError(f"reward={self.reward!r}: use centered or raw")


def reval_rewards(rewards: Tensor, group_ids: Tensor, h: ReValConfig) -> Tensor:
    """The r of δ, ``[B]`` float64: the reward, or the reward minus its prompt group's mean."""
    r = rewards.double()
    if h.reward == "raw":
        return r.clone()
    out = torch.empty_like(r)
    for g in group_ids.unique():
        sel = group_ids == g
        out[sel] = r[sel] - r[sel].mean()
    return out


def reval_delta(inp: LossInputs, h: ReValConfig) -> Tensor:
    """δ(τ) ``[B]``: per-sequence sums over whole sequences (the caller never splits one).

    ``inp.advantages`` carries each sequence's r (broadcast to its tokens), ``inp.values`` /
    ``inp.ref_values`` V_θ(s₁) / V_ref(s₁) ``[B]``."""
    m = inp.mask
    n = m.sum(-1)
    r = (inp.advantages * m).sum(-1) / n.clamp_min(1)
    v = inp.values if h.value_grad else inp.values.detach()
    chain = masked_log_ratio(inp.logprobs, inp.ref_logprobs.detach(), m).sum(-1)
    return v.float() - inp.ref_values.float().detach() + chain - r.detach().float() / h.beta


def reval_terms(inp: LossInputs, stats: StepStats, h: ReValConfig):
    """Σ_τ δ(τ)² over sequences with at least one valid token, plus metric pairs."""
    has = (inp.mask.sum(-1) > 0).to(torch.float32)
    d = reval_delta(inp, h)
    with torch.no_grad():
        metrics = {
            "reval_abs_delta": ((d.abs() * has).sum(), has.sum()),
            "reval_value_gap": (((inp.values - inp.ref_values).float() * has).sum(), has.sum()),
        }
    return (d * d * has).sum(), metrics
