"""Advantages from per-sequence rewards of prompt groups (pure tensor functions).

GRPO (seed 000, Eq. 3): for the G completions of one prompt,
    A_{p,j} = (r_{p,j} − mean_j r) / (std_j r + ε),  std population (ddof 0), ε = 1e-6;
Dr.GRPO drops the std; RLOO uses the leave-one-out mean: A_j = r_j − mean_{i≠j} r_i.
Each returns ``[B]`` (one value per sequence) and is broadcast to tokens by the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Literal

import torch
from torch import Tensor

from megatron_p3o.runtime.fields import check_ranges


@dataclass(frozen=True)
class AdvantageConfig:
    """Attributes: kind (grpo, dr_grpo, rloo) and eps (GRPO's std floor)."""

    kind: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    eps: float = 1e-6

    RANGES: ClassVar[Dict[str, str]] = {"eps": ">= 0"}

    def __post_init__(self):
        check_ranges(self, self.RANGES, "advantage")


KINDS = ("grpo", "dr_grpo", "rloo")


def _group_index(group_ids: Tensor):
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, len(uniq)


def group_advantages(
    rewards: Tensor, group_ids: Tensor, kind: str = "grpo", eps: float = 1e-6
) -> Tensor:
    """``[B]`` float64 advantages of ``rewards [B]`` grouped by ``group_ids [B]``."""
    if kind not in KINDS:
        raise ValueError(f"advantage.kind={kind!r}; choose one of {list(KINDS)}")
    r = rewards.double()
    if not torch.isfinite(r).all():
        bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
        raise ValueError(f"non-finite rewards at rows {bad[:5]}")
    inv, g = _group_index(group_ids)
    count = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, r)
    mean = total / count
    if kind == "rloo":
        if (count < 2).any():
            raise ValueError("advantage.kind='rloo' needs at least 2 completions per prompt")
        return r - (total[inv] - r) / (count[inv] - 1)
    centred = r - mean[inv]
    if kind == "dr_grpo":
        return centred
    var = torch.zeros(g, dtype=torch.float64).index_add_(0, inv, centred * centred) / count
    return centred / (var.sqrt()[inv] + eps)


def rarity_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """R2PO's head-phase advantage (arXiv 2601.11960), ``[B]`` float64.

    For a group's rewards R_1…R_G: c_i = 1 / #{j : R_j = R_i} (rare outcomes score high),
    standardised within the group, (c_i − mean c) / (std c + ε), population std. A group whose
    rewards are all equal carries no signal and is skipped: NaN, which the batcher turns into a
    sequence outside the loss and its normalizer."""
    r = rewards.double()
    inv, g = _group_index(group_ids)
    out = torch.full_like(r, float("nan"))
    for k in range(g):
        sel = (inv == k).nonzero().flatten()
        rk = r[sel]
        c = 1.0 / (rk[:, None] == rk[None, :]).sum(1).double()
        if bool((rk == rk[0]).all()):
            continue
        out[sel] = (c - c.mean()) / (c.std(unbiased=False) + eps)
    return out
