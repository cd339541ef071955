"""DAPO's soft over-long shaping: a reward term for completions that run into the budget.

    R_len(|y|) = 0                                  if |y| ≤ L_max − L_cache
               = ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
               = −1                                 if |y| > L_max
(DAPO, Yu et al. 2025, Eq. 13), added to the task reward before advantages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OverlongConfig:
    """Attributes: max_len (L_max, tokens) and cache (L_cache: the soft-penalty window)."""

    max_len: int
    cache: int

    def __post_init__(self):
        if not 0 < self.cache <= self.max_len:
            raise ValueError(
                f"reward.overlong: need 0 < cache ({self.cache}) <= max_len ({self.max_len})"
            )


def dapo_overlong_reward(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """``R_len [B]`` for completion lengths ``[B]`` (float64)."""
    lengths = lengths.double()
    safe = max_len - cache_len
    pen = (safe - lengths) / cache_len
    return torch.where(
        lengths <= safe,
        torch.zeros_like(pen),
        torch.where(lengths <= max_len, pen, -torch.ones_like(pen)),
    )
