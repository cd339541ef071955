"""Sequential seeds (stress study v5): repeated confidence intervals over pre-registered looks,
so that a study adds seeds only where a declared comparison is still undecided and still keeps
its promised error rate.

The method. Each declared comparison d = arm − comparator (paired per seed) is looked at after
the first n_1 < n_2 < … < n_K seeds of a fixed seed order. Its error α/m (m the declared
comparisons: Bonferroni over the family) is split over the looks by an **error-spending
function** (Lan & DeMets 1983, Biometrika 70:659–663; the default Hwang, Shih & DeCani 1990,
Stat Med 9:1439–1445, γ = −2, which keeps most of it for the last looks): look k gets
a_k = (α/m)·(f(t_k) − f(t_{k−1})), t_k = n_k/n_K. At look k the comparison's **repeated
confidence interval** (Jennison & Turnbull 1989, JRSS B 51:305–361) is the paired t-interval at
level 1 − a_k: mean ± t_{1−a_k/2, n_k−1} · s/√n_k. By the union bound over looks it covers the
true difference at every look at once with probability ≥ 1 − α/m — exactly, for normal per-seed
differences, whatever the dependence between looks and whatever the rule for stopping — so one
interval gives every call:

- **better** / **worse**: the interval lies above / below 0;
- **equivalent**: it lies inside (−margin, +margin) (a difference both significant and within
  the margin is called by its sign, as in v4);
- else **undecided**, and at the last look **undecided at cap**.

A wrong call (better or worse when the true Δ is 0 or of the other sign, equivalent when |Δ| ≥
margin) needs its interval to miss the true Δ at some look, so P(any wrong call in the family) ≤
m · α/m = α. (Why not the tighter group-sequential boundary computed for z statistics and turned
into t quantiles look by look, Jennison & Turnbull 2000 §3.7: its intervals are only 1–2%
narrower at these seed counts, and with t statistics at 8–40 seeds its study-wide error came out
at 0.051 [0.043, 0.061] in 2,400 simulated studies of independent comparisons; the union bound
has none of that approximation.) ``tests/unit/test_stress_v5_sequential.py`` checks the
intervals against scipy's and the study-wide error by simulation.

``p_adjusted`` of a call is its **repeated p-value**: the smallest study-wide α at which that
look's interval would have made the call (Bonferroni's m and the look's share included):
m · P(|T_{n−1}| ≥ t) / w_k, with t = |mean|/se for better/worse and (margin − |mean|)/se for
equivalent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import scipy.stats

CALLS = ("better", "worse", "equivalent", "undecided")


def spent(t: float, alpha: float, kind: str = "hsd", gamma: float = -2.0) -> float:
    """The error α(t) spent by information fraction ``t`` (0 → 0, 1 → alpha).

    ``hsd``: Hwang–Shih–DeCani, α(1 − e^{−γt})/(1 − e^{−γ}) (γ = 0: αt; γ < 0 spends late);
    ``obf``: Lan–DeMets O'Brien–Fleming type, 2 − 2Φ(z_{1−α/2}/√t);
    ``pocock``: Lan–DeMets Pocock type, α·ln(1 + (e − 1)t)."""
    t = min(max(float(t), 0.0), 1.0)
    if t == 0.0:
        return 0.0
    if kind == "obf":
        return float(2.0 * scipy.stats.norm.sf(scipy.stats.norm.isf(alpha / 2) / math.sqrt(t)))
    if kind == "pocock":
        return alpha * math.log(1.0 + (math.e - 1.0) * t)
    if kind == "hsd":
        if gamma == 0:
            return alpha * t
        return alpha * (-math.expm1(-gamma * t)) / (-math.expm1(-gamma))
    raise ValueError(f"spending {kind!r}: one of hsd, obf, pocock")


def shares(looks: Sequence[int], kind: str = "hsd", gamma: float = -2.0) -> Tuple[float, ...]:
    """w_k: the share of a comparison's error spent at each look (sum 1), the spending function's
    increments at the information fractions n_k/n_K (computed at α = 0.05 for ``obf``, whose
    shape depends on α; the others scale with α)."""
    cum = [spent(n / looks[-1], 0.05, kind, gamma) / 0.05 for n in looks]
    return tuple(float(x) for x in np.diff([0.0] + cum))


@dataclass(frozen=True)
class Design:
    """The pre-registered design: ``looks`` (seeds at each look), ``alpha`` over the family of
    ``m`` comparisons (α/m each), the spending function, the equivalence ``margin``."""

    looks: Tuple[int, ...]
    alpha: float
    m: int
    margin: float
    spending: str = "hsd"
    gamma: float = -2.0

    @property
    def shares(self) -> Tuple[float, ...]:
        return shares(self.looks, self.spending, self.gamma)

    def level(self, k: int, each: Optional[float] = None) -> float:
        """Look ``k``'s (0-based) error: its share of the per-comparison α/m (or ``each``)."""
        return (self.alpha / self.m if each is None else each) * self.shares[k]

    def t_crit(self, k: int, n: Optional[int] = None, each: Optional[float] = None) -> float:
        """Look ``k``'s interval constant for ``n`` pairs (default the look's seeds): the t
        quantile 1 − a_k/2 with n − 1 degrees of freedom (scipy)."""
        n = self.looks[k] if n is None else n
        a = self.level(k, each)
        return math.inf if a <= 0 else float(scipy.stats.t.isf(a / 2, n - 1))


@dataclass(frozen=True)
class Call:
    """One declared comparison's outcome: its ``look`` (1-based; the last look when undecided),
    the pairs used, Δ with its repeated CI, the repeated p-value of the call, the call, and for an
    undecided comparison the seeds a fixed-sample test at its level would need."""

    setting: str
    arm: str
    comparator: str
    look: int
    n: int
    delta: float
    lo: float
    hi: float
    p_adjusted: float
    call: str
    final: bool  # decided, or the cap reached (no look left)
    seeds_needed: Optional[int] = None

    @property
    def label(self) -> str:
        return "undecided at cap" if self.call == "undecided" and self.final else self.call


def rci(d: Sequence[float], design: Design, k: int) -> Tuple[float, float, float, float]:
    """(mean, s.d., lo, hi) of the differences ``d`` at look ``k`` (0-based)."""
    x = np.asarray(d, dtype=np.float64)
    n = x.size
    mean = float(x.mean())
    sd = float(x.std(ddof=1)) if n > 1 else math.inf
    half = design.t_crit(k, n) * sd / math.sqrt(n)
    return mean, sd, mean - half, mean + half


def verdict(lo: float, hi: float, margin: float) -> str:
    if lo > 0:
        return "better"
    if hi < 0:
        return "worse"
    if -margin < lo and hi < margin:
        return "equivalent"
    return "undecided"


def repeated_p(design: Design, k: int, n: int, t_needed: float) -> float:
    """The smallest study-wide α at which look ``k``'s interval constant is at most
    ``t_needed`` (the call's |t|: mean/se for better/worse, (margin − |mean|)/se for
    equivalent): m · P(|T_{n−1}| ≥ t_needed) / w_k, at most 1."""
    if not t_needed > 0:
        return 1.0
    w = design.shares[k]
    if w <= 0:
        return 1.0
    tail = 2.0 * float(scipy.stats.t.sf(t_needed, n - 1)) if math.isfinite(t_needed) else 0.0
    return min(1.0, design.m * tail / w)


def decide(
    d_by_look: Sequence[Optional[Sequence[float]]],
    design: Design,
    setting: str,
    arm: str,
    comparator: str,
) -> Optional[Call]:
    """The comparison's call from its differences at each look so far (``d_by_look[k]``: the
    paired differences on look k's seeds, None when look k has not run): the first look whose
    interval decides; ``final`` when decided or at the last look. None before the first look."""
    call = None
    for k, d in enumerate(d_by_look):
        if d is None:
            break
        last = k == len(design.looks) - 1
        if len(d) < 3:  # too few pairs (failed cells): no interval at this look
            call = Call(setting, arm, comparator, k + 1, len(d), math.nan, math.nan, math.nan,
                        1.0, "undecided", last)  # fmt: skip
            continue
        mean, sd, lo, hi = rci(d, design, k)
        v = verdict(lo, hi, design.margin)
        se = sd / math.sqrt(len(d)) if sd > 0 else 0.0
        if v == "equivalent":
            need = (design.margin - abs(mean)) / se if se else math.inf
        else:
            need = abs(mean) / se if se else (math.inf if mean else 0.0)
        p = repeated_p(design, k, len(d), need)
        call = Call(setting, arm, comparator, k + 1, len(d), mean, lo, hi, p, v,
                    v != "undecided" or last)  # fmt: skip
        if v != "undecided":
            return call
        if last:
            return _with_needs(call, sd, design)
    return call


def _with_needs(call: Call, sd: float, design: Design) -> Call:
    """An undecided comparison at the cap: the seeds a fixed-sample test at its level (α/m) would
    need for 80% power — superiority at the observed Δ when |Δ| ≥ margin/2, else equivalence at
    the margin for the observed Δ."""
    from dataclasses import replace

    from megatron_p3o.stress.stats import fewest_seeds, power_paired, power_tost

    each = design.alpha / design.m
    if not (math.isfinite(sd) and sd > 0):
        return call
    delta, margin = call.delta, design.margin
    if abs(delta) >= margin / 2:
        n = fewest_seeds(lambda n: power_paired(abs(delta), sd, n, each) >= 0.8)
    else:
        n = fewest_seeds(lambda n: power_tost(sd, n, margin, each, delta) >= 0.8)
    return replace(call, seeds_needed=n)


# -- simulation: the design's error rate, power and cost, vectorised --------------------------


def simulate(
    design: Design,
    deltas: Sequence[float],
    sds: Sequence[float],
    groups: Sequence[int],
    rho: float = 0.5,
    n_sim: int = 2000,
    seed: int = 0,
    keep: bool = False,
) -> Dict[str, np.ndarray]:
    """``n_sim`` simulated studies of the design: comparison j has true difference
    ``deltas[j]`` and per-seed s.d. ``sds[j]``; comparisons of one ``groups`` value (a setting)
    share the comparator's seeds, so their differences correlate by ``rho`` (0.5: the arms'
    and P3O's seed spreads equal). Per-seed differences are normal. Returns ``call`` [n_sim, m]
    (index into :data:`CALLS`, 3 = undecided at the cap) and ``look`` [n_sim, m] (1-based look of
    the call, K when undecided), from the same interval rule as :func:`decide`; with ``keep`` also
    the differences ``x`` [n_sim, m, seeds] (for a test)."""
    deltas, sds = np.asarray(deltas, float), np.asarray(sds, float)
    _, gi = np.unique(np.asarray(groups), return_inverse=True)
    m, looks = sds.size, design.looks
    per_sim = np.broadcast_to(deltas, (n_sim, m))  # one true difference per study and comparison
    g = np.random.default_rng(seed)
    crit = [design.t_crit(k, n) for k, n in enumerate(looks)]
    calls, at, xs = [], [], []
    for start in range(0, n_sim, 500):  # chunks: [500, m, N] normals at a time
        s = min(500, n_sim - start)
        shared = g.standard_normal((s, gi.max() + 1, looks[-1]))[:, gi, :]
        own = g.standard_normal((s, m, looks[-1]))
        x = per_sim[start : start + s, :, None] + sds[None, :, None] * (
            math.sqrt(rho) * shared + math.sqrt(1.0 - rho) * own
        )
        c1, c2 = np.cumsum(x, -1), np.cumsum(x * x, -1)
        call = np.full((s, m), 3)
        look = np.full((s, m), len(looks))
        open_ = np.ones((s, m), bool)
        for k, n in enumerate(looks):
            mean = c1[..., n - 1] / n
            var = np.maximum(c2[..., n - 1] - n * mean * mean, 0.0) / (n - 1)
            half = crit[k] * np.sqrt(var / n)
            lo, hi = mean - half, mean + half
            inside = (lo > -design.margin) & (hi < design.margin)
            v = np.select([lo > 0, hi < 0, inside], [0, 1, 2], 3)
            now = open_ & (v < 3)
            call[now], look[now] = v[now], k + 1
            open_ &= ~now
        calls.append(call)
        at.append(look)
        xs += [x] if keep else []
    out = {"call": np.concatenate(calls), "look": np.concatenate(at)}
    return {**out, "x": np.concatenate(xs)} if keep else out


def wrong(call: np.ndarray, deltas: Sequence[float], margin: float) -> np.ndarray:
    """[n_sim, m] bool: the calls that are errors for the true differences — better when Δ ≤ 0,
    worse when Δ ≥ 0, equivalent when |Δ| ≥ margin."""
    d = np.asarray(deltas, float)
    d = d[None, :] if d.ndim == 1 else d
    return ((call == 0) & (d <= 0)) | ((call == 1) & (d >= 0)) | ((call == 2) & (abs(d) >= margin))


def binomial_ci(k: int, n: int, level: float = 0.95) -> Tuple[float, float]:
    """Clopper–Pearson interval of a Monte-Carlo proportion (scipy's binomtest)."""
    ci = scipy.stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=level)
    return float(ci.low), float(ci.high)
