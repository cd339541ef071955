"""The declared family of a v4-style grid (issue 43): its comparisons paired by seed, adjusted
together (superiority and TOST equivalence in one Holm family), the exploratory rest, and the
seeds a call would need. Split from :mod:`.report`, which re-exports these names."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from megatron_p3o.stress.grid import GridConfig, arm_of
from megatron_p3o.stress.lr_sweep import arm_scores, base_lr, chosen_rates
from megatron_p3o.stress.stats import adjust_with_equivalence, mean_sd, seed_paired


def _spread(scores: Dict[int, float]) -> str:
    xs = list(scores.values())
    if not xs:
        return "—"
    m, sd = mean_sd(xs)
    return f"{m:.3f} ± {sd:.3f} (n={len(xs)})"


def _subject_label(grid: GridConfig) -> Optional[str]:
    from megatron_p3o.stress.plots import _is_p3o

    return next((o for o in grid.objectives if o == "p3o"), None) or next(
        (o for o in grid.objectives if _is_p3o(o)), None
    )


# -- v4: the declared family, TOST equivalence, the lr split ------------------------------------


def _p3o_arm(grid: GridConfig) -> Optional[str]:
    """P3O's arm: its label, or under ``lr_select`` its family (``p3o``)."""
    p3o = _subject_label(grid)
    return None if p3o is None else (arm_of(p3o) if grid.lr_select else p3o)


def v4_tests(grid: GridConfig, cells: List[dict], base_lr=None):
    """``(declared, exploratory)``: rows ``(grid name, setting, arm, comparator, arm's seed
    scores, comparator's, SeedTest or None)``, not yet adjusted. Declared: the grid's
    ``preregistered`` comparisons, in their order. Exploratory: every other arm − P3O on every
    setting where both ran (outside the family: never adjusted with it). Scores are each arm's
    chosen rate on the test seeds under ``lr_select``, else the label's every seed."""
    chosen = chosen_rates(grid, cells, base_lr)
    margin = grid.equivalence_margin

    def row(mm, arm, comp):
        a = arm_scores(grid, cells, arm, mm, chosen)
        b = arm_scores(grid, cells, comp, mm, chosen)
        return (grid.name, mm, arm, comp, a, b, seed_paired(a, b, arm, margin=margin))

    declared = [row(c.setting, c.arm, c.comparator) for c in grid.preregistered]
    named = {(c.setting, frozenset((c.arm, c.comparator))) for c in grid.preregistered}
    p3o = _p3o_arm(grid)
    arms = list(dict.fromkeys(a for a, _ in chosen))
    exploratory = []
    for mm in grid.mismatch:
        for arm in arms:
            if p3o is None or arm == p3o or (mm, frozenset((arm, p3o))) in named:
                continue
            r = row(mm, arm, p3o)
            if r[4] or r[5]:
                exploratory.append(r)
    return declared, exploratory


def adjust_family(rows):
    """The rows with their tests adjusted together (superiority and TOST in one family)."""
    tests = adjust_with_equivalence([r[-1] for r in rows])
    return [(*r[:-1], t) for r, t in zip(rows, tests)]


def _chosen_label(grid: GridConfig, chosen: dict, arm: str, mm: str) -> str:
    """``grpo (lr 3e-4)``: the arm at its chosen rate (the arm alone without ``lr_select``)."""
    if grid.lr_select is None:
        return arm
    lab = chosen.get((arm, mm))
    return f"{arm} (lr {lab.split('@lr', 1)[1]})" if lab and "@lr" in lab else str(lab or arm)


V4_HEADER = [
    "| setting | arm − comparator | arm | comparator | per-seed differences | "
    "Δ [95% t-CI] | p (t) | p Holm | p TOST | p TOST Holm | p sign-flip | call |",
    "|---" * 12 + "|",
]


def v4_row(r, adjusted: bool = True, labels=None) -> str:
    """One line of the v4 table (``labels``: what to print for the arm and the comparator)."""
    _, mm, arm, comp, a, b, t = r
    what = " − ".join(labels or (arm, comp))
    if t is None:
        return f"| {mm} | {what} | {_spread(a)} | {_spread(b)} |" + " — |" * 8
    per = ", ".join(f"{d:+.3f}" for d in t.diffs)
    if adjusted:
        adj, tadj, call = f"{t.p_adj:.3g}", f"{t.p_tost_adj:.3g}", f"**{t.verdict()}**"
    else:
        adj, tadj, call = "—", "—", f"{t.verdict()} (exploratory)"
    return (
        f"| {mm} | {what} | {_spread(a)} | {_spread(b)} | {per} | "
        f"{t.mean:+.3f} [{t.lo:+.3f}, {t.hi:+.3f}] | {t.p_t:.3g} | {adj} | {t.p_tost:.3g} | "
        f"{tadj} | {t.p_perm:.3g} | {call} |"
    )


def v4_headline(grid: GridConfig, cells: List[dict], base_lr=None) -> Tuple[List[str], List[str]]:
    """The v4 headline of one grid: its declared comparisons (Holm over this grid's family:
    the study summary adjusts over every grid's) and the exploratory rest."""
    declared, exploratory = v4_tests(grid, cells, base_lr)
    declared = adjust_family(declared)
    chosen = chosen_rates(grid, cells, base_lr)

    def labels(r):
        return _chosen_label(grid, chosen, r[2], r[1]), _chosen_label(grid, chosen, r[3], r[1])

    margin = grid.equivalence_margin
    n = sum(r[-1] is not None for r in declared)
    lines = [
        f"Declared before the runs: {len(grid.preregistered)} comparisons (`preregistered:` in "
        f"the grid file); {n} testable. Holm over their {2 * n} hypotheses (superiority "
        f"Δ = 0 and TOST equivalence |Δ| ≥ {margin:g}, at most one of each pair true) within "
        "this grid; the study summary adjusts over every grid's declared comparisons.",
        "",
        *V4_HEADER,
        *[v4_row(r, True, labels(r)) for r in declared],
    ]
    if exploratory:
        lines += [
            "",
            "Exploratory (not declared, outside the family; p unadjusted, calls not claims):",
            "",
            *V4_HEADER,
            *[v4_row(r, False, labels(r)) for r in exploratory],
        ]
    said: Dict[str, List[str]] = defaultdict(list)
    for _, mm, arm, comp, _, _, t in declared:
        if t is not None:
            said[t.verdict()].append(f"{mm}: {arm} − {comp} {t.mean:+.3f}")
    text = [
        f"- {n} declared comparisons; `better`/`worse` need the Holm-adjusted t-test p < 0.05 "
        f"and the interval on that side of 0; `equivalent` needs the Holm-adjusted TOST p < 0.05 "
        f"(Δ within ±{margin:g}); anything else is `inconclusive` (not evidence of no difference)."
    ]
    for v in ("better", "worse", "equivalent", "inconclusive"):
        if said[v]:
            text.append(f"- {v} ({len(said[v])}): " + "; ".join(said[v]) + ".")
    return lines, text


def power_section(grid: GridConfig, cells: List[dict], delta: float = 0.05) -> List[str]:
    """Per setting: the median seed s.d. of its declared paired differences and the test seeds
    a call would need — 80% power for a true gap of ``delta`` (superiority) and for the TOST at
    the grid's margin when the arms are truly equal — at α 0.05 and at α 0.05/m (the first Holm
    step over the family's m comparisons, a lower bound of what the corrected test needs)."""
    from megatron_p3o.stress.stats import seeds_for_equivalence, seeds_for_power

    rows = [r for r in v4_tests(grid, cells, base_lr(grid))[0] if r[-1] is not None]
    if not rows:
        return []
    m, margin = len(rows), grid.equivalence_margin
    n = len(grid.lr_select.test_seeds) if grid.lr_select else len(grid.seeds)
    lines = [
        f"### Seeds a call would need (the family's m = {m}; {n} test seeds ran)",
        "",
        f"| setting | median paired s.d. | superiority Δ = {delta:g}: α 0.05 | α 0.05/m | "
        f"equivalence ±{margin:g}: α 0.05 | α 0.05/m |",
        "|---" * 6 + "|",
    ]
    for mm in grid.mismatch:
        sds = [r[-1].sd for r in rows if r[1] == mm]
        if not sds:
            continue
        sd = max(statistics.median(sds), 1e-6)  # the middle two averaged for an even count
        cells_ = [
            seeds_for_power(delta, sd),
            seeds_for_power(delta, sd, alpha=0.05 / m),
            seeds_for_equivalence(sd, margin),
            seeds_for_equivalence(sd, margin, alpha=0.05 / m),
        ]
        lines.append(f"| {mm} | {sd:.3f} | " + " | ".join(map(str, cells_)) + " |")
    return lines
