"""Paired comparisons of stress cells: P3O minus the best baseline, with bootstrap 95% CIs.

Why paired: every objective of a setting runs with the same seeds and is scored on the same
held-out prompts, so the difference per (seed, prompt) removes most of the prompt-difficulty and
seed variance that two independent means would carry.

Two-level bootstrap (seeds, then prompts): a replicate draws S seeds with replacement and, for
each drawn seed, N prompts with replacement; the same draws are used for both objectives (the
pairing). The statistic is the mean of (correct_A − correct_B) over the drawn (seed, prompt)
pairs; the interval is the replicates' 2.5–97.5 percentile. A difference is called a win or a
loss only when its interval excludes 0.

Caveat, stated in the report: the "best baseline" is chosen per setting by its mean, after the
fact; that choice favours the baseline (winner's curse), so P3O's losses are slightly
overstated and its wins understated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch


@dataclass(frozen=True)
class PairedDiff:
    """A − B: ``diff`` (mean over seeds and prompts), ``lo`` / ``hi`` (bootstrap CI)."""

    diff: float
    lo: float
    hi: float
    n_seeds: int
    n_prompts: int

    @property
    def verdict(self) -> str:
        if self.lo > 0:
            return "win"
        if self.hi < 0:
            return "loss"
        return "tie"


def paired_bootstrap(
    a: Sequence[Sequence[float]],
    b: Sequence[Sequence[float]],
    n_boot: int = 4000,
    level: float = 0.95,
    seed: int = 0,
) -> PairedDiff:
    """A − B over matched seeds (rows) and prompts (columns), with a two-level bootstrap CI.

    Args:
        a, b: ``[S][N]`` per-prompt scores (e.g. 0/1 correctness) of the two objectives, row s
            of both from the same seed, column i from the same prompt.
    """
    ta = torch.tensor(a, dtype=torch.float64)
    tb = torch.tensor(b, dtype=torch.float64)
    if ta.shape != tb.shape or ta.dim() != 2 or ta.numel() == 0:
        raise ValueError(f"paired_bootstrap: shapes {tuple(ta.shape)} and {tuple(tb.shape)}")
    d = ta - tb  # [S, N]
    s, n = d.shape
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, s, (n_boot, s), generator=g)  # [B, S]
    prompts = torch.randint(0, n, (n_boot, s, n), generator=g)  # [B, S, N]
    reps = d[seeds[..., None], prompts].mean(dim=(1, 2))  # [B]
    q = torch.tensor([(1 - level) / 2, 1 - (1 - level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(reps, q).tolist()
    return PairedDiff(float(d.mean()), lo, hi, s, n)


def by_seed(cells: List[dict], objective: str, mismatch: str) -> Dict[int, List[float]]:
    """seed -> per-prompt final scores of one (objective, setting), finished cells only."""
    return {
        c["seed"]: c["final_per_prompt"]
        for c in cells
        if c["objective"] == objective
        and c["mismatch"] == mismatch
        and c["status"] == "ok"
        and c.get("final_per_prompt")
    }


def versus_best_baseline(
    cells: List[dict], mismatch: str, subject: str, baselines: Sequence[str]
) -> Optional[tuple]:
    """``(best baseline, PairedDiff subject − best)`` on the seeds both finished, or None."""
    mine = by_seed(cells, subject, mismatch)
    best, best_mean = None, -math.inf
    for o in baselines:
        theirs = by_seed(cells, o, mismatch)
        common = sorted(set(mine) & set(theirs))
        if not common:
            continue
        m = sum(sum(theirs[s]) / len(theirs[s]) for s in common) / len(common)
        if m > best_mean:
            best, best_mean = o, m
    if best is None:
        return None
    theirs = by_seed(cells, best, mismatch)
    common = sorted(set(mine) & set(theirs))
    return best, paired_bootstrap([mine[s] for s in common], [theirs[s] for s in common])
