"""The arithmetic of stress study v5's plan, from committed cells only (issue 54, item 2):
which endpoint and horizon need the fewest seeds per question, what pairing by seed buys, the
planning s.d. of every setting, the seeds each question needs at the study's α, and the design's
power, decided share and cost by simulation.

``python -m megatron_p3o.stress.pilot`` prints the tables of ``docs/stress_v5_plan.md`` from
``docs/stress_v5_pilot_tiny_cpu/cells.csv`` (the pilot: 60-step cells with the held-out accuracy
after every step from 10 on, fresh seeds), ``docs/stress_v4_tiny_cpu/cells.csv`` (v4's seed s.d.s
and effects per setting) and the v5 grid (its design).
"""

from __future__ import annotations

import argparse
import math
from typing import Dict, List, Sequence, Tuple

import numpy as np

ARMS = ("tis", "grpo_recompute", "p3o_no_kl")
HORIZONS = (20, 30, 40, 50, 60)
PARALLEL = 1.71  # v4: 216.1 min of cell time in 126.2 min with --workers 2 (2-core AVX-512 EPYC)
# candidate endpoints: (name, description, steps evaluated for horizon H)
ENDPOINTS = (
    ("final", "the last evaluation", lambda h: [h]),
    ("last3", "mean of the last 3 (every step)", lambda h: [h - 2, h - 1, h]),
    ("last10", "mean of the last 10 (every step)", lambda h: list(range(h - 9, h + 1))),
    ("every5", "mean every 5 steps over the second half", lambda h: list(range(h, h // 2 - 1, -5))),
    ("every2", "mean every 2 steps over the second half", lambda h: list(range(h, h // 2 - 1, -2))),
    ("half", "mean every step over the second half", lambda h: list(range(h // 2, h + 1))),
)


def _pairs(rows: List[dict], steps_of) -> List[Tuple[str, str, np.ndarray, np.ndarray]]:
    """Per (setting, arm): the arm's and P3O's endpoint per common seed (pilot rows)."""
    by: Dict[Tuple[str, str, int], float] = {}
    for r in rows:
        if r["status"] != "ok":
            continue
        try:
            by[(r["mismatch"], r["objective"].split("@")[0], int(r["seed"]))] = float(
                np.mean([float(r[f"acc_s{s}"]) for s in steps_of])
            )
        except (KeyError, ValueError):
            continue
    out = []
    for mm in dict.fromkeys(r["mismatch"] for r in rows):
        for arm in ARMS:
            seeds = sorted(s for m, a, s in by if m == mm and a == arm and (mm, "p3o", s) in by)
            if len(seeds) >= 3:
                a = np.array([by[(mm, arm, s)] for s in seeds])
                p = np.array([by[(mm, "p3o", s)] for s in seeds])
                out.append((mm, arm, a, p))
    return out


def endpoint_table(rows: List[dict]) -> Tuple[List[str], Dict[Tuple[int, str], float]]:
    """Markdown: per horizon and endpoint, the paired seed s.d. (RMS over the pilot's
    comparisons), its ratio to the last evaluation at 30 steps (geometric mean of the per-
    comparison ratios), the unpaired s.d., the mean |Δ| and the seeds and cost relative to v4's
    endpoint. Returns (lines, {(H, name): s.d. ratio})."""
    base = {(mm, arm): np.std(a - p, ddof=1) for mm, arm, a, p in _pairs(rows, [30])}
    lines = [
        "| horizon | endpoint | evaluations | paired s.d. (RMS) | ratio to final@30 | unpaired "
        "s.d. | mean \\|Δ\\| | \\|Δ\\|/s.d. | seeds for equivalence (rel.) | cost (rel.) |",
        "|---" * 10 + "|",
    ]
    ratios = {}
    for h in HORIZONS:
        for name, what, steps in ENDPOINTS:
            pr = _pairs(rows, steps(h))
            if not pr:
                continue
            sd = np.array([np.std(a - p, ddof=1) for *_, a, p in pr])
            unp = np.array([math.sqrt(np.var(a, ddof=1) + np.var(p, ddof=1)) for *_, a, p in pr])
            delta = np.array([abs(np.mean(a - p)) for *_, a, p in pr])
            logs = [np.log(s / base[(m, k)]) for (m, k, *_), s in zip(pr, sd)]
            rat = float(np.exp(np.mean(logs)))
            ratios[(h, name)] = rat
            rms = float(np.sqrt(np.mean(sd**2)))
            lines.append(
                f"| {h} | {what} | {len(steps(h))} | {rms:.4f} | {rat:.2f} | "
                f"{float(np.sqrt(np.mean(unp**2))):.4f} | {delta.mean():.4f} | "
                f"{delta.mean() / rms:.2f} | {rat**2:.2f} | {rat**2 * h / 30:.2f} |"
            )
    return lines, ratios


def pairing_table(rows: List[dict], steps: Sequence[int]) -> List[str]:
    """Markdown: per pilot comparison at the chosen endpoint, the paired and unpaired s.d. and
    the correlation of the two arms over seeds (same prompts, same sampling streams)."""
    lines = [
        "| setting | arm − p3o | Δ | paired s.d. | unpaired s.d. | correlation | seeds ×",
        "|---" * 6 + "|---|",
    ]
    lines[0] += " |"
    for mm, arm, a, p in _pairs(rows, steps):
        sd, unp = np.std(a - p, ddof=1), math.sqrt(np.var(a, ddof=1) + np.var(p, ddof=1))
        lines.append(
            f"| {mm} | {arm} | {np.mean(a - p):+.4f} | {sd:.4f} | {unp:.4f} | "
            f"{np.corrcoef(a, p)[0, 1]:+.2f} | {(sd / unp) ** 2:.2f} |"
        )
    return lines


def v4_effects(grid_path: str, cells_path: str) -> List[Tuple[str, str, float, float]]:
    """(setting, arm, Δ, paired s.d.) of v4's arm − P3O at v4's chosen rates over all 8 seeds
    (its final held-out accuracy)."""
    from megatron_p3o.stress.grid import load_grid
    from megatron_p3o.stress.lr_sweep import chosen_rates
    from megatron_p3o.stress.study import read_cells

    grid = load_grid(grid_path)
    cells = read_cells(cells_path)
    chosen = chosen_rates(grid, cells, 2e-4)
    acc = {(c["objective"], c["mismatch"], c["seed"]): c["acc_end"] for c in cells}
    out = []
    for mm in grid.mismatch:
        for arm in ARMS:
            d = np.array([acc[(chosen[(arm, mm)], mm, s)] - acc[(chosen[("p3o", mm)], mm, s)]
                          for s in range(1, 9)])  # fmt: skip
            out.append((mm, arm, float(d.mean()), float(np.std(d, ddof=1))))
    return out


def plan_tables(design, effects, sd_ratio: float, delta_ratio: float, cell_s: Dict[str, float],
                n_sim: int = 4000) -> Dict[str, List[str]]:  # fmt: skip
    """The plan's tables: per setting the planning s.d. (v4's RMS over its comparisons ×
    ``sd_ratio``), the fixed-sample seeds at α/m, the design's power at +0.05 (simulated); then
    the whole design under v4's effects × ``delta_ratio`` (each study drawing its true
    differences around them), per comparison and overall, with its cost in cell-seconds."""
    from megatron_p3o.stress.sequential import Design, simulate
    from megatron_p3o.stress.stats import fewest_seeds, power_paired, power_tost

    each = design.alpha / design.m
    settings = list(dict.fromkeys(mm for mm, *_ in effects))
    k = len(design.looks)
    power = [
        "| setting | planning s.d. | power at +0.05 by the cap | "
        + " | ".join(f"by look {i + 1}" for i in range(k - 1))
        + " | power at +0.025 by the cap | P(equivalent) at Δ 0 | fixed-sample seeds at α/m: "
        "superiority +0.05 | equivalence ±margin (Δ 0) |",
        "|---" * (k + 6) + "|",
    ]
    for mm in settings:
        sds = [sd for m, _, _, sd in effects if m == mm]
        sd = float(np.sqrt(np.mean(np.square(sds)))) * sd_ratio
        sim = simulate(design, [0.05, 0.025, 0.0], [sd] * 3, [0, 1, 2], n_sim=n_sim, seed=7)
        c, lk = sim["call"], sim["look"]
        by = [float(((c[:, 0] == 0) & (lk[:, 0] <= i + 1)).mean()) for i in range(k - 1)]
        sup = fewest_seeds(lambda n, sd=sd: power_paired(0.05, sd, n, each) >= 0.8)
        eq = fewest_seeds(lambda n, sd=sd: power_tost(sd, n, design.margin, each) >= 0.8)
        power.append(
            f"| `{mm}` | {sd:.4f} | {float((c[:, 0] == 0).mean()):.3f} | "
            + " | ".join(f"{b:.3f}" for b in by)
            + f" | {float((c[:, 1] == 0).mean()):.3f} | {float((c[:, 2] == 2).mean()):.3f} | "
            f"{sup} | {eq} |"
        )
    m = len(effects)
    d0 = np.array([e[2] for e in effects]) * delta_ratio
    sds = np.array([e[3] for e in effects]) * sd_ratio
    g = np.random.default_rng(3)  # each study's true differences: v4's estimate ± its s.e.
    deltas = d0[None, :] + g.standard_normal((n_sim, m)) * (sds / math.sqrt(8))[None, :]
    sim = simulate(Design(design.looks, design.alpha, m, design.margin, design.spending,
                          design.gamma), deltas, sds, [e[0] for e in effects],
                   n_sim=n_sim, seed=1)  # fmt: skip
    call, look = sim["call"], sim["look"]
    looks = np.array(design.looks)
    per = [
        "| setting | arm − p3o | planning Δ | planning s.d. | P(better) | P(worse) | "
        "P(equivalent) | P(undecided at cap) | mean seeds |",
        "|---" * 9 + "|",
    ]
    for j, (mm, arm, *_) in enumerate(effects):
        c = call[:, j]
        per.append(
            f"| {mm} | {arm} | {d0[j]:+.3f} | {sds[j]:.4f} | {np.mean(c == 0):.2f} | "
            f"{np.mean(c == 1):.2f} | {np.mean(c == 2):.2f} | {np.mean(c == 3):.2f} | "
            f"{looks[look[:, j] - 1].mean():.1f} |"
        )
    cost = np.zeros(n_sim)
    worst = first = 0.0
    for mm in settings:
        j = [i for i, e in enumerate(effects) if e[0] == mm]
        n = looks[look[:, j] - 1]
        cost += (n.sum(1) + n.max(1)) * cell_s[mm]  # the arms' seeds, and P3O's as far as any
        worst += (len(j) + 1) * looks[-1] * cell_s[mm]
        first += (len(j) + 1) * looks[0] * cell_s[mm]
    decided = (call < 3).mean(1)
    par = PARALLEL
    summary = [
        f"- Decided (better, worse or equivalent) by the cap: {decided.mean():.1%} of the {m} "
        f"comparisons on average; at least 80% of them in {np.mean(decided >= 0.8):.1%} of "
        f"{n_sim} simulated studies.",
        f"- Cell time summed: expected {cost.mean() / 3600:.2f} h, first look "
        f"{first / 3600:.2f} h, worst case (nothing decided before the cap) "
        f"{worst / 3600:.2f} h; wall time with `--workers 2` (÷ {par}, v4's measured ratio of "
        "summed cell time to wall time on this machine): expected "
        f"{cost.mean() / 3600 / par:.2f} h, first look {first / 3600 / par:.2f} h, worst case "
        f"{worst / 3600 / par:.2f} h.",
    ]
    return {"power": power, "per": per, "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pilot", default="docs/stress_v5_pilot_tiny_cpu/cells.csv")
    ap.add_argument("--v4-grid", default="recipes/stress_v4_tiny_cpu.yaml")
    ap.add_argument("--v4-cells", default="docs/stress_v4_tiny_cpu/cells.csv")
    ap.add_argument("--grid", default="recipes/stress_v5_tiny_cpu.yaml")
    a = ap.parse_args(argv)
    import csv

    from megatron_p3o.stress.grid import load_grid
    from megatron_p3o.stress.looks import design

    rows = list(csv.DictReader(open(a.pilot)))
    table, ratios = endpoint_table(rows)
    grid = load_grid(a.grid)
    ep = grid.endpoint_steps or [30]
    print("## Endpoint and horizon (pilot)\n", *table, sep="\n")
    print(f"\n## Pairing at the chosen endpoint (steps {ep})\n", *pairing_table(rows, ep),
          sep="\n")  # fmt: skip
    chosen = next(k for k, _, f in ENDPOINTS if f(30) == sorted(ep, reverse=True)
                  or f(30) == sorted(ep))  # fmt: skip
    sd_ratio = ratios[(30, chosen)]
    base = _pairs(rows, [30])
    new = _pairs(rows, ep)
    delta_ratio = float(np.mean([abs(np.mean(a - p)) for *_, a, p in new])
                        / np.mean([abs(np.mean(a - p)) for *_, a, p in base]))  # fmt: skip
    cell_s = _cell_seconds(a.v4_cells, rows, ep)
    effects = v4_effects(a.v4_grid, a.v4_cells)
    t = plan_tables(design(grid), effects, sd_ratio, delta_ratio, cell_s)
    print(f"\nendpoint `{chosen}`: s.d. ratio {sd_ratio:.3f}, effect ratio {delta_ratio:.3f}")
    print("\n## Power per setting\n", *t["power"], "", *t["per"], "", *t["summary"], sep="\n")
    print("\n## Cell seconds per setting (one worker)\n")
    print(", ".join(f"{k} {v:.1f}" for k, v in cell_s.items()))
    return 0


def _cell_seconds(v4_cells: str, pilot_rows: List[dict], ep: Sequence[int]) -> Dict[str, float]:
    """Seconds per cell per setting for one worker of ``--workers 2`` on this 2-core machine:
    v4's measured cell time (30 steps, one evaluation, two workers side by side) plus the
    endpoint's extra evaluations at the pilot's cost per evaluation."""
    import csv

    by: Dict[str, List[float]] = {}
    for r in csv.DictReader(open(v4_cells)):
        by.setdefault(r["mismatch"], []).append(float(r["wall_s"]))
    # the pilot: 60 steps and 51 evaluations per cell; v4: 30 steps and 1 evaluation
    per_eval = 0.2  # s, 500 prompts greedy (measured: 16 evaluations add 2-5 s to a 30-step cell)
    extra = per_eval * max(0, len(ep) - 1)
    return {mm: float(np.mean(v)) + extra for mm, v in by.items()}


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "megatron_p3o.stress.pilot")
