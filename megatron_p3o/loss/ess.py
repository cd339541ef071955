"""The normalized effective sample size e_B over one optimizer step, and input sanity checks.

P3O (seed 000, Eq. 11): ``e_B = (Σ_{t∈B} ρ_t)² / (N_B · Σ_{t∈B} ρ_t²)`` with ``ρ = exp(ℓθ − ℓb)``
over **every** valid token of the step (all micro-batches, all DP and CP ranks). We keep float64
sufficient statistics ``(Σρ, Σρ², N)`` per micro-batch, add them up, and all-reduce once over
DP on the last pipeline stage (CP ranks hold whole sequences after the loss-side gather); e_B is
then frozen for the step's gradient pass.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import UserError
from .terms import masked_log_ratio


class NonFiniteLogprobError(UserError, ValueError):
    """A log-prob (or ESS statistic) is NaN/inf at a valid position."""


class EmptyStepError(UserError, ValueError):
    """The optimizer step has no valid tokens, so e_B and the token-mean are undefined."""


def check_finite(
    name: str,
    values: Tensor,
    mask: Tensor,
    sample_ids: Optional[Sequence] = None,
    policy: str = "error",
) -> Tensor:
    """Refuse (or mask) non-finite ``values [B, T]`` at valid positions.

    Returns the mask to use: unchanged for ``policy="error"`` (raises instead), with the bad
    tokens removed for ``policy="mask"``.
    """
    bad = ~torch.isfinite(values) & (mask > 0)
    if not bad.any():
        return mask
    if policy == "mask":
        return mask * (~bad).to(mask.dtype)
    rows = bad.any(-1).nonzero().flatten().tolist()
    r = rows[0]
    t = bad[r].nonzero().flatten()[0].item()
    who = f"sample {sample_ids[r]!r} (row {r})" if sample_ids is not None else f"sample row {r}"
    raise NonFiniteLogprobError(
        f"{name} is {values[r, t].item()} at valid token {t} of {who}"
        f"{f' and {len(rows) - 1} other samples' if len(rows) > 1 else ''}; "
        "set loss.nonfinite: mask to drop such tokens and count them instead"
    )


def ess_stats(logprobs: Tensor, anchor_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Float64 ``[Σρ, Σρ², N]`` of ``ρ = exp(ℓθ − ℓa)`` over valid tokens of ``[B, T]`` inputs."""
    d = masked_log_ratio(logprobs.detach().double(), anchor_logprobs.detach().double(), mask)
    m = mask.double()
    rho = torch.exp(d) * m
    return torch.stack([rho.sum(), (rho * rho).sum(), m.sum()])


def all_reduce_stats(stats: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """Sum statistics over ``group`` (DP: every rank holds a disjoint part of the step)."""
    if group is not None and dist.get_world_size(group) > 1:
        stats = stats.clone()
        # DP group: token sums of the whole optimizer step, every data-parallel rank's share.
        dist.all_reduce(stats, group=group)
    return stats


def ess_from_stats(stats: Tensor, what: str = "step") -> float:
    """e_B ∈ [1/N, 1] from ``[Σρ, Σρ², N]``; refuses an empty or non-finite step."""
    s1, s2, n = (float(x) for x in stats)
    if n <= 0:
        raise EmptyStepError(
            f"the {what} has no valid tokens: e_B and the token-mean are undefined"
        )
    if not all(map(lambda x: x == x and abs(x) != float("inf"), (s1, s2))) or s2 <= 0:
        raise NonFiniteLogprobError(
            f"ESS statistics of the {what} are not finite (Σρ={s1}, Σρ²={s2}, N={n:.0f}): "
            "log-ratios ℓθ − ℓb overflowed; check the rollout engine's log-probs"
        )
    return (s1 * s1) / (n * s2)
