"""Learning-rate sweeps in a stress grid: each objective at its own best learning rate, and how
much its result depends on that choice.

A grid sweeps the learning rate with objective variants named ``NAME@…`` that set their own
``optim.lr`` (``p3o@lr1e-4: {objective: p3o, set: {optim.lr: 1.0e-4}}``); ``NAME`` itself runs at
the grid's (or the base recipe's) rate. For every objective family and setting this module gives
the seed mean and s.d. at each rate, the best rate and the **sensitivity**: the range of the
seed means over the rates (P3O's "no trust-region knob" claim is a claim about this range).

The best rate of each family is chosen once, on the control setting (the ``baseline`` setting,
else the grid's first: :func:`~.grid.control_setting`), and then held fixed: P3O at its rate is
compared with each pre-registered comparator at *its* rate in the other settings, paired by
seed, Holm-adjusted over those tests. The control itself is where the rates were chosen and is
not tested (a winner's-curse comparison).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

from megatron_p3o.stress.grid import GridConfig, arm_of, control_setting
from megatron_p3o.stress.stats import adjust, mean_sd, seed_paired, seed_scores


def family(label: str) -> str:
    """The objective a label belongs to: ``p3o@lr1e-4`` → ``p3o``."""
    return arm_of(label)


def label_rate(grid: GridConfig, label: str, base_lr: Optional[float] = None):
    """The learning rate of an objective label's cells: its own ``set: {optim.lr: …}``, else the
    grid's ``set``, else ``base_lr`` (the base recipe's; None when unknown)."""
    return grid.objectives[label].set.get("optim.lr", grid.set.get("optim.lr", base_lr))


def learning_rates(
    grid: GridConfig, base_lr: Optional[float] = None
) -> Dict[str, Dict[float, str]]:
    """family -> {learning rate -> objective label}, for families swept over ≥ 2 rates.

    A label's rate is its own ``set: {optim.lr: …}``, else the grid's ``set``, else ``base_lr``
    (the base recipe's); labels with no known rate are left out."""
    fams: Dict[str, Dict[float, str]] = {}
    for label in grid.objectives:
        lr = label_rate(grid, label, base_lr)
        if lr is None:
            continue
        fams.setdefault(family(label), {})[float(lr)] = label
    return {f: dict(sorted(r.items())) for f, r in fams.items() if len(r) >= 2}


def best_rates(grid: GridConfig, cells: List[dict], rates: Dict[str, Dict[float, str]]):
    """family -> the label of its best rate on the control setting (highest seed mean)."""
    control = control_setting(grid)
    out = {}
    for fam, by_lr in rates.items():
        means = {
            lab: mean_sd(list(seed_scores(cells, lab, control).values()))[0]
            for lab in by_lr.values()
        }
        fin = {k: v for k, v in means.items() if math.isfinite(v)}
        if fin:
            out[fam] = max(fin, key=fin.get)
    return out


def sensitivity(cells: List[dict], by_lr: Dict[float, str], mismatch: str):
    """``(best rate, sensitivity, {rate: (seed mean, seed s.d.)})`` of one objective family on one
    setting: the sensitivity is max − min of the seed means over the rates (None: no results)."""
    stats = {
        lr: mean_sd(list(seed_scores(cells, lab, mismatch).values())) for lr, lab in by_lr.items()
    }
    fin = {lr: m for lr, (m, _) in stats.items() if math.isfinite(m)}
    if not fin:
        return None
    return max(fin, key=fin.get), max(fin.values()) - min(fin.values()), stats


# -- v4: each arm's rate chosen on the selection seeds, tested on the others -------------------


def arm_rates(grid: GridConfig, base_lr: Optional[float] = None) -> Dict[str, Dict[float, str]]:
    """arm -> {learning rate -> objective label}, every arm (one rate or several); a label
    without a known rate is its arm's only entry, under NaN."""
    out: Dict[str, Dict[float, str]] = {}
    for label in grid.objectives:
        lr = label_rate(grid, label, base_lr)
        out.setdefault(family(label), {})[math.nan if lr is None else float(lr)] = label
    return {a: dict(sorted(r.items())) for a, r in out.items()}


def _selection_score(cells: List[dict], label: str, setting: str, seeds) -> tuple:
    """How a rate ranks on the selection seeds: (−failed cells, mean final accuracy of the
    finished ones); a rate none of whose selection cells finished ranks last."""
    sel = [c for c in cells if c["objective"] == label and c["mismatch"] == setting]
    sel = [c for c in sel if c["seed"] in seeds]
    failed = sum(1 for c in sel if c["status"] != "ok")
    ok = [s for seed, s in seed_scores(cells, label, setting).items() if seed in seeds]
    return (-failed, sum(ok) / len(ok)) if ok else None


def chosen_rates(
    grid: GridConfig, cells: List[dict], base_lr: Optional[float] = None
) -> Dict[tuple, Optional[str]]:
    """``{(arm, setting): the label of its chosen rate}`` under ``grid.lr_select``: the rate with
    the fewest failed selection cells, then the highest mean final accuracy over the selection
    seeds (``lr_select.seeds``), the lower rate on an exact tie; per setting, or once on the
    control setting (``per: control``) and held on every setting. None: nothing to choose on.
    Without ``lr_select`` every arm is its own label."""
    sel = grid.lr_select
    out: Dict[tuple, Optional[str]] = {}
    for arm, by_lr in arm_rates(grid, base_lr).items():
        for mm in grid.mismatch:
            if sel is None:
                out[(arm, mm)] = arm if arm in grid.objectives else None
                continue
            where = control_setting(grid) if sel.per == "control" else mm
            scored = [
                (sc, -i, lab)
                for i, lab in enumerate(by_lr.values())
                if (sc := _selection_score(cells, lab, where, set(sel.seeds))) is not None
            ]
            out[(arm, mm)] = max(scored)[2] if scored else None
    return out


def arm_scores(
    grid: GridConfig, cells: List[dict], arm: str, setting: str, chosen: Dict[tuple, Optional[str]]
) -> Dict[int, float]:
    """seed -> final accuracy of ``arm`` on ``setting`` for the confirmatory test: its chosen
    rate's cells on the test seeds (``lr_select.test_seeds``), else the arm's label, every seed."""
    label = chosen.get((arm, setting))
    if label is None:
        return {}
    scores = seed_scores(cells, label, setting)
    if grid.lr_select is None:
        return scores
    test = set(grid.lr_select.test_seeds)
    return {s: v for s, v in scores.items() if s in test}


def lr_select_section(
    grid: GridConfig, cells: List[dict], base_lr: Optional[float] = None
) -> List[str]:
    """Markdown: each arm's chosen rate per setting, with the selection seeds' means per rate."""
    sel = grid.lr_select
    if sel is None:
        return []
    chosen = chosen_rates(grid, cells, base_lr)
    how = (
        "per setting" if sel.per == "setting" else f"once, on the control `{control_setting(grid)}`"
    )
    lines = [
        "## Learning rates chosen on the selection seeds",
        "",
        f"Each arm's rate is chosen {how} by mean final held-out accuracy over seeds "
        f"{', '.join(map(str, sel.seeds))} (fewest failed cells first); the confirmatory tests "
        f"use only seeds {', '.join(map(str, sel.test_seeds))} at the chosen rates. Selection "
        "means per rate, chosen rate in bold:",
        "",
        "| arm | setting | selection means | chosen |",
        "|---" * 4 + "|",
    ]
    for arm, by_lr in arm_rates(grid, base_lr).items():
        for mm in grid.mismatch:
            where = control_setting(grid) if sel.per == "control" else mm
            cols = []
            for lr, lab in by_lr.items():
                sc = _selection_score(cells, lab, where, set(sel.seeds))
                txt = f"{lr:g}: " + ("—" if sc is None else f"{sc[1]:.3f}")
                txt += f" ({-sc[0]} failed)" if sc and sc[0] else ""
                cols.append(f"**{txt}**" if lab == chosen.get((arm, mm)) else txt)
            got = chosen.get((arm, mm))
            rate = next((lr for lr, lab in by_lr.items() if lab == got), None)
            if all(c.endswith("—") for c in cols):
                continue
            lines.append(
                f"| {arm} | {mm} | {'; '.join(cols)} | "
                + ("—" if rate is None else f"{rate:g}")
                + " |"
            )
    return lines


def lr_section(grid: GridConfig, cells: List[dict], base_lr: Optional[float] = None) -> List[str]:
    """Markdown: the per-rate table with sensitivities, then the best-rate comparisons (v4
    grids: the rates chosen on the selection seeds instead; their tests are the headline's)."""
    if grid.v4:
        return lr_select_section(grid, cells, base_lr)
    rates = learning_rates(grid, base_lr)
    if not rates:
        return []
    lines = [
        "## Learning rates: each objective at its own best rate, and its sensitivity",
        "",
        "Final held-out accuracy, seed mean ± s.d. per learning rate; best rate in bold; "
        "sensitivity = max − min of the seed means over the rates.",
        "",
        "| objective | setting | rates | best lr | sensitivity |",
        "|---" * 5 + "|",
    ]
    for fam, by_lr in rates.items():
        for mm in grid.mismatch:
            got = sensitivity(cells, by_lr, mm)
            if got is None:
                continue
            best, sens, stats = got
            cols = []
            for lr, (m, sd) in stats.items():
                s = f"{lr:g}: {m:.3f} ± {sd:.3f}" if math.isfinite(m) else f"{lr:g}: —"
                cols.append(f"**{s}**" if lr == best else s)
            lines.append(f"| {fam} | {mm} | {'; '.join(cols)} | {best:g} | {sens:.3f} |")
    chosen = best_rates(grid, cells, rates)
    subject = chosen.get("p3o")
    comps = [family(c) for c in grid.comparators if family(c) in chosen and family(c) != "p3o"]
    if subject is None or not comps:
        return lines
    control = control_setting(grid)
    rows, tests = [], []
    for mm in [m for m in grid.mismatch if m != control]:
        for c in dict.fromkeys(comps):
            rows.append((mm, c))
            tests.append(
                seed_paired(seed_scores(cells, subject, mm), seed_scores(cells, chosen[c], mm), c)
            )
    tests = adjust(tests)
    lines += [
        "",
        f"Best rates chosen on `{control}` (not tested there): "
        + ", ".join(f"{f} → `{lab}`" for f, lab in chosen.items())
        + ". P3O at its rate − each comparator at its rate, paired by seed, Holm over these "
        f"{sum(t is not None for t in tests)} tests:",
        "",
        "| setting | comparison | per-seed differences | mean Δ [95% t-CI] | p Holm | "
        "p sign-flip | call |",
        "|---" * 7 + "|",
    ]
    for (mm, c), t in zip(rows, tests):
        what = f"`{subject}` − `{chosen[c]}`"
        if t is None:
            lines.append(f"| {mm} | {what} |" + " — |" * 5)
            continue
        per = ", ".join(f"{d:+.2f}" for d in t.diffs)
        lines.append(
            f"| {mm} | {what} | {per} | {t.mean:+.3f} [{t.lo:+.3f}, {t.hi:+.3f}] | "
            f"{t.p_adj:.3g} | {t.p_perm:.3g} | **{t.call()}** |"
        )
    return lines


def base_lr(grid: GridConfig):
    """The base recipe's learning rate (what objectives without their own ``optim.lr`` use)."""
    from megatron_p3o.config.loading import load_config
    from megatron_p3o.runtime.errors import ConfigError

    try:
        return load_config(grid.base).optim.lr
    except ConfigError:  # a report from cells alone (base recipe moved): rates from the grid only
        return None
