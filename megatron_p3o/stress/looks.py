"""A sequential grid's looks (stress study v5): which cells the next look needs, the calls so
far, and what the report and ``calls.csv`` say of them.

A grid with ``sequential: {seeds, looks, alpha, spending, gamma}`` declares its comparisons
(``preregistered:``) and fixes each arm's label (its rate) per setting. Look k uses the first
``looks[k]`` seeds of ``seeds`` for both sides of every comparison still undecided after look
k − 1 (:func:`~.sequential.decide`); a decided comparison's arm runs no more seeds, and the
comparator (P3O) runs them as long as one comparison of its setting is open. Everything here is
a function of the finished cells — local ``cell.json`` files, the store, and the committed
``cells.csv`` (``committed:``) — so a study resumes look by look on any machine from a fresh
clone.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Set, Tuple

from megatron_p3o.stress.grid import Cell, Comparison, GridConfig, arm_labels, cells
from megatron_p3o.stress.sequential import Call, Design, decide
from megatron_p3o.stress.stats import seed_scores

CALLS_CSV = "calls.csv"
CALLS_COLUMNS = ("setting", "arm", "look", "test_seeds", "delta", "ci_lo", "ci_hi",
                 "p_adjusted", "call", "comparator", "seeds_needed")  # fmt: skip
# v6 (a grid whose comparisons name a comparator setting or a predicted call): v5's columns,
# then the comparator's setting, the prediction and whether the call is exactly it
CALLS_COLUMNS_V6 = (*CALLS_COLUMNS, "comparator_setting", "prediction", "as_predicted")


def calls_columns(grid: GridConfig) -> tuple:
    v6 = any(c.prediction or c.comparator_setting for c in grid.preregistered)
    return CALLS_COLUMNS_V6 if v6 else CALLS_COLUMNS


def design(grid: GridConfig) -> Design:
    seq = grid.sequential
    return Design(
        tuple(seq.looks), seq.alpha, len(grid.preregistered), grid.equivalence_margin,
        seq.spending, seq.gamma,
    )  # fmt: skip


def label(grid: GridConfig, arm: str, setting: str) -> str:
    """The one label of ``arm`` on ``setting`` (its rate fixed by the grid)."""
    return arm_labels(grid, arm, setting)[0]


def _done(rows: List[dict]) -> Set[Tuple[str, str, int]]:
    """(label, setting, seed) of every finished cell, ok or failed."""
    return {(r["objective"], r["mismatch"], int(r["seed"])) for r in rows}


def comparison_state(
    grid: GridConfig, rows: List[dict], c: Comparison
) -> Tuple[Optional[Call], int]:
    """(the comparison's call so far, the 0-based look it waits for: len(looks) when final)."""
    d = design(grid)
    done = _done(rows)
    la, lb = label(grid, c.arm, c.setting), label(grid, c.comparator, c.against)
    a = seed_scores(rows, la, c.setting, grid.endpoint)
    b = seed_scores(rows, lb, c.against, grid.endpoint)
    by_look: List[List[float]] = []
    for n in d.looks:
        seeds = grid.sequential.seeds[:n]
        sides = ((la, c.setting), (lb, c.against))
        if not all((lab, st, s) in done for s in seeds for lab, st in sides):
            break
        by_look.append([a[s] - b[s] for s in seeds if s in a and s in b])
    call = decide(by_look, d, c.setting, c.arm, c.comparator)
    if call is not None and call.final:
        return call, len(d.looks)
    return call, len(by_look)


def states(grid: GridConfig, rows: List[dict]) -> List[Tuple[Comparison, Optional[Call], int]]:
    return [(c, *comparison_state(grid, rows, c)) for c in grid.preregistered]


def next_look(grid: GridConfig, rows: List[dict]) -> Tuple[Optional[int], List[Cell]]:
    """(the next look to run, 0-based, and its cells not finished yet); (None, []) when every
    comparison is decided or at its cap."""
    st = states(grid, rows)
    waiting = [k for _, _, k in st if k < len(grid.sequential.looks)]
    if not waiting:
        return None, []
    k = min(waiting)
    seeds = set(grid.sequential.seeds[: grid.sequential.looks[k]])
    want = set()
    for c, _, kk in st:
        if kk == k:
            for arm, setting in ((c.arm, c.setting), (c.comparator, c.against)):
                want.add((label(grid, arm, setting), setting))
    done = _done(rows)
    todo = [
        cell
        for cell in cells(grid)
        if (cell.objective, cell.mismatch) in want
        and cell.seed in seeds
        and (cell.objective, cell.mismatch, cell.seed) not in done
    ]
    return k, todo


def calls(grid: GridConfig, rows: List[dict]) -> List[Tuple[Comparison, Optional[Call]]]:
    return [(c, call) for c, call, _ in states(grid, rows)]


def _num(x: Optional[float], fmt: str) -> str:
    return "" if x is None or not math.isfinite(x) else format(x, fmt)


def calls_rows(grid: GridConfig, rows: List[dict]) -> List[dict]:
    """``calls.csv``: one row per declared comparison (its latest look when not decided)."""
    out = []
    for c, call in calls(grid, rows):
        out.append({**_call_row(c, call), **_v6_columns(grid, c, call)})
    return out


def _v6_columns(grid: GridConfig, c: Comparison, call: Optional[Call]) -> dict:
    """The comparator's setting, the predicted call and ``as_predicted``: yes / no when the
    call is final (undecided at the cap matches "undecided"), ``pending`` before."""
    if calls_columns(grid) is CALLS_COLUMNS:
        return {}
    if call is None or not call.final:
        hit = "pending"
    else:
        hit = "yes" if call.call == c.prediction else "no"
    return {"comparator_setting": c.against, "prediction": c.prediction,
            "as_predicted": hit if c.prediction else ""}  # fmt: skip


def _call_row(c: Comparison, call: Optional[Call]) -> dict:
    if call is None:
        return {"setting": c.setting, "arm": c.arm, "look": 0, "test_seeds": 0, "delta": "",
                "ci_lo": "", "ci_hi": "", "p_adjusted": "", "call": "not started",
                "comparator": c.comparator, "seeds_needed": ""}  # fmt: skip
    return {
        "setting": c.setting,
        "arm": c.arm,
        "look": call.look,
        "test_seeds": call.n,
        "delta": _num(call.delta, ".6f"),
        "ci_lo": _num(call.lo, ".6f"),
        "ci_hi": _num(call.hi, ".6f"),
        "p_adjusted": _num(call.p_adjusted, ".4g"),
        "call": call.label if call.final else f"undecided after look {call.look}",
        "comparator": c.comparator,
        "seeds_needed": "" if call.seeds_needed is None else call.seeds_needed,
    }


def marks(grid: GridConfig, rows: List[dict]) -> Dict[Tuple[str, str], str]:
    """{(label, setting): call} of the decided comparisons (the figure marks them)."""
    out = {}
    for c, call in calls(grid, rows):
        if call is not None and call.final and call.call != "undecided":
            out[(label(grid, c.arm, c.setting), c.setting)] = call.call
    return out


def design_lines(grid: GridConfig) -> List[str]:
    """The design and each look's interval, as the report states them."""
    d, seq = design(grid), grid.sequential
    how = {"hsd": f"Hwang–Shih–DeCani (γ = {seq.gamma:g})", "obf": "Lan–DeMets O'Brien–Fleming",
           "pocock": "Lan–DeMets Pocock"}[seq.spending]  # fmt: skip
    lines = [
        f"Sequential design (`sequential:` in the grid; `stress/sequential.py`): {d.m} declared "
        f"comparisons, study-wide error α = {d.alpha:g} split evenly (Bonferroni: "
        f"{d.alpha / d.m:.3g} each) and over the looks by the {how} spending function; each "
        "look's **repeated confidence interval** (Jennison & Turnbull 1989) is the paired "
        "t-interval at that look's share, so that by the union bound it covers the true "
        "difference at every look at once with probability ≥ 1 − α/m: `better`/`worse` when it "
        f"excludes 0, `equivalent` when it lies inside ±{d.margin:g}; a decided comparison runs "
        f"no more seeds. Endpoint: `{grid.endpoint}`"
        + (
            f" (held-out accuracy averaged after steps {grid.endpoint_steps})."
            if grid.endpoint_steps
            else "."
        ),  # fmt: skip
        "",
        "| look | seeds | share of α/m | two-sided level of its interval | t constant "
        "(df = seeds − 1) |",
        "|---" * 5 + "|",
    ]
    for k, n in enumerate(d.looks):
        lines.append(
            f"| {k + 1} | {n} | {d.shares[k]:.3f} | {d.level(k):.3g} | {d.t_crit(k):.3f} |"
        )
    return lines


def section(grid: GridConfig, rows: List[dict], runs: List[dict]) -> Tuple[List[str], List[str]]:
    """(the report's section, its sentences) for a sequential grid."""
    st = states(grid, rows)
    k_max = len(grid.sequential.looks)
    lines = design_lines(grid) + [
        "",
        "| setting | arm − comparator | look | seeds | Δ | repeated CI | p adjusted | call | "
        "seeds a fixed test would still need |",
        "|---" * 9 + "|",
    ]
    decided = 0
    by_look: Dict[int, int] = {}
    for c, call, _ in st:
        what = f"{c.arm} − {c.comparator}"
        if c.against != c.setting:  # the same arm (or another) on the comparator's setting
            what = f"{c.arm} − {c.comparator} on {c.against}"
        if c.prediction:
            what += f" (predicted: {c.prediction})"
        if call is None:
            lines.append(f"| {c.setting} | {what} | — | 0 | | | | not started | |")
            continue
        if call.final and call.call != "undecided":
            decided += 1
            by_look[call.look] = by_look.get(call.look, 0) + 1
        shown = call.label if call.final else f"undecided after look {call.look}"
        bold = f"**{shown}**" if call.call != "undecided" else shown
        lines.append(
            f"| {c.setting} | {what} | {call.look} | {call.n} | {_num(call.delta, '+.3f')} | "
            f"[{_num(call.lo, '+.3f')}, {_num(call.hi, '+.3f')}] | "
            f"{_num(call.p_adjusted, '.2g')} | {bold} | "
            f"{'' if call.seeds_needed is None else call.seeds_needed} |"
        )
    m = len(st)
    waiting = sum(1 for _, _, k in st if k < k_max)
    where = ", ".join(f"{v} at look {k}" for k, v in sorted(by_look.items()))
    text = [
        f"- {decided} of {m} declared comparisons decided ({decided / max(m, 1):.0%})"
        + (f": {where}" if where else "")
        + (f"; {waiting} still waiting for a look." if waiting else "; no look left to run.")
    ]
    counts = {}
    for _, call, _ in st:
        key = "not started" if call is None else (call.label if call.final else "open")
        counts[key] = counts.get(key, 0) + 1
    text.append("- Calls: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + ".")
    predicted = [(c, call) for c, call, _ in st if c.prediction and call is not None and call.final]
    if predicted:  # scored exactly: a call is as predicted only when it is the one predicted
        hits = sum(call.call == c.prediction for c, call in predicted)
        text.append(f"- As predicted: {hits} of {len(predicted)} final calls (exact match).")
    lines += ["", *look_cost(runs)]
    return lines, text


def look_cost(runs: List[dict]) -> List[str]:
    """The measured wall time of each look (``grid_runs.jsonl`` lines with a ``look``)."""
    by: Dict[int, List[dict]] = {}
    for r in runs:
        if "look" in r:
            by.setdefault(int(r["look"]), []).append(r)
    if not by:
        return []
    lines = ["| look | cells run | wall time (min) | workers | CPU |", "|---" * 5 + "|"]
    for k, rs in sorted(by.items()):
        lines.append(
            f"| {k} | {sum(r['cells_run'] for r in rs)} | "
            f"{sum(r['wall_s'] for r in rs) / 60:.1f} | "
            f"{'/'.join(sorted({str(r['workers']) for r in rs}))} | "
            f"{', '.join(sorted({str(r.get('cpu_model', r.get('cpu_isa', '?'))) for r in rs}))} |"
        )
    total = sum(r["wall_s"] for rs in by.values() for r in rs) / 60
    return ["Measured wall time per look (`grid_runs.jsonl`):", "", *lines, "",
            f"All looks: {total:.1f} min."]  # fmt: skip
