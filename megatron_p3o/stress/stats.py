"""Paired comparisons of stress cells: v2's prompt-level bootstrap, then (v3 on) the seed-level
tests every report uses — from scipy.stats and statsmodels where they provide them.

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
import warnings
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import scipy.integrate
import scipy.stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.weightstats import ttost_paired


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
    ta = np.asarray(a, dtype=np.float64)
    tb = np.asarray(b, dtype=np.float64)
    if ta.shape != tb.shape or ta.ndim != 2 or ta.size == 0:
        raise ValueError(f"paired_bootstrap: shapes {ta.shape} and {tb.shape}")
    d = ta - tb  # [S, N]
    s, n = d.shape
    g = np.random.default_rng(seed)
    seeds = g.integers(0, s, (n_boot, s))  # [B, S]
    prompts = g.integers(0, n, (n_boot, s, n))  # [B, S, N]
    reps = d[seeds[..., None], prompts].mean(axis=(1, 2))  # [B]
    lo, hi = np.quantile(reps, [(1 - level) / 2, 1 - (1 - level) / 2]).tolist()
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


# -- seed-level inference (stress study v3 on) ---------------------------------------------------
#
# The unit of inference is the seed: each seed is one independent training run, and the prompts
# scored at its end are not independent replicates of the run (they share its weights). With S
# seeds the two-level bootstrap above makes its interval from S per-seed differences, which at
# S = 3 is about their min–max and covers far less than its nominal 95% (simulated in
# tests/unit/test_stress_stats.py). Below: paired per-seed differences against comparators named
# before the runs, the t-interval and paired t-test (scipy.stats), the exact sign-flip
# permutation test over seeds (scipy.stats.permutation_test), TOST equivalence
# (statsmodels' ttost_paired), Holm's correction (statsmodels' multipletests; the logically
# bounded variant, which statsmodels does not have, is written here and tested against it) and
# the power of both tests (scipy's noncentral t; the TOST's by integration over the s.d.).


def t_ppf(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (scipy.stats.t)."""
    return float(scipy.stats.t.ppf(q, df))


def t_sf2(t: float, df: float) -> float:
    """Two-sided tail P(|T| ≥ |t|) of Student's t with ``df`` degrees of freedom."""
    return float(2.0 * scipy.stats.t.sf(abs(t), df))


def t_sf1(t: float, df: float) -> float:
    """Upper tail P(T ≥ t) of Student's t with ``df`` degrees of freedom."""
    return float(scipy.stats.t.sf(t, df))


def sign_flip_p(diffs: Sequence[float], n_mc: int = 50_000, seed: int = 0) -> float:
    """Two-sided p of the sign-flip permutation test of mean(diffs) = 0
    (``scipy.stats.permutation_test`` with one sample: each sign flipped independently): exact
    over all 2^S patterns for S ≤ 16, else ``n_mc`` random patterns. Exact under symmetry of the
    per-seed differences; its floor is 2/2^S (0.125 at 4 seeds)."""
    d = np.asarray(list(diffs), dtype=np.float64)
    if d.size == 0:
        raise ValueError("sign_flip_p: no differences")
    if not np.any(d):
        return 1.0
    r = scipy.stats.permutation_test(
        (d,),
        lambda x, axis: np.mean(x, axis=axis),
        permutation_type="samples",
        vectorized=True,
        n_resamples=np.inf if d.size <= 16 else n_mc,
        alternative="two-sided",
        rng=np.random.default_rng(seed),
    )
    return float(min(1.0, r.pvalue))


def holm(pvalues: Sequence[float], max_true: Optional[int] = None) -> List[float]:
    """Holm's step-down adjusted p-values (family-wise error control), in the input order.

    ``max_true``: at most this many of the hypotheses can be true together (a logical
    constraint: each comparison's superiority null Δ = 0 and its equivalence null |Δ| ≥ margin
    exclude each other, so a family of m comparisons tested both ways has 2m hypotheses of which
    at most m are true). The multiplier at step j (0-based) is then min(max_true, m − j), the
    number of true nulls possible after any j rejections (Shaffer 1986, method 1): written here
    (statsmodels has no such bound) and equal to statsmodels' Holm when the bound does not bind;
    None: statsmodels' ``multipletests(method="holm")``."""
    m = len(pvalues)
    if m == 0:
        return []
    if max_true is None or max_true >= m:
        return [float(p) for p in multipletests(list(pvalues), method="holm")[1]]
    cap = max(1, max_true)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, min(cap, m - rank) * pvalues[i]))
        out[i] = running
    return out


EQUIVALENCE_MARGIN = 0.02  # ±2 points of final accuracy: "no practical difference" (v4)
VERDICTS = ("better", "worse", "equivalent", "inconclusive")


def tost_p(mean: float, sd: float, n: int, margin: float = EQUIVALENCE_MARGIN) -> float:
    """p of the two one-sided paired t-tests (TOST) of equivalence within ±``margin`` from the
    summary (mean, s.d., n) of the differences: the larger one-sided p, df = n − 1. Rejecting
    (p < α) says −margin < Δ < margin. (:func:`seed_paired` runs statsmodels' ``ttost_paired``
    on the data; this is the same test from a summary, checked against it.)"""
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
    the t-test as the assumption-free check, and a v3 call needs it below ``alpha`` too."""

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
    a = np.asarray(list(xs), dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def seed_paired(
    subject: Dict[int, float],
    comparator: Dict[int, float],
    name: str = "",
    level: float = 0.95,
    margin: float = EQUIVALENCE_MARGIN,
) -> Optional[SeedTest]:
    """The paired seed-level test of ``subject`` − ``comparator`` (seed -> score, e.g. final
    accuracy) on the seeds both have: scipy's paired t-test and its t-interval, statsmodels'
    TOST at ±``margin``, scipy's sign-flip permutation p; None with fewer than 2 common seeds."""
    common = sorted(set(subject) & set(comparator))
    if len(common) < 2:
        return None
    a = np.array([float(subject[s]) for s in common])
    b = np.array([float(comparator[s]) for s in common])
    d = a - b
    mean, sd = mean_sd(d.tolist())
    if sd > 0:
        with warnings.catch_warnings():  # nearly equal differences: scipy warns, the test holds
            warnings.simplefilter("ignore", RuntimeWarning)
            r = scipy.stats.ttest_rel(a, b)
            ci = r.confidence_interval(confidence_level=level)
            p_tost = float(ttost_paired(a, b, -margin, margin)[0])
        p_t, lo, hi = float(r.pvalue), float(ci.low), float(ci.high)
    else:  # every seed the same difference: no spread to test against
        p_t, lo, hi = (1.0 if mean == 0 else 0.0), mean, mean
        p_tost = tost_p(mean, 0.0, len(d), margin)
    return SeedTest(
        name, tuple(common), tuple(d.tolist()), mean, sd, lo, hi, p_t, sign_flip_p(d),
        margin=margin, p_tost=p_tost,
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
        and c.get(key) not in (None, "")
        and math.isfinite(float(c[key]))
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
    sub = np.array([subject[s] for s in common], dtype=np.float64)
    base = np.array([[baselines[n][s] for s in common] for n in names], dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(common), (n_boot, len(common)))
    means = base[:, idx].mean(-1)  # [baselines, B]
    best = means.argmax(0)  # [B]
    reps = sub[idx].mean(-1) - means.max(0)
    lo, hi = np.quantile(reps, [(1 - level) / 2, 1 - (1 - level) / 2]).tolist()
    chosen = {n: float((best == i).mean()) for i, n in enumerate(names)}
    diff = float(sub.mean() - base.mean(-1).max())
    return {"diff": diff, "lo": lo, "hi": hi, "chosen": chosen}


def power_paired(delta: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` for a true mean difference
    ``delta`` with per-seed s.d. ``sd`` and ``n`` seeds: P(|T'| > c) for T' noncentral t with
    n − 1 degrees of freedom and noncentrality delta·√n/sd (scipy.stats.nct, exact; statsmodels'
    TTestPower is the same where it is finite, and NaN from about 100 seeds on)."""
    df, nc = n - 1, delta / sd * math.sqrt(n)
    c = t_ppf(1 - alpha / 2, df)
    p = float(scipy.stats.nct.sf(c, df, nc) + scipy.stats.nct.cdf(-c, df, nc))
    if math.isfinite(p):
        return p
    # scipy's nct gives NaN far out (noncentrality ≳ 40, thousands of seeds): the normal limit
    return float(scipy.stats.norm.sf(c - nc) + scipy.stats.norm.cdf(-c - nc))


def seeds_for_power(
    delta: float, sd: float, power: float = 0.8, alpha: float = 0.05, cap: int = 100_000
) -> int:
    """The fewest seeds (≥ 2) whose paired t-test reaches ``power`` for ``delta`` at ``sd``
    (bisection: the power rises with n); ``cap`` when even that many do not."""
    return fewest_seeds(lambda n: power_paired(delta, max(sd, 1e-12), n, alpha) >= power, cap)


def fewest_seeds(enough, cap: int = 100_000) -> int:
    """The smallest n in [2, cap] with ``enough(n)`` (monotone in n); ``cap`` when none."""
    if enough(2):
        return 2
    if not enough(cap):
        return cap
    lo, hi = 2, cap  # enough(hi), not enough(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if enough(mid):
            hi = mid
        else:
            lo = mid
    return hi


def power_tost(sd: float, n: int, margin: float, alpha: float = 0.05, delta: float = 0.0) -> float:
    """Power of the paired TOST at ±``margin`` (both one-sided t-tests at level ``alpha``) when
    the true mean difference is ``delta`` and the per-seed s.d. is ``sd`` with ``n`` seeds:
    P(|mean − 0| + c·s/√n < margin) integrated over the sample s.d. s (s²(n−1)/sd² ~ χ²(n−1),
    the mean normal and independent of it; c the t quantile). scipy's integrate.quad."""
    df, c = n - 1, t_ppf(1 - alpha, n - 1)
    se = sd / math.sqrt(n)
    norm, chi2 = scipy.stats.norm, scipy.stats.chi2

    def given(v):  # v = s²(n−1)/sd²: the mean must fall in (−margin + c·s/√n, margin − c·s/√n)
        half = margin - c * se * math.sqrt(v / df)
        if half <= 0:
            return 0.0
        return (norm.cdf((half - delta) / se) - norm.cdf((-half - delta) / se)) * chi2.pdf(v, df)

    top = df * (margin / (c * se)) ** 2  # beyond it the acceptance region is empty
    lo, hi = chi2.ppf(1e-13, df), min(top, chi2.isf(1e-13, df))  # where the χ² has its mass
    if hi <= lo:
        return 0.0
    return float(scipy.integrate.quad(given, lo, hi, limit=200, points=[min(df, hi)])[0])


def seeds_for_equivalence(
    sd: float, margin: float, power: float = 0.8, alpha: float = 0.05, cap: int = 100_000
) -> int:
    """The fewest seeds (≥ 2) whose TOST at ±``margin`` reaches ``power`` when the arms are truly
    equal and the per-seed s.d. of the difference is ``sd``; ``cap`` when even that many do
    not."""
    return fewest_seeds(lambda n: power_tost(sd, n, margin, alpha) >= power, cap)
