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
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

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


# -- seed-level inference (stress study v3) -----------------------------------------------------
#
# The unit of inference is the seed: each seed is one independent training run, and the prompts
# scored at its end are not independent replicates of the run (they share its weights). With S
# seeds the two-level bootstrap above makes its interval from S per-seed differences, which at
# S = 3 is about their min–max and covers far less than its nominal 95% (simulated in
# tests/unit/test_stress_stats.py). Below: paired per-seed differences against comparators named
# before the runs, a t-interval, an exact sign-flip permutation test over seeds, and Holm's
# correction across every test of a report.


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln) * _betacf(b, a, 1.0 - x) / b


def t_sf2(t: float, df: float) -> float:
    """Two-sided tail P(|T| ≥ |t|) of Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


@lru_cache(maxsize=256)
def t_ppf(q: float, df: float) -> float:
    """The ``q`` quantile (0.5 < q < 1) of Student's t, by bisection on :func:`t_sf2`."""
    if not 0.5 < q < 1.0:
        raise ValueError(f"t_ppf: q={q} must be in (0.5, 1)")
    lo, hi, target = 0.0, 1e6, 2.0 * (1.0 - q)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_sf2(mid, df) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def sign_flip_p(diffs: Sequence[float], n_mc: int = 200_000, seed: int = 0) -> float:
    """Two-sided p of the exact sign-flip permutation test of mean(diffs) = 0: the share of the
    2^S sign patterns (all of them for S ≤ 20, else ``n_mc`` random ones plus the observed) whose
    |mean| is at least the observed one. Exact under symmetry of the per-seed differences."""
    d = torch.tensor(list(diffs), dtype=torch.float64)
    s = d.numel()
    if s == 0:
        raise ValueError("sign_flip_p: no differences")
    obs = d.mean().abs()
    if s <= 20:
        pats = torch.arange(2**s)[:, None].bitwise_right_shift(torch.arange(s)).bitwise_and(1)
        signs = 1.0 - 2.0 * pats.double()  # [2^S, S]
        stats = (signs @ d).abs() / s
        return float((stats >= obs - 1e-12).double().mean())
    g = torch.Generator().manual_seed(seed)
    signs = 1.0 - 2.0 * torch.randint(0, 2, (n_mc, s), generator=g).double()
    stats = (signs @ d).abs() / s
    return float(((stats >= obs - 1e-12).sum() + 1) / (n_mc + 1))


def holm(pvalues: Sequence[float], max_true: Optional[int] = None) -> List[float]:
    """Holm's step-down adjusted p-values (family-wise error control), in the input order.

    ``max_true``: at most this many of the hypotheses can be true together (a logical
    constraint: each comparison's superiority null Δ = 0 and its equivalence null |Δ| ≥ margin
    exclude each other, so a family of m comparisons tested both ways has 2m hypotheses of which
    at most m are true). The multiplier at step j (0-based) is then min(max_true, m − j), the
    number of true nulls possible after any j rejections (Shaffer 1986, method 1); None: Holm."""
    m = len(pvalues)
    cap = m if max_true is None else max(1, min(m, max_true))
    order = sorted(range(m), key=lambda i: pvalues[i])
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, min(cap, m - rank) * pvalues[i]))
        out[i] = running
    return out


EQUIVALENCE_MARGIN = 0.02  # ±2 points of final accuracy: "no practical difference" (v4)
VERDICTS = ("better", "worse", "equivalent", "inconclusive")


def t_sf1(t: float, df: float) -> float:
    """Upper tail P(T ≥ t) of Student's t with ``df`` degrees of freedom."""
    half = 0.5 * t_sf2(t, df)
    return half if t >= 0 else 1.0 - half


def tost_p(mean: float, sd: float, n: int, margin: float = EQUIVALENCE_MARGIN) -> float:
    """p of the two one-sided paired t-tests (TOST) of equivalence within ±``margin``: the larger
    of P(T ≥ (mean + margin)/se) under H0 Δ ≤ −margin and P(T ≤ (mean − margin)/se) under H0
    Δ ≥ +margin, df = n − 1. Rejecting (p < α) says −margin < Δ < margin."""
    if n < 2:
        return 1.0
    if sd == 0:
        return 0.0 if abs(mean) < margin else 1.0
    se = sd / math.sqrt(n)
    p_low = t_sf1((mean + margin) / se, n - 1)  # H0: Δ ≤ −margin
    p_high = t_sf1(-(mean - margin) / se, n - 1)  # H0: Δ ≥ +margin
    return max(p_low, p_high)


@dataclass(frozen=True)
class SeedTest:
    """Subject − comparator per seed: ``diffs`` (in ``seeds`` order), their mean, s.d., the
    t-interval [lo, hi] at ``level``, the t-test p and the exact sign-flip p; ``p_adj`` is the
    Holm-adjusted t-test p once :func:`adjust` has seen every test of the report.

    Why Holm on the t-test's p: the sign-flip test's smallest attainable p is 2/2^S (0.0078 at
    8 seeds), which no Holm threshold over a report's ~20 tests can reach; it is reported beside
    the t-test as the assumption-free check, and a call needs it below ``alpha`` too."""

    comparator: str
    seeds: Tuple[int, ...]
    diffs: Tuple[float, ...]
    mean: float
    sd: float
    lo: float
    hi: float
    p_t: float
    p_perm: float
    p_adj: Optional[float] = None
    # equivalence (v4): TOST at ±margin, its p and its adjustment in the same family as p_adj
    margin: float = EQUIVALENCE_MARGIN
    p_tost: float = float("nan")
    p_tost_adj: Optional[float] = None

    def call(self, alpha: float = 0.05) -> str:
        """win / loss only when the corrected test rejects (and the interval agrees); else tie."""
        p = self.p_adj if self.p_adj is not None else self.p_t
        ok = p < alpha and self.p_perm < alpha
        if ok and self.lo > 0:
            return "win"
        if ok and self.hi < 0:
            return "loss"
        return "tie"

    def verdict(self, alpha: float = 0.05) -> str:
        """The v4 call: ``better`` / ``worse`` when the adjusted superiority p < ``alpha`` and
        the t-interval lies on that side of 0; else ``equivalent`` when the adjusted TOST p <
        ``alpha`` (the difference lies within ±margin); else ``inconclusive`` — never "tie".
        The sign-flip p is reported, not required (its floor 2/2^S is 0.125 at 4 test seeds).
        A difference both significant and within the margin is called by its sign."""
        p = self.p_adj if self.p_adj is not None else self.p_t
        if p < alpha and self.lo > 0:
            return "better"
        if p < alpha and self.hi < 0:
            return "worse"
        q = self.p_tost_adj if self.p_tost_adj is not None else self.p_tost
        if q < alpha:
            return "equivalent"
        return "inconclusive"


def mean_sd(xs: Sequence[float]) -> Tuple[float, float]:
    """(mean, sample s.d.) over seeds; s.d. 0 for one value, (nan, nan) for none."""
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def seed_paired(
    subject: Dict[int, float],
    comparator: Dict[int, float],
    name: str = "",
    level: float = 0.95,
    margin: float = EQUIVALENCE_MARGIN,
) -> Optional[SeedTest]:
    """The paired seed-level test of ``subject`` − ``comparator`` (seed -> score, e.g. final
    accuracy) on the seeds both have, with its TOST p at ±``margin``; None with fewer than 2
    common seeds."""
    common = sorted(set(subject) & set(comparator))
    if len(common) < 2:
        return None
    d = [float(subject[s]) - float(comparator[s]) for s in common]
    n = len(d)
    mean, sd = mean_sd(d)
    half = t_ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    p_t = t_sf2(mean / (sd / math.sqrt(n)), n - 1) if sd > 0 else (1.0 if mean == 0 else 0.0)
    return SeedTest(
        name, tuple(common), tuple(d), mean, sd, mean - half, mean + half, p_t, sign_flip_p(d),
        margin=margin, p_tost=tost_p(mean, sd, n, margin),
    )  # fmt: skip


def adjust(tests: Sequence[Optional[SeedTest]]) -> List[Optional[SeedTest]]:
    """Every test with its Holm-adjusted t-test p over the family ``tests`` (Nones kept)."""
    live = [t for t in tests if t is not None]
    adj = iter(holm([t.p_t for t in live]))
    return [None if t is None else replace(t, p_adj=next(adj)) for t in tests]


def adjust_with_equivalence(tests: Sequence[Optional[SeedTest]]) -> List[Optional[SeedTest]]:
    """Every test with ``p_adj`` (superiority) and ``p_tost_adj`` (equivalence) adjusted in ONE
    family: the 2m hypotheses of the m comparisons, Holm with at most m true together (a
    comparison's Δ = 0 and |Δ| ≥ margin exclude each other: :func:`holm`'s ``max_true``)."""
    live = [t for t in tests if t is not None]
    m = len(live)
    adj = holm([t.p_t for t in live] + [t.p_tost for t in live], max_true=m)
    it = iter(zip(adj[:m], adj[m:]))
    out: List[Optional[SeedTest]] = []
    for t in tests:
        if t is None:
            out.append(None)
            continue
        a, b = next(it)
        out.append(replace(t, p_adj=a, p_tost_adj=b))
    return out


def seed_scores(cells: List[dict], objective: str, mismatch: str, key: str = "acc_end"):
    """seed -> the cell's ``key`` (final held-out accuracy), finished cells only."""
    return {
        c["seed"]: float(c[key])
        for c in cells
        if c["objective"] == objective
        and c["mismatch"] == mismatch
        and c["status"] == "ok"
        and c.get(key) is not None
    }


def best_baseline_bootstrap(
    subject: Dict[int, float],
    baselines: Dict[str, Dict[int, float]],
    n_boot: int = 4000,
    level: float = 0.95,
    seed: int = 0,
) -> Optional[dict]:
    """Subject − the best baseline, the best **re-selected inside every replicate** (seeds drawn
    with replacement; the baseline with the highest mean on the drawn seeds is the comparator of
    that replicate), so the winner's curse of choosing it after the fact is in the interval.
    Returns ``{diff, lo, hi, chosen: {name: share of replicates}}`` on the common seeds."""
    common = sorted(set(subject).intersection(*[set(b) for b in baselines.values()]))
    if len(common) < 2 or not baselines:
        return None
    names = list(baselines)
    sub = torch.tensor([subject[s] for s in common], dtype=torch.float64)
    base = torch.tensor([[baselines[n][s] for s in common] for n in names], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(common), (n_boot, len(common)), generator=g)
    means = base[:, idx].mean(-1)  # [baselines, B]
    best = means.argmax(0)  # [B]
    reps = sub[idx].mean(-1) - means.max(0).values
    q = torch.tensor([(1 - level) / 2, 1 - (1 - level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(reps, q).tolist()
    chosen = {n: float((best == i).double().mean()) for i, n in enumerate(names)}
    diff = float(sub.mean() - base.mean(-1).max())
    return {"diff": diff, "lo": lo, "hi": hi, "chosen": chosen}


def power_paired(delta: float, sd: float, n: int, alpha: float = 0.05, n_sim: int = 20000) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` for a true mean difference
    ``delta`` with per-seed s.d. ``sd`` and ``n`` seeds (simulated, fixed generator)."""
    g = torch.Generator().manual_seed(1)
    x = delta + sd * torch.randn(n_sim, n, generator=g, dtype=torch.float64)
    t = x.mean(-1) / (x.std(-1) / math.sqrt(n))
    return float((t.abs() > t_ppf(1 - alpha / 2, n - 1)).double().mean())


def seeds_for_power(delta: float, sd: float, power: float = 0.8, alpha: float = 0.05) -> int:
    """The fewest seeds (≥ 2) whose paired t-test reaches ``power`` for ``delta`` at ``sd``."""
    n = 2
    while power_paired(delta, sd, n, alpha) < power and n < 1000:
        n += 1
    return n


def power_tost(sd: float, n: int, margin: float, alpha: float = 0.05, n_sim: int = 20000) -> float:
    """Power of the paired TOST at ±``margin`` (both one-sided t-tests at level ``alpha``) when
    the true mean difference is 0 and the per-seed s.d. is ``sd`` with ``n`` seeds (simulated,
    fixed generator)."""
    g = torch.Generator().manual_seed(2)
    x = sd * torch.randn(n_sim, n, generator=g, dtype=torch.float64)
    m, se = x.mean(-1), x.std(-1) / math.sqrt(n)
    crit = t_ppf(1 - alpha, n - 1)
    return float((((m + margin) / se > crit) & ((margin - m) / se > crit)).double().mean())


def seeds_for_equivalence(
    sd: float, margin: float, power: float = 0.8, alpha: float = 0.05, cap: int = 200
) -> int:
    """The fewest seeds (≥ 2) whose TOST at ±``margin`` reaches ``power`` when the arms are truly
    equal and the per-seed s.d. of the difference is ``sd``; ``cap`` when more would be needed."""
    n = 2
    while n < cap and power_tost(sd, n, margin, alpha) < power:
        n += 1
    return n
