"""The normalized effective sample size e_B over one optimizer step, and input sanity checks.

P3O (seed 000, Eq. 11): ``e_B = (Σ_{t∈B} ρ_t)² / (N_B · Σ_{t∈B} ρ_t²)`` with ``ρ = exp(ℓθ − ℓb)``
over **every** valid token of the step (all micro-batches, all DP and CP ranks). We keep float64
sufficient statistics ``(Σρ, Σρ², N)`` per micro-batch, add them up, and all-reduce once over
DP on the last pipeline stage (CP ranks hold whole sequences after the loss-side gather); e_B is
then frozen for the step's gradient pass.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_p3o.loss.terms import masked_log_ratio
from megatron_p3o.runtime.collectives import all_sum
from megatron_p3o.runtime.errors import UserError


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
    tokens removed for ``policy="mask"`` (no host read: the mask is the same when none is bad).
    """
    bad = ~torch.isfinite(values) & (mask > 0)
    if policy == "mask":
        return mask * (~bad).to(mask.dtype)
    if not bad.any():
        return mask
    rows = bad.any(-1).nonzero().flatten().tolist()
    r = rows[0]
    t = bad[r].nonzero().flatten()[0].item()
    who = f"sample {sample_ids[r]!r} (row {r})" if sample_ids is not None else f"sample row {r}"
    raise NonFiniteLogprobError(
        f"{name} is {values[r, t].item()} at valid token {t} of {who}"
        f"{f' and {len(rows) - 1} other samples' if len(rows) > 1 else ''}; "
        "set loss.nonfinite: mask to drop such tokens and count them instead"
    )


class FiniteWatch:
    """``check_finite(policy="error")`` deferred to the end of the step's schedule.

    Raising inside a micro-batch needs ``bad.any()`` on the host: a device→host sync per
    micro-batch. :meth:`watch` instead keeps the values and a device count of the non-finite
    valid tokens; :meth:`count` sums them (fold it into the step's one reduction), and
    :meth:`raise_error` (only once a count came back non-zero) raises exactly what
    ``check_finite`` would have raised for the first offending micro-batch.
    """

    def __init__(self):
        self.seen: List[Tuple[str, Tensor, Tensor, Optional[Tensor], Tensor]] = []

    def watch(
        self, name: str, values: Tensor, mask: Tensor, sample_ids: Optional[Tensor] = None
    ) -> None:
        bad = (~torch.isfinite(values) & (mask > 0)).sum()
        self.seen.append((name, values.detach(), mask, sample_ids, bad))

    def count(self, device: Optional[torch.device] = None) -> Tensor:
        """Non-finite valid tokens over every watched micro-batch (a device tensor)."""
        if not self.seen:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.stack([b for *_, b in self.seen]).sum().double()

    def raise_error(self, total: float, where: str = "another data-parallel rank") -> None:
        """Raise for ``total`` non-finite tokens of the step: ``check_finite``'s message when
        they are in this rank's micro-batches, else one saying they are on ``where``."""
        for name, values, mask, ids, _ in self.seen:
            check_finite(name, values, mask, ids.tolist() if ids is not None else None)
        name = self.seen[0][0] if self.seen else "a log-prob"
        raise NonFiniteLogprobError(
            f"{name} is non-finite at {total:.0f} valid tokens on {where}; "
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
        all_sum(stats, group, "e_B: token sums of the whole step, every DP rank's share")
    return stats


def ess_tensor(stats: Tensor) -> Tensor:
    """e_B from ``[Σρ, Σρ², N]`` as a device scalar, unchecked (no host read, for use inside a
    micro-batch): check the same statistics with :func:`ess_from_stats` after the schedule."""
    return (stats[0] * stats[0]) / (stats[2] * stats[1])


def ess_from_stats(stats, what: str = "step") -> float:
    """e_B ∈ [1/N, 1] from ``[Σρ, Σρ², N]`` (a tensor, read with one host transfer, or host
    floats); refuses an empty or non-finite step."""
    s1, s2, n = stats.tolist() if torch.is_tensor(stats) else (float(x) for x in stats)
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
