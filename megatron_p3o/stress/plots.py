"""The stress report's figures (matplotlib PNGs): learning curves, the ratio histogram,
final accuracy against the mismatch level and against the measured mismatch; ``_save`` is
the one writer every stress section uses (report, dose, long runs)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megatron_p3o.observability.metrics import COARSE_HIST_RANGE
from megatron_p3o.stress.grid import GridConfig
from megatron_p3o.stress.stats import (
    seed_paired,
    seed_scores,
)


def _save(fig, path: Path, title: str = "") -> Path:
    """Title (wrapped to the figure's width: a one-panel figure cut it off), layout, PNG at 110
    dpi, figure closed."""
    import textwrap

    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(textwrap.fill(title, width=max(30, int(fig.get_figwidth() * 9))))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finite(xs):
    return [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


def _stats(xs) -> Tuple[float, float, float]:
    xs = _finite(xs)
    if not xs:
        return float("nan"), float("nan"), float("nan")
    return sum(xs) / len(xs), min(xs), max(xs)


def _smooth(ys: List[float], k: int = 5) -> List[float]:
    return [
        sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1])
        for i in range(len(ys))
    ]


def _mean_curves(
    steps: Dict[str, List[dict]], cells: List[dict], key: str
) -> Dict[Tuple[str, str], List[float]]:
    """(objective, mismatch) -> per-step mean of ``key`` over seeds."""
    by: Dict[Tuple[str, str], List[List[float]]] = defaultdict(list)
    for c in cells:
        ys = [m.get(key, float("nan")) for m in steps.get(c["cell"], [])]
        if ys:
            by[(c["objective"], c["mismatch"])].append(ys)
    out = {}
    for k, runs in by.items():
        n = min(len(r) for r in runs)
        out[k] = [sum(r[i] for r in runs) / len(runs) for i in range(n)]
    return out


def plot_curves(
    out: Path,
    grid: GridConfig,
    cells: List[dict],
    steps: Dict[str, List[dict]],
    key: str,
    ylabel: str,
    fname: str,
    smooth: int = 5,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mms = list(grid.mismatch)
    ncol = min(3, len(mms))
    nrow = math.ceil(len(mms) / ncol)
    fig, axes = plt.subplots(
        nrow, ncol, figsize=(max(8, 5 * ncol), 3.4 * nrow), squeeze=False, sharey=True
    )
    curves = _mean_curves(steps, cells, key)
    for i, mm in enumerate(mms):
        ax = axes[i // ncol][i % ncol]
        for obj in grid.objectives:
            ys = curves.get((obj, mm))
            if ys:
                ax.plot(
                    range(1, len(ys) + 1),
                    _smooth(ys, smooth),
                    label=obj,
                    lw=2.2 if obj.startswith("p3o") else 1.2,
                )
        ax.set_title(mm)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for j in range(len(mms), nrow * ncol):
        axes[j // ncol][j % ncol].axis("off")
    _legend(axes[0][0], fontsize=7, ncol=2)
    title = f"{grid.name}: {ylabel} (mean over seeds, {smooth}-step moving average)"
    return _save(fig, out / fname, title)


def plot_ratio_hist(
    out: Path, grid: GridConfig, cells: List[dict], steps: Dict[str, List[dict]]
) -> Path:
    """log ρ = ℓθ − ℓb over all tokens of all steps, one line per mismatch setting (P3O cells, or
    the first objective)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    obj = next((o for o in grid.objectives if o.startswith("p3o")), next(iter(grid.objectives)))
    fig, ax = plt.subplots(figsize=(7, 4))
    for mm in grid.mismatch:
        tot = None
        for c in cells:
            if c["objective"] != obj or c["mismatch"] != mm:
                continue
            for m in steps.get(c["cell"], []):
                h = m.get("log_ratio_hist") or []
                tot = h if tot is None else [a + b for a, b in zip(tot, h)]
        if tot and sum(tot) > 0:
            n = len(tot)
            r = COARSE_HIST_RANGE
            xs = [-r + (i + 0.5) * 2 * r / n for i in range(n)]
            ax.step(xs, [v / sum(tot) for v in tot], where="mid", label=mm)
    ax.set_yscale("log")
    ax.set_xlabel(f"log ρ = ℓθ − ℓb (end bins hold everything beyond ±{COARSE_HIST_RANGE:g})")
    ax.set_ylabel("fraction of tokens")
    ax.set_title(f"{grid.name}: train/rollout log-ratio, objective {obj}")
    _legend(ax, fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out / "ratio_hist.png")


def plot_final_vs_level(out: Path, grid: GridConfig, cells: List[dict]) -> Path:
    """Final held-out accuracy vs mismatch level, one panel per family (the baseline is level 0
    of every panel); markers at the seed mean, bars spanning min–max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base, fams = _families(grid)
    fig, axes = plt.subplots(
        1, len(fams), figsize=(max(8, 4.5 * len(fams)), 3.8), squeeze=False, sharey=True
    )
    for ax, fam in zip(axes[0], fams):
        members = base + [
            k for k, m in grid.mismatch.items() if m.family == fam and fam != "baseline"
        ]
        for j, obj in enumerate(grid.objectives):
            pts = []
            for mm in members:
                accs = [
                    c["acc_end"] for c in cells if c["objective"] == obj and c["mismatch"] == mm
                ]
                mean, lo, hi = _stats(accs)
                if math.isfinite(mean):
                    pts.append((grid.mismatch[mm].level if mm not in base else 0.0, mean, lo, hi))
            if not pts:
                continue
            pts.sort()
            dx = (j - len(grid.objectives) / 2) * 0.004 * max(1e-9, max(p[0] for p in pts) or 1)
            ax.errorbar(
                [p[0] + dx for p in pts],
                [p[1] for p in pts],
                yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                marker="o",
                ms=4,
                capsize=2,
                lw=2.2 if obj.startswith("p3o") else 1,
                label=obj,
            )
        ax.set_title(fam)
        ax.set_xlabel("mismatch level")
        ax.set_ylabel("final held-out accuracy")
        ax.grid(alpha=0.3)
    _legend(axes[0][0], fontsize=7, ncol=2)
    return _save(
        fig,
        out / "final_acc_vs_mismatch.png",
        f"{grid.name}: final accuracy vs mismatch (bars: min–max over seeds)",
    )


_STYLES = ("-", "--", ":", "-.")
_CALL_MARK = {"better": ("^", "better"), "worse": ("v", "worse"), "equivalent": ("D", "equiv.")}


def arm_styles(grid: GridConfig) -> Dict[str, Tuple[str, str]]:
    """label -> (colour, line style): one colour per arm (the label before ``@``: tab10, then
    tab20 for more arms), one line style per learning rate (solid for the lowest), so that no
    two labels look alike."""
    import matplotlib

    from megatron_p3o.stress.grid import arm_of
    from megatron_p3o.stress.lr_sweep import label_rate

    arms = list(dict.fromkeys(arm_of(k) for k in grid.objectives))
    cmap = matplotlib.colormaps["tab10" if len(arms) <= 10 else "tab20"]
    colour = {a: matplotlib.colors.to_hex(cmap(i)) for i, a in enumerate(arms)}
    rates = sorted({float(r) for k in grid.objectives if (r := label_rate(grid, k)) is not None})
    style = {r: _STYLES[i % len(_STYLES)] for i, r in enumerate(rates)}
    out = {}
    for k in grid.objectives:
        r = label_rate(grid, k)
        out[k] = (colour[arm_of(k)], style.get(float(r), "-") if r is not None else "-")
    return out


def _legend(ax, **kw) -> None:
    """A legend only when something is labelled (matplotlib warns on an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def plot_acc_vs_measured(
    out: Path, grid: GridConfig, cells: List[dict], marks: Optional[Dict] = None
) -> Path:
    """Final accuracy (the grid's endpoint) against the *measured* mismatch (mean |ℓθ − ℓb| over
    the run's optimizer steps), one panel per family (its levels plus the baseline setting), one
    line per objective label — one colour per arm, one line style per learning rate — with 95%
    t-interval bands over seeds; ``marks`` ({(label, setting): call}) draws the declared calls
    on the arm's point (▲ better, ▼ worse, ◆ equivalent, against P3O)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    marks = marks or {}
    styles = arm_styles(grid)
    key = grid.endpoint
    base, fams = _families(grid)
    ncol = min(3, len(fams))
    nrow = math.ceil(len(fams) / ncol)
    fig, axes = plt.subplots(
        nrow, ncol, figsize=(5.2 * ncol, 3.9 * nrow), squeeze=False, sharey=True
    )
    for k, fam in enumerate(fams):
        ax = axes[k // ncol][k % ncol]
        members = base + [m for m, v in grid.mismatch.items() if v.family == fam != "baseline"]
        for obj in grid.objectives:
            pts = []
            for mm in members:
                mine = [c for c in cells if c["objective"] == obj]
                x = _mean_of(mine, mm, "abs_diff_run")
                sc = seed_scores(cells, obj, mm, key)
                ci = seed_paired(sc, {s: 0.0 for s in sc}) if math.isfinite(x) else None
                if ci is None:  # fewer than 2 seeds: no interval to draw
                    continue
                pts.append((x, ci.mean, ci.lo, ci.hi, marks.get((obj, mm))))
            if not pts:
                continue
            pts.sort(key=lambda p: p[0])
            xs = [p[0] for p in pts]
            colour, ls = styles[obj]
            ax.plot(xs, [p[1] for p in pts], marker="o", ms=3.5, color=colour, ls=ls,
                    lw=2.2 if _is_p3o(obj) else 1.2, label=obj)  # fmt: skip
            ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts], alpha=0.08,
                            color=colour)  # fmt: skip
            for x, y, _, _, call in pts:
                if call in _CALL_MARK:
                    ax.plot([x], [y], marker=_CALL_MARK[call][0], ms=10, color=colour,
                            mec="black", mew=0.8, ls="none")  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"{fam} (+ {', '.join(base)})" if base else fam)
        ax.set_xlabel("measured mean |ℓθ − ℓb| over the run (nats)")
        ax.set_ylabel("held-out accuracy, " + ("endpoint mean" if key != "acc_end" else "final"))
        ax.grid(alpha=0.3)
    for j in range(len(fams), nrow * ncol):
        axes[j // ncol][j % ncol].axis("off")
    seen = {}  # every panel's labels once (a label may be drawn in some panels only)
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if marks:
        from matplotlib.lines import Line2D

        for m, t in _CALL_MARK.values():
            seen[f"{t} vs P3O (declared call)"] = Line2D(
                [], [], marker=m, ls="none", color="grey", mec="black", ms=8
            )
    if seen:  # in a free panel when there is one, else in the first
        free = len(fams) < nrow * ncol
        where = axes[-1][-1] if free else axes[0][0]
        where.legend(list(seen.values()), list(seen), fontsize=7, ncol=2,
                     loc="center" if free else "best")  # fmt: skip
    return _save(
        fig,
        out / "acc_vs_measured_mismatch.png",
        f"{grid.name}: accuracy vs measured mismatch (one colour per arm, one line style per "
        "learning rate; bands: 95% t-CI over seeds; large markers: the declared calls)",
    )


def _families(grid: GridConfig) -> Tuple[List[str], List[str]]:
    """(the baseline settings, the other families in grid order — or just "baseline"): one
    panel per family, the baseline settings drawn in each."""
    base = [k for k, m in grid.mismatch.items() if m.family == "baseline"]
    fams = [f for f in dict.fromkeys(m.family for m in grid.mismatch.values()) if f != "baseline"]
    return base, fams or ["baseline"]


def _is_p3o(name: str) -> bool:
    return name.startswith("p3o")


def _mean_of(cells: List[dict], mm: str, key: str) -> float:
    return _stats([c.get(key) for c in cells if c["mismatch"] == mm and c["status"] == "ok"])[0]
