"""The stress report: CSV tables, matplotlib PNGs and a markdown summary that says plainly what
the numbers show — including the settings where P3O is not the best objective."""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_p3o.stress.dose import dose_section, plot_dose
from megatron_p3o.stress.family import (  # noqa: F401 - re-exported: v4's names stay here too
    V4_HEADER,
    _chosen_label,
    _p3o_arm,
    _spread,
    adjust_family,
    power_section,
    v4_headline,
    v4_row,
    v4_tests,
)
from megatron_p3o.stress.grid import REPORTING_NOISE, GridConfig, arm_of, reports_noise
from megatron_p3o.stress.long_run import long_run_section, plot_eval_curves
from megatron_p3o.stress.lr_sweep import base_lr as _base_lr  # noqa: F401 - its old name
from megatron_p3o.stress.lr_sweep import chosen_rates, lr_section
from megatron_p3o.stress.mechanisms import epoch_rows, epoch_section, mechanisms_section
from megatron_p3o.stress.plots import (
    _is_p3o,
    _stats,
    plot_acc_vs_measured,
    plot_curves,
    plot_final_vs_level,
    plot_ratio_hist,
)
from megatron_p3o.stress.provenance import (
    GRID_RUNS,
    merged_runs,
    mixed,
    reruns_section,
    wall_text,
)
from megatron_p3o.stress.stats import (
    adjust,
    best_baseline_bootstrap,
    seed_paired,
    seed_scores,
)

STEP_KEYS = (
    "reward_mean",
    "ratio_ess",
    "ess",
    "abs_logprob_diff",
    "ratio_p99",
    "loss",
    "grad_norm",
    "grad_clipped",
    "update_rel",
    "entropy",
    "kl_ref_k3",
    "completion_len",
    "staleness_mean",
)


def write_csv(path: Path, rows: Sequence[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))  # a failed cell lacks some columns
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, restval="")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


def _subject(grid: GridConfig):
    """(P3O's label, its ablation labels, the baselines' labels)."""
    p3o = next((o for o in grid.objectives if o == "p3o"), None) or next(
        (o for o in grid.objectives if _is_p3o(o)), None
    )
    ablations = [o for o in grid.objectives if _is_p3o(o) and o != p3o]
    return p3o, ablations, [o for o in grid.objectives if not _is_p3o(o)]


_MISMATCH_KEYS = ("abs_diff_first", "abs_diff_run", "abs_diff_p99_first", "kl_b_theta_first")


def _comparators(grid: GridConfig, baselines: List[str]) -> List[str]:
    """The pre-registered comparators (``comparators:`` in the grid), else every baseline."""
    return list(grid.comparators) or baselines


def headline_tests(grid: GridConfig, cells: List[dict]):
    """``[(setting, comparison, first's seed scores, second's, SeedTest or None)]``: per setting,
    P3O − each pre-registered comparator and each P3O ablation − P3O, paired by seed, Holm-adjusted
    over all of them (the report's headline family)."""
    p3o, ablations, baselines = _subject(grid)
    comps = _comparators(grid, baselines)
    rows, tests = [], []
    for mm in grid.mismatch:
        mine = seed_scores(cells, p3o, mm) if p3o else {}
        for c in comps:
            rows.append((mm, f"P3O − {c}", mine, seed_scores(cells, c, mm)))
            tests.append(seed_paired(mine, rows[-1][3], c))
        for a in ablations:
            theirs = seed_scores(cells, a, mm)
            rows.append((mm, f"{a} − P3O", theirs, mine))
            tests.append(seed_paired(theirs, mine, a))
    return [(*r, t) for r, t in zip(rows, adjust(tests))]


def headline(grid: GridConfig, cells: List[dict]) -> Tuple[List[str], List[str]]:
    """The seed-level table: per setting, P3O − each pre-registered comparator (and each P3O
    ablation − P3O) as paired per-seed differences of final accuracy, with the 95% t-interval,
    the t-test p, its Holm adjustment over every test of the report, and the exact sign-flip p;
    a call only where the corrected test rejects. Also the sentences computed from it."""
    p3o, _, baselines = _subject(grid)
    tested = headline_tests(grid, cells)
    lines = [
        "| setting | comparison | first | second | per-seed differences | mean Δ [95% t-CI] | "
        "p (t) | p Holm | p sign-flip | call |",
        "|---" * 10 + "|",
    ]
    said: Dict[str, List[str]] = defaultdict(list)
    for mm, what, first, second, t in tested:
        if t is None:
            lines.append(f"| {mm} | {what} | {_spread(first)} | {_spread(second)} |" + " — |" * 6)
            continue
        call = t.call()
        per = ", ".join(f"{d:+.2f}" for d in t.diffs)
        lines.append(
            f"| {mm} | {what} | {_spread(first)} | {_spread(second)} | {per} | "
            f"{t.mean:+.3f} [{t.lo:+.3f}, {t.hi:+.3f}] | {t.p_t:.3g} | {t.p_adj:.3g} | "
            f"{t.p_perm:.3g} | **{call}** |"
        )
        said[call].append(f"{mm}: {what} {t.mean:+.3f} (Holm p {t.p_adj:.2g})")
    n_tests = sum(t is not None for *_, t in tested)
    text = [
        f"- {n_tests} paired seed-level tests; calls need the Holm-adjusted t-test p < 0.05 over "
        "all of them and the exact sign-flip p < 0.05 (its floor is 2/2^seeds)."
    ]
    for v, what in (("win", "Ahead"), ("loss", "Behind")):
        if said[v]:
            text.append(f"- {what} after correction: " + "; ".join(said[v]) + ".")
    if not said["win"] and not said["loss"]:
        text.append("- No difference survives the correction.")
    if p3o:
        for mm in grid.mismatch:
            bb = best_baseline_bootstrap(
                seed_scores(cells, p3o, mm), {b: seed_scores(cells, b, mm) for b in baselines}
            )
            if bb is not None:
                shares = ", ".join(f"{k} {v:.0%}" for k, v in bb["chosen"].items() if v)
                text.append(
                    f"- {mm}: P3O − best baseline re-selected in each bootstrap replicate "
                    f"{bb['diff']:+.3f} [{bb['lo']:+.3f}, {bb['hi']:+.3f}] (chosen: {shares}); "
                    "descriptive, not a corrected test."
                )
    return lines, text


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
    """Mean rank per objective over the settings (1 = best mean final accuracy), and the cells
    that failed. Wins and losses are called only by the paired CIs (:func:`headline`)."""
    out = []
    ranks: Dict[str, List[int]] = defaultdict(list)
    for mm in grid.mismatch:
        stats = {
            o: _stats([c["acc_end"] for c in cells if c["objective"] == o and c["mismatch"] == mm])
            for o in grid.objectives
        }
        fin = sorted(((v[0], o) for o, v in stats.items() if math.isfinite(v[0])), reverse=True)
        for r, (_, o) in enumerate(fin):
            ranks[o].append(r + 1)
    if ranks:
        mean_rank = sorted((sum(v) / len(v), o) for o, v in ranks.items())
        out.append(
            "- Mean rank over settings (1 = best mean final accuracy; ranks ignore the CIs): "
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


def _subsets(grid: GridConfig) -> str:
    """``; temp_0.8 only p3o, grpo`` for the settings that run a subset of the objectives."""
    parts = [
        f"{k} only {', '.join(m.objectives)}" for k, m in grid.mismatch.items() if m.objectives
    ]
    return "; " + "; ".join(parts) if parts else ""


_NOT_IN_CSV = ("final_per_prompt", "eval_curve")  # lists, kept in each cell.json


def _labels_by_arm(grid: GridConfig, cells: List[dict]) -> Dict[tuple, Optional[str]]:
    """{(arm, setting): its label}: the rate chosen (v4) or fixed per setting (v5)."""
    if not grid.sequential:
        return chosen_rates(grid, cells, _base_lr(grid))
    from megatron_p3o.stress.grid import arm_labels

    arms = dict.fromkeys(arm_of(k) for k in grid.objectives)
    return {(a, mm): (arm_labels(grid, a, mm) or [None])[0] for a in arms for mm in grid.mismatch}


def call_marks(grid: GridConfig, cells: List[dict]) -> Dict[Tuple[str, str], str]:
    """{(label, setting): call} of the declared comparisons that reached a call (better, worse,
    equivalent): the figures mark them on the arm's line."""
    if grid.sequential:
        from megatron_p3o.stress.looks import marks

        return marks(grid, cells)
    if not grid.preregistered:
        return {}
    labels = _labels_by_arm(grid, cells)
    out = {}
    for _, mm, arm, _, _, _, t in adjust_family(v4_tests(grid, cells, _base_lr(grid))[0]):
        if t is not None and t.verdict() != "inconclusive" and labels.get((arm, mm)):
            out[(labels[(arm, mm)], mm)] = t.verdict()
    return out


def write_report(
    grid: GridConfig, cells: List[dict], steps: Dict[str, List[dict]], wall_s: float, grid_path: str
) -> Path:
    out = Path(grid.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(
        out / "cells.csv",
        [{k: v for k, v in c.items() if k not in _NOT_IN_CSV} for c in cells],
    )
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
        plot_curves(
            out, grid, cells, steps, "entropy", "policy entropy (nats/token)", "entropy_vs_step.png"
        ),
        plot_ratio_hist(out, grid, cells, steps),
        plot_final_vs_level(out, grid, cells),
        plot_acc_vs_measured(out, grid, cells, call_marks(grid, cells)),
    ]
    if any(c.get("eval_curve") for c in cells):  # long runs: their per-step curves too
        plots += [
            plot_curves(out, grid, cells, steps, "kl_ref_k3", "k3 KL(πθ‖πref)", "kl_ref.png"),
            plot_curves(
                out,
                grid,
                cells,
                steps,
                "completion_len",
                "completion tokens",
                "completion_len.png",
            ),
        ]
    for extra in (plot_dose(out, grid, cells), plot_eval_curves(out, grid, cells)):
        plots += [extra] if extra is not None else []
    ok = [c for c in cells if c["status"] == "ok"]
    n_steps = max((c["steps"] for c in ok), default=0)
    # the measured wall time goes with the CSV: this machine's invocations (work) joined to the
    # ones already committed with the report (a study resumed on another machine, look by look)
    runs = merged_runs(out, grid.committed or out, grid.work)
    if runs and Path(grid.work, GRID_RUNS).is_file():
        tmp = out / (GRID_RUNS + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in runs))
        tmp.replace(out / GRID_RUNS)
    wall = wall_text(runs)
    md = [
        f"# Stress report: {grid.name}",
        "",
        f"Generated by `python -m megatron_p3o.stress {grid_path}` — {len(cells)} cells "
        f"({len(grid.objectives)} objectives × {len(grid.mismatch)} mismatch settings × "
        f"{len(grid.seeds)} seeds{_subsets(grid)}), {n_steps} steps each, base recipe "
        f"`{grid.base}`, "
        f"cell time summed {wall_s / 60:.1f} min "
        "(each cell counts its own run; with `--workers N` the grid takes about 1/N of it)"
        + (f"; measured wall time {wall} (`{GRID_RUNS}`)." if wall else "."),
        "",
        "Mismatch settings (overrides on the base recipe):",
        "",
    ]
    for k, m in grid.mismatch.items():
        md.append(
            f"- `{k}` ({m.family}, level {m.level:g}): "
            + (", ".join(f"`{a}={b}`" for a, b in m.set.items()) or "base recipe as is")
            + (
                f" — **{REPORTING_NOISE}**: the engine samples from its own πb and only the ℓb "
                "it reports is perturbed (the probe, which measures the engine, does not see it)"
                if reports_noise(m)
                else ""
            )
        )
    if grid.sequential:
        from megatron_p3o.stress.looks import CALLS_CSV, calls_rows, section

        table, sentences = section(grid, cells, runs)
        write_csv(out / CALLS_CSV, calls_rows(grid, cells))
    elif grid.v4:
        table, sentences = v4_headline(grid, cells, _base_lr(grid))
    else:
        table, sentences = headline(grid, cells)
    mixed_from = mixed(cells)
    md += [""] + [f"**Provenance: {m}.**" for m in mixed_from]
    if not mixed_from and cells:
        keys = ("commit", "base_hash", "grid_hash", "cpu_isa", "cpu_model")
        got = {k: cells[0].get(k, "unrecorded") for k in keys}
        plan = cells[0].get("grid_commit")
        md.append(
            (f"Provenance: the grid (the plan) of commit `{plan}`; " if plan else "Provenance: ")
            + f"every cell from commit `{got['commit']}`, base model "
            f"`{got['base_hash']}`, grid file `{got['grid_hash']}`, CPU kernels "
            f"`{got['cpu_isa']}`, CPU `{got['cpu_model']}`."
        )
    md += ["", "## What it shows", ""]
    if grid.notes.strip():
        md += [grid.notes.strip(), "", "Computed from the tables below:", ""]
    md += sentences + findings(grid, cells)
    if grid.sequential:
        md += ["", "## The declared comparisons, look by look (paired by seed)", "", *table]
    elif grid.v4:
        md += (
            [
                "",
                "## Headline: the declared comparisons (paired by seed)",
                "",
                "Final held-out accuracy (greedy, trainer precision), mean ± seed s.d.; the unit "
                "of inference is the seed (each a full training run). Differences arm − "
                "comparator are paired per seed"
                + (
                    f", on the test seeds {', '.join(map(str, grid.lr_select.test_seeds))} at each "
                    "arm's rate chosen on the others"
                    if grid.lr_select
                    else ""
                )
                + "; 95% t-interval over seeds.",
                "",
            ]
            + table
            + [""]
            + power_section(grid, cells)
        )
    else:
        md += [
            "",
            "## Headline: P3O against the pre-registered comparators (paired by seed)",
            "",
            "Final held-out accuracy (greedy, trainer precision), mean ± seed s.d.; the unit of "
            "inference is the seed (each a full training run). Differences are paired per seed; "
            "95% t-interval over seeds; p-values Holm-adjusted across every test of this report; "
            "a win or loss is called only when the corrected test rejects.",
            "",
        ] + table
    md += [""] + reruns_section(out, grid.committed or out)
    md += [""] + lr_section(grid, cells, _base_lr(grid))
    md += [""] + dose_section(grid, cells)
    md += [""] + mechanisms_section(grid, cells)
    erows = epoch_rows(grid, cells, _labels_by_arm(grid, cells))
    if erows:
        write_csv(out / "epochs.csv", erows)
    md += [""] + epoch_section(grid, erows)
    md += [""] + long_run_section(grid, cells)
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
