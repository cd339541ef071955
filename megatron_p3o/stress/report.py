"""The stress report: CSV tables, matplotlib PNGs and a markdown summary that says plainly what
the numbers show — including the settings where P3O is not the best objective."""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from .grid import GridConfig

STEP_KEYS = (
    "reward_mean",
    "ratio_ess",
    "ess",
    "abs_logprob_diff",
    "ratio_p99",
    "loss",
    "grad_norm",
    "staleness_mean",
)


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


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
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{grid.name}: {ylabel} (mean over seeds, {smooth}-step moving average)")
    fig.tight_layout()
    path = out / fname
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
            xs = [-2 + (i + 0.5) * 4 / n for i in range(n)]
            ax.step(xs, [v / sum(tot) for v in tot], where="mid", label=mm)
    ax.set_yscale("log")
    ax.set_xlabel("log ρ = ℓθ − ℓb (end bins hold everything beyond ±2)")
    ax.set_ylabel("fraction of tokens")
    ax.set_title(f"{grid.name}: train/rollout log-ratio, objective {obj}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "ratio_hist.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_final_vs_level(out: Path, grid: GridConfig, cells: List[dict]) -> Path:
    """Final held-out accuracy vs mismatch level, one panel per family (the baseline is level 0
    of every panel); markers at the seed mean, bars spanning min–max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = [
        f for f in dict.fromkeys(m.family for m in grid.mismatch.values()) if f != "baseline"
    ] or ["baseline"]
    base = [k for k, m in grid.mismatch.items() if m.family == "baseline"]
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
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{grid.name}: final accuracy vs mismatch (bars: min–max over seeds)")
    fig.tight_layout()
    path = out / "final_acc_vs_mismatch.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _table(grid: GridConfig, cells: List[dict], key: str, fmt: str) -> List[str]:
    mms = list(grid.mismatch)
    lines = ["| objective | " + " | ".join(mms) + " | mean |", "|---" * (len(mms) + 2) + "|"]
    best = {}
    for mm in mms:
        vals = {
            o: _stats([c[key] for c in cells if c["objective"] == o and c["mismatch"] == mm])[0]
            for o in grid.objectives
        }
        fin = {o: v for o, v in vals.items() if math.isfinite(v)}
        best[mm] = max(fin.values()) if fin else None
    for o in grid.objectives:
        row, allv = [], []
        for mm in mms:
            sel = [c for c in cells if c["objective"] == o and c["mismatch"] == mm]
            mean, lo, hi = _stats([c[key] for c in sel])
            failed = sum(1 for c in sel if c["status"] != "ok")
            if not math.isfinite(mean):
                row.append("failed" if failed else "—")
                continue
            allv.append(mean)
            s = f"{mean:{fmt}} ±{(hi - lo) / 2:{fmt.lstrip('+')}}"
            if failed:
                s += f" ({failed} failed)"
            row.append(f"**{s}**" if best[mm] is not None and mean >= best[mm] - 1e-12 else s)
        m = sum(allv) / len(allv) if allv else float("nan")
        lines.append(f"| {o} | " + " | ".join(row) + f" | {m:{fmt}} |")
    return lines


def findings(grid: GridConfig, cells: List[dict]) -> List[str]:
    """Plain sentences computed from the table: who is best per setting, where P3O is not."""
    p3o = next((o for o in grid.objectives if o.startswith("p3o")), None)
    out = []
    ranks: Dict[str, List[int]] = defaultdict(list)
    for mm in grid.mismatch:
        stats = {
            o: _stats([c["acc_end"] for c in cells if c["objective"] == o and c["mismatch"] == mm])
            for o in grid.objectives
        }
        fin = sorted(((v[0], o) for o, v in stats.items() if math.isfinite(v[0])), reverse=True)
        if not fin:
            continue
        for r, (_, o) in enumerate(fin):
            ranks[o].append(r + 1)
        top_v, top = fin[0]
        if p3o is None or p3o not in stats or not math.isfinite(stats[p3o][0]):
            out.append(f"- **{mm}**: best {top} ({top_v:.3f}).")
            continue
        pv, plo, phi = stats[p3o]
        rank = [o for _, o in fin].index(p3o) + 1
        if top == p3o:
            second = fin[1] if len(fin) > 1 else None
            gap = (
                f", ahead of {second[1]} ({second[0]:.3f}) by {pv - second[0]:+.3f}"
                if second
                else ""
            )
            out.append(f"- **{mm}**: P3O is best ({pv:.3f}{gap}).")
        else:
            spread = (stats[top][2] - stats[top][1]) / 2 + (phi - plo) / 2
            verdict = (
                "one seed, no spread to compare"
                if len(grid.seeds) == 1
                else "within the seed spread"
                if top_v - pv <= spread
                else "by more than the seed spread"
            )
            out.append(
                f"- **{mm}**: P3O does **not** win — {top} reaches {top_v:.3f}, P3O {pv:.3f} "
                f"(rank {rank} of {len(fin)}; gap {top_v - pv:.3f}, {verdict})."
            )
    if ranks:
        mean_rank = sorted((sum(v) / len(v), o) for o, v in ranks.items())
        out.append(
            "- Mean rank over settings (1 = best final accuracy): "
            + ", ".join(f"{o} {r:.1f}" for r, o in mean_rank)
            + "."
        )
    failed = [c["cell"] for c in cells if c["status"] != "ok"]
    if failed:
        out.append(
            f"- {len(failed)} cells failed: "
            + ", ".join(failed[:10])
            + ("…" if len(failed) > 10 else "")
        )
    return out


def write_report(
    grid: GridConfig, cells: List[dict], steps: Dict[str, List[dict]], wall_s: float, grid_path: str
) -> Path:
    out = Path(grid.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "cells.csv", cells)
    write_csv(
        out / "steps.csv",
        [
            {"cell": c, "step": m["step"], **{k: m.get(k) for k in STEP_KEYS}}
            for c, ms in steps.items()
            for m in ms
        ],
    )
    plots = [
        plot_curves(out, grid, cells, steps, "reward_mean", "mean reward", "reward_vs_step.png"),
        plot_curves(
            out,
            grid,
            cells,
            steps,
            "ratio_ess",
            "e_B = (Σρ)²/(NΣρ²) vs πb",
            "ess_vs_step.png",
            smooth=1,
        ),
        plot_ratio_hist(out, grid, cells, steps),
        plot_final_vs_level(out, grid, cells),
    ]
    ok = [c for c in cells if c["status"] == "ok"]
    n_steps = max((c["steps"] for c in ok), default=0)
    md = [
        f"# Stress report: {grid.name}",
        "",
        f"Generated by `python -m megatron_p3o.stress {grid_path}` — {len(cells)} cells "
        f"({len(grid.objectives)} objectives × {len(grid.mismatch)} mismatch settings × "
        f"{len(grid.seeds)} seeds), {n_steps} steps each, base recipe `{grid.base}`, "
        f"total wall time {wall_s / 60:.1f} min "
        "(cells run now; resumed cells count their own time).",
        "",
        "Mismatch settings (overrides on the base recipe):",
        "",
    ]
    for k, m in grid.mismatch.items():
        md.append(
            f"- `{k}` ({m.family}, level {m.level:g}): "
            + (", ".join(f"`{a}={b}`" for a, b in m.set.items()) or "base recipe as is")
        )
    md += ["", "## What it shows", ""]
    if grid.notes.strip():
        md += [grid.notes.strip(), "", "Computed from the table below:", ""]
    md += findings(grid, cells)
    md += [
        "",
        "## Final held-out accuracy (mean ± half-range over seeds; best per column in bold)",
        "",
    ]
    md += _table(grid, cells, "acc_end", ".3f")
    md += ["", "## Accuracy gained over the base model (end − start)", ""]
    md += _table(grid, cells, "acc_delta", "+.3f")
    md += ["", "## Mean e_B against the rollout engine's πb over the run (all objectives)", ""]
    md += _table(grid, cells, "ess_mean", ".3f")
    md += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    md += ["", "Data: `cells.csv` (one row per cell), `steps.csv` (one row per cell and step).", ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path
