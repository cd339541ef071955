"""A stress study's summary across its grids, from their committed CSVs.

``python -m megatron_p3o.stress.study GRID.yaml [GRID.yaml ...] --out docs/stress_v3.md``

Each grid keeps its own report (its Holm family, its plots). A study is several grids — a
learning-rate sweep, dose axes, long runs, real engines — and a reader needs their results side
by side: the design and the measured wall time of every grid, each objective's break point on
every axis, every corrected call of P3O against its pre-registered comparators, and each
objective's learning-rate sensitivity. This module reads only ``<out>/cells.csv`` (and
``<out>/grid_runs.jsonl``) of each grid, so the summary is rebuilt from a fresh clone without
running anything; the tests (Holm within each grid, break points, sensitivities) are those of the
grids' own reports (:mod:`.report`, :mod:`.dose`, :mod:`.lr_sweep`), not a re-implementation.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Tuple

from megatron_p3o.stress.provenance import grid_runs, mixed, wall_text
from megatron_p3o.stress.stats import VERDICTS

if TYPE_CHECKING:
    from megatron_p3o.stress.grid import GridConfig
# the rest of .stress imports megatron-core (through the config): imported where used, after
# the CLI has silenced its known import-time warnings

_INT = ("seed", "steps", "opt_steps")


def _value(k: str, v: str):
    if k in _INT:
        return int(float(v))
    try:
        return float(v)
    except ValueError:
        return v


def read_cells(path: str | Path) -> List[dict]:
    """A report's ``cells.csv`` as the cell summaries it was written from (numbers parsed)."""
    with open(path, newline="") as f:
        return [{k: _value(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def _lrs(grid: GridConfig) -> str:
    from megatron_p3o.stress.lr_sweep import label_rate
    from megatron_p3o.stress.report import _base_lr

    base = _base_lr(grid)
    rates = {float(label_rate(grid, k, base) or math.nan) for k in grid.objectives}
    return ", ".join(f"{r:g}" for r in sorted(rates))


def _task(grid: GridConfig) -> str:
    """What the cells learn: the base recipe's ``data.task``, else its reward function (the
    addition grids' ``megatron_p3o.data.tasks.arithmetic:reward``), else its data file."""
    from megatron_p3o.config.loading import load_config
    from megatron_p3o.runtime.errors import ConfigError

    try:
        cfg = load_config(grid.base)
    except ConfigError:  # the base recipe moved: the cells alone cannot say
        return "?"
    d = cfg.data
    if d.task:
        return d.task
    fn = getattr(cfg.reward, "function", None)
    return fn.split(":")[0].rsplit(".", 1)[-1] if fn else Path(d.path or "?").name


def design_rows(grids: List[GridConfig], cells: Dict[str, List[dict]]) -> List[str]:
    lines = [
        "| grid | task | cells (ok) | objectives | settings | seeds | steps | lr | cell-min | "
        "wall (measured) | provenance |",
        "|---" * 11 + "|",
    ]
    for g in grids:
        cs = cells[g.name]
        ok = [c for c in cs if c["status"] == "ok"]
        steps = max((c["steps"] for c in ok), default=0)
        cell_min = sum(c["wall_s"] for c in cs) / 60
        wall = wall_text(grid_runs(g.out)) or "not logged"
        prov = "; ".join(mixed(cs)) or (
            f"one commit `{cs[0].get('commit', '?')[:8]}`, base `{cs[0].get('base_hash', '?')}`, "
            f"{cs[0].get('cpu_isa', '?')}"
            if cs
            else "no cells"
        )
        lines.append(
            f"| [{g.name}]({Path(g.out).name}/report.md) | {_task(g)} | {len(cs)} ({len(ok)}) | "
            f"{', '.join(g.objectives)} | {', '.join(g.mismatch)} | {len(g.seeds)} | {steps} | "
            f"{_lrs(g)} | {cell_min:.1f} | {wall} | {prov} |"
        )
    return lines


def break_rows(grids: List[GridConfig], cells: Dict[str, List[dict]]) -> List[str]:
    """objective × (grid, axis): the break level, or "none (worst Δ)" when no level broke it."""
    from megatron_p3o.stress.dose import axes, break_points
    from megatron_p3o.stress.grid import family_label
    from megatron_p3o.stress.lr_sweep import learning_rates
    from megatron_p3o.stress.report import _base_lr

    cols, table = [], {}
    for g in grids:
        ax = axes(g)
        if not ax or learning_rates(g, _base_lr(g)):  # a rate sweep: its labels are rates
            continue
        rows, points = break_points(g, cells[g.name])
        for fam in ax:
            cols.append((g, fam))
            for obj in g.objectives:
                tests = [t for f, o, _, t in rows if f == fam and o == obj and t is not None]
                bp = points.get((fam, obj))
                if bp:
                    t = next(t for f, o, m, t in rows if (f, o, m) == (fam, obj, bp))
                    table[(obj, g.name, fam)] = f"**{g.mismatch[bp].level:g}** ({t.mean:+.2f})"
                elif tests:
                    worst = min(t.mean for t in tests)
                    table[(obj, g.name, fam)] = f"none ({worst:+.2f})"
    if not cols:
        return []
    objs = list(dict.fromkeys(o for o, _, _ in table))
    lines = [
        "| objective | "
        + " | ".join(f"{family_label(g, fam)} ({g.name})" for g, fam in cols)
        + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for o in objs:
        lines.append(
            f"| {o} | " + " | ".join(table.get((o, g.name, f), "—") for g, f in cols) + " |"
        )
    return lines


def call_rows(grids: List[GridConfig], cells: Dict[str, List[dict]]) -> List[str]:
    """Every win or loss of the grids' headline tables (Holm within each grid), and the ties
    counted."""
    from megatron_p3o.stress.report import headline_tests

    lines = [
        "| grid | setting | comparison | mean Δ [95% t-CI] | p Holm | call |",
        "|---" * 6 + "|",
    ]
    ties = 0
    for g in grids:
        if g.v4:  # in the study-wide family instead
            continue
        for mm, what, _, _, t in headline_tests(g, cells[g.name]):
            if t is None:
                continue
            if t.call() == "tie":
                ties += 1
                continue
            lines.append(
                f"| {g.name} | {mm} | {what} | {t.mean:+.3f} [{t.lo:+.3f}, {t.hi:+.3f}] | "
                f"{t.p_adj:.2g} | **{t.call()}** |"
            )
    return lines + ["", f"All other {ties} paired tests of these grids: **tie**."]


def family_rows(
    grids: List[GridConfig], cells: Dict[str, List[dict]]
) -> Tuple[List[str], List[str]]:
    """(table, sentences) of the study's ONE confirmatory family: every grid's ``preregistered``
    comparisons adjusted together (superiority and TOST, :func:`~.report.adjust_family`), then
    the exploratory comparisons (not declared: outside the family, unadjusted)."""
    from megatron_p3o.stress.lr_sweep import chosen_rates
    from megatron_p3o.stress.report import (
        V4_HEADER,
        _base_lr,
        _chosen_label,
        adjust_family,
        v4_row,
        v4_tests,
    )

    declared, exploratory, chosen = [], [], {}
    for g in grids:
        d, e = v4_tests(g, cells[g.name], _base_lr(g))
        declared += d
        exploratory += e
        chosen[g.name] = (g, chosen_rates(g, cells[g.name], _base_lr(g)))
    declared = adjust_family(declared)

    def labels(r):
        g, ch = chosen[r[0]]
        return _chosen_label(g, ch, r[2], r[1]), _chosen_label(g, ch, r[3], r[1])

    head = ["| grid " + V4_HEADER[0], "|---" + V4_HEADER[1]]
    n = sum(r[-1] is not None for r in declared)
    margins = sorted({g.equivalence_margin for g in grids if g.v4})
    lines = [
        f"One family: the {len(declared)} comparisons declared in the grid files "
        f"(`preregistered:`), {n} testable, {2 * n} hypotheses (superiority Δ = 0 and TOST "
        f"equivalence |Δ| ≥ {'/'.join(f'{m:g}' for m in margins)}; at most one of each pair "
        "is true, so Holm's multiplier is at most the number of comparisons).",
        "",
        *head,
        *[f"| {r[0]} " + v4_row(r, True, labels(r)) for r in declared],
    ]
    if exploratory:
        lines += [
            "",
            f"Exploratory: {len(exploratory)} comparisons not declared (outside the family, "
            "p unadjusted, calls not claims).",
            "",
            *head,
            *[f"| {r[0]} " + v4_row(r, False, labels(r)) for r in exploratory],
        ]
    counts = {
        v: sum(1 for r in declared if r[-1] is not None and r[-1].verdict() == v) for v in VERDICTS
    }
    text = [
        "- Declared calls over the study: "
        + ", ".join(f"{counts[v]} {v}" for v in VERDICTS)
        + (f", {len(declared) - n} untestable" if len(declared) > n else "")
        + "."
    ]
    return lines, text


def declaration_changes(grids: List[GridConfig], cells: Dict[str, List[dict]]) -> List[str]:
    """One sentence per grid whose file (where its family is declared) differs from the file its
    cells ran under (their ``grid_hash``): the declaration may have changed after the runs."""
    from megatron_p3o.stress.provenance import tree_hash

    out = []
    for g in grids:
        if not g.preregistered or not g.path:
            continue
        now = tree_hash(g.path)
        ran = sorted({str(c.get("grid_hash", "unrecorded")) for c in cells[g.name]} - {now})
        if ran:
            out.append(
                f"**{g.name}: the grid file (hash `{now}`) is not the one its cells ran under "
                f"({', '.join(f'`{h}`' for h in ran)}): its declared family may have changed "
                "after the runs.**"
            )
    return out


def power_rows(
    grids: List[GridConfig], cells: Dict[str, List[dict]], delta: float = 0.05
) -> List[str]:
    """Per grid: the median seed s.d. of its headline paired differences, the power its seed
    count has for a true difference of ``delta`` — at α = 0.05 and at α = 0.05/m (the first Holm
    step over its m tests, a lower bound of the corrected power) — and the seeds 80% needs."""
    from megatron_p3o.stress.report import headline_tests
    from megatron_p3o.stress.stats import power_paired, seeds_for_power

    lines = [
        f"| grid | seeds | tests m | median paired s.d. | power for Δ = {delta:g} at α 0.05 | "
        "at α 0.05/m | seeds for 80% at α 0.05 | at α 0.05/m |",
        "|---" * 8 + "|",
    ]
    for g in grids:
        if g.sequential:  # its looks decide: the design and the calls are in its report
            continue
        if g.v4:  # its declared comparisons (on its test seeds under lr_select)
            from megatron_p3o.stress.report import _base_lr, v4_tests

            rows = v4_tests(g, cells[g.name], _base_lr(g))[0]
            tests = [r[-1] for r in rows if r[-1] is not None]
        else:
            tests = [t for *_, t in headline_tests(g, cells[g.name]) if t is not None]
        if not tests:
            continue
        sd = statistics.median(t.sd for t in tests)  # the middle two averaged for an even count
        n, m = len(g.lr_select.test_seeds if g.lr_select else g.seeds), len(tests)
        lines.append(
            f"| {g.name} | {n} | {m} | {sd:.3f} | {power_paired(delta, sd, n):.2f} | "
            f"{power_paired(delta, sd, n, 0.05 / m):.2f} | {seeds_for_power(delta, sd)} | "
            f"{seeds_for_power(delta, sd, alpha=0.05 / m)} |"
        )
    return lines


def lr_rows(grids: List[GridConfig], cells: Dict[str, List[dict]]) -> List[str]:
    from megatron_p3o.stress.grid import control_setting
    from megatron_p3o.stress.lr_sweep import best_rates, learning_rates, sensitivity
    from megatron_p3o.stress.report import _base_lr

    lines = []
    for g in grids:
        rates = learning_rates(g, _base_lr(g))
        if not rates:
            continue
        chosen = best_rates(g, cells[g.name], rates)
        lines += [
            f"**{g.name}** (best rate chosen on `{control_setting(g)}`; sensitivity = range of "
            "the seed means over the rates)",
            "",
            "| objective | best lr | "
            + " | ".join(f"sensitivity on {m}" for m in g.mismatch)
            + " |",
            "|---" * (len(g.mismatch) + 2) + "|",
        ]
        for fam, by_lr in rates.items():
            sens = [sensitivity(cells[g.name], by_lr, m) for m in g.mismatch]
            best = chosen.get(fam)
            best_lr = next((lr for lr, lab in by_lr.items() if lab == best), math.nan)
            lines.append(
                f"| {fam} | {best_lr:g} | "
                + " | ".join(f"{s[1]:.3f}" if s else "—" for s in sens)
                + " |"
            )
        lines.append("")
    return lines


def _lr_select_rows(grids: List[GridConfig], cells: Dict[str, List[dict]]) -> List[str]:
    """The v4 grids' chosen rates (their reports' tables, one per grid)."""
    from megatron_p3o.stress.lr_sweep import lr_select_section
    from megatron_p3o.stress.report import _base_lr

    out = []
    for g in grids:
        sec = lr_select_section(g, cells[g.name], _base_lr(g))
        if sec:
            out += [f"**{g.name}**", "", *sec[2:], ""]
    return out


def write_study(grid_paths: List[str], out: Path, title: str) -> Path:
    from megatron_p3o.stress.grid import load_grid

    grids = [load_grid(p) for p in grid_paths]
    cells = {}
    for g in grids:
        f = Path(g.out) / "cells.csv"
        if not f.is_file():
            from megatron_p3o.runtime.errors import ConfigError

            raise ConfigError(f"{f}: no report of grid {g.name} yet (run it, or --report-only)")
        cells[g.name] = read_cells(f)
    md = [
        f"# {title}",
        "",
        "Built by `python -m megatron_p3o.stress.study "
        + " ".join(grid_paths)
        + f" --out {out}` from each grid's committed `cells.csv`; "
        + (
            "the declared comparisons of every grid form one Holm family; the other tests are "
            "their grid's own (seed-paired, Holm-adjusted over that grid's report)."
            if any(g.v4 for g in grids)
            else "every test is its grid's own (seed-paired, Holm-adjusted over that grid's "
            "report)."
        ),
        "",
        "## Design and cost",
        "",
    ]
    md += design_rows(grids, cells)
    runs = {g.name: grid_runs(g.out) for g in grids}
    logged = [g for g in grids if runs[g.name]]
    total = sum(r["wall_s"] for g in logged for r in runs[g.name]) / 60
    md += [
        "",
        f"Measured wall time of the {len(logged)} grids with a log: {total:.1f} min in all"
        + (
            f"; not logged: {', '.join(g.name for g in grids if g not in logged)}."
            if len(logged) < len(grids)
            else "."
        ),
        "",
    ]
    br = break_rows(grids, cells)
    if br:
        md += [
            "## Break points",
            "",
            "The first level (nearest the control first) whose seed-paired difference to the "
            "objective's own control is a Holm-corrected loss; in brackets that level's mean Δ, "
            "or the worst level's Δ when none broke it. Learning-rate grids are left out (their "
            "objectives are rates: see their reports).",
            "",
            *br,
            "",
        ]
    md += [
        "## Power",
        "",
        "What each grid's seeds can see: the seed s.d. of the paired differences (median "
        "over each grid's headline tests) and the paired t-test's power for a true difference "
        "of 0.05 (simulated).",
        "",
        *power_rows(grids, cells),
        "",
    ]
    v4 = [g for g in grids if g.v4 and not g.sequential]  # v5: calls by look, in its report
    if v4:
        table, text = family_rows(v4, cells)
        md += [
            "## The declared comparisons: one family over the study",
            "",
            *declaration_changes(v4, cells),
            "",
            *text,
            "",
            *table,
            "",
        ]
    if len(v4) < len(grids):
        md += ["## Corrected calls: P3O against the pre-registered comparators", ""]
        md += call_rows([g for g in grids if not g.v4], cells) + [""]
    lr = lr_rows([g for g in grids if not g.v4], cells)
    lr += _lr_select_rows(v4, cells)
    if lr:
        md += ["## Learning-rate sensitivity", "", *lr]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grids", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="Stress study summary")
    a = ap.parse_args(argv)
    print(write_study(a.grids, Path(a.out), a.title))
    return 0


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "megatron_p3o.stress.study")
