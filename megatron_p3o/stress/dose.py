"""Dose–response in a stress grid: each objective's accuracy along each mismatch axis, and its
break point.

A grid's mismatch settings of one ``family`` are the levels of one axis (engine logit noise σ,
staleness K, epochs of reuse, …); the setting of family ``baseline`` is every axis's control
(the first setting when there is none). For each objective and axis, every level is compared
with the objective's *own* control, paired by seed (level − control); all these tests of a
report form one Holm family. The **break point** is the first level, in order of distance from
the control, whose corrected test calls a loss. An axis whose control sits at a non-zero level
(engine temperature: the trainer's 1.0) is ordered by ``|level − neutral|``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megatron_p3o.stress.grid import GridConfig, control_setting, family_label
from megatron_p3o.stress.plots import _legend
from megatron_p3o.stress.stats import adjust, mean_sd, seed_paired, seed_scores, t_ppf

# the control's level on axes whose neutral point is not 0 (engine / trainer temperature ratio)
NEUTRAL = {"engine_temperature": 1.0}


def axes(grid: GridConfig) -> Dict[str, List[str]]:
    """axis (family) -> its settings ordered by distance from the control's level."""
    control = control_setting(grid)
    out: Dict[str, List[str]] = {}
    for k, m in grid.mismatch.items():
        if k != control and m.family != "baseline":
            out.setdefault(m.family, []).append(k)
    for fam, ks in out.items():
        neutral = NEUTRAL.get(fam, 0.0)
        ks.sort(key=lambda k: abs(grid.mismatch[k].level - neutral))
    return out


def break_points(grid: GridConfig, cells: List[dict]):
    """``(rows, points)``: rows ``(axis, objective, setting, SeedTest or None)`` Holm-adjusted over
    all of them; points ``{(axis, objective): setting or None}`` (None: no level broke it)."""
    control = control_setting(grid)
    keys, tests = [], []
    for fam, levels in axes(grid).items():
        for obj in grid.objectives:
            base = seed_scores(cells, obj, control)
            for mm in levels:
                keys.append((fam, obj, mm))
                tests.append(seed_paired(seed_scores(cells, obj, mm), base, obj))
    tests = adjust(tests)
    rows = [(*k, t) for k, t in zip(keys, tests)]
    points: Dict[Tuple[str, str], Optional[str]] = {}
    for fam, obj, mm, t in rows:
        points.setdefault((fam, obj), None)
        if points[(fam, obj)] is None and t is not None and t.call() == "loss":
            points[(fam, obj)] = mm
    return rows, points


def dose_section(grid: GridConfig, cells: List[dict]) -> List[str]:
    """Markdown: per axis, each objective's level − control differences and its break point."""
    ax = axes(grid)
    if not ax:
        return []
    rows, points = break_points(grid, cells)
    n = sum(t is not None for *_, t in rows)
    control = control_setting(grid)
    lines = [
        "## Dose–response: break points",
        "",
        f"Each level − the objective's own control `{control}`, final held-out accuracy paired by "
        f"seed: mean Δ [95% t-CI], Holm over these {n} tests; **break point** = the first level "
        "(nearest the control first) with a corrected loss.",
        "",
    ]
    by = {(f, o, m): t for f, o, m, t in rows}
    for fam, levels in ax.items():
        lines += [
            f"**{family_label(grid, fam)}**",
            "",
            "| objective | control | " + " | ".join(levels) + " | break point |",
            "|---" * (len(levels) + 3) + "|",
        ]
        for obj in grid.objectives:
            base = list(seed_scores(cells, obj, control).values())
            cols = [f"{sum(base) / len(base):.3f}" if base else "—"]
            for mm in levels:
                t = by[(fam, obj, mm)]
                if t is None:
                    cols.append("—")
                    continue
                s = f"{t.mean:+.3f} [{t.lo:+.3f}, {t.hi:+.3f}]"
                cols.append(f"**{s}**" if t.call() == "loss" else s)
            bp = points.get((fam, obj))
            cols.append(f"{grid.mismatch[bp].level:g}" if bp else "none")
            lines.append(f"| {obj} | " + " | ".join(cols) + " |")
        lines.append("")
    return lines


def _ci(xs: List[float]) -> Tuple[float, float]:
    """(mean, half-width of the 95% t-interval) over seeds."""
    m, sd = mean_sd(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, t_ppf(0.975, len(xs) - 1) * sd / math.sqrt(len(xs))


def plot_dose(out: Path, grid: GridConfig, cells: List[dict]) -> Optional[Path]:
    """Final accuracy vs level per objective, one panel per axis, with 95% seed t-intervals; the
    control drawn at each axis's neutral level."""
    ax_levels = axes(grid)
    if not ax_levels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_p3o.stress.plots import _save

    control = control_setting(grid)
    fig, panels = plt.subplots(
        1, len(ax_levels), figsize=(4.6 * len(ax_levels), 3.8), squeeze=False, sharey=True
    )
    for ax, (fam, levels) in zip(panels[0], ax_levels.items()):
        neutral = NEUTRAL.get(fam, 0.0)
        for obj in grid.objectives:
            pts = []
            for mm in [control] + levels:
                xs = list(seed_scores(cells, obj, mm).values())
                if xs:
                    lvl = neutral if mm == control else grid.mismatch[mm].level
                    pts.append((lvl, *_ci(xs)))
            if not pts:
                continue
            pts.sort()
            ax.errorbar(
                [p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts],
                marker="o", ms=3.5, capsize=2, lw=2.2 if obj.startswith("p3o") else 1, label=obj,
            )  # fmt: skip
        if fam in ("staleness", "reuse_epochs", "reuse_minibatches"):
            ax.set_xscale("symlog", linthresh=1)
        ax.set_title(fam)
        ax.set_xlabel("level (control at %g)" % neutral)
        ax.set_ylabel("final held-out accuracy")
        ax.grid(alpha=0.3)
    _legend(panels[0][0], fontsize=7, ncol=2)
    return _save(
        fig,
        out / "dose_response.png",
        f"{grid.name}: accuracy vs dose (95% t-intervals over {len(grid.seeds)} seeds)",
    )
