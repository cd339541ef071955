"""The probe's verdict table from a committed v4-style study: one level per engine-side setting
(what a probe can measure: not staleness, reuse or corrupted reported ℓb), with its mismatch
(each setting's probe columns averaged over its cells) and the declared family's calls.

    python tools/verdict_levels.py recipes/stress_v4_tiny_cpu.yaml docs/stress_v4_tiny_cpu \
        recipes/stress_v4_chain_tiny_cpu.yaml docs/stress_v4_chain_tiny_cpu

prints the ``LEVELS`` entries of ``megatron_p3o/stress/verdicts.py`` (paste them there); a
sequential (v5) study's report directory, which has a ``calls.csv``, is read from that instead
(``python tools/verdict_levels.py recipes/stress_v5_tiny_cpu.yaml docs/stress_v5_tiny_cpu``). A
level's arm **failed** when it is called worse than P3O there, P3O when an arm is called better;
an arm **held** when called equivalent or better, P3O when every arm is called equivalent or
worse; the rest are **undecided** (one meaning, issue 65; the table keeps each call).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXOGENOUS = ("baseline", "logit_noise", "weight_rounding", "precision", "engine_temperature")


def _cells(report_dir: Path) -> list:
    rows = []
    for r in csv.DictReader(open(report_dir / "cells.csv")):
        r["seed"] = int(r["seed"])
        for k in ("acc_end", "probe_abs_dlogp", "probe_abs_seq_dlogp", "probe_kl_b_theta"):
            r[k] = float(r[k]) if r.get(k) not in (None, "") else None
        rows.append(r)
    return rows


def _what(spec, grid_name: str) -> str:
    chain = ", 27-61-token completions" if "chain" in grid_name else ""
    if spec.family == "baseline":
        return f"embedded bf16 engine (the control){chain}"
    if spec.family == "logit_noise":
        return f"engine logit noise σ {spec.level:g}{chain}"
    if spec.family == "weight_rounding":
        return f"engine's weights rounded per channel to {spec.level:.3g}·max|w| (fp32 engine)"
    return f"{spec.family} {spec.level:g}{chain}"


KIND = {
    "baseline": "embedded_bf16",
    "logit_noise": "logit_noise",
    "weight_rounding": "weight_rounding",
    "engine_temperature": "engine_temperature",
}


def _status(arms, calls, failed):
    """(held, undecided) in the one meaning (megatron_p3o/stress/verdicts.py): an arm held when
    called equivalent or better than P3O, P3O when every arm is called equivalent or worse;
    neither shown: undecided."""
    held, undecided = [], []
    for a in arms:
        if a in failed:
            continue
        if a == "p3o":
            ok = calls and all(c in ("equivalent", "worse") for c in calls.values())
        else:
            ok = calls.get(a) in ("equivalent", "better")
        (held if ok else undecided).append(a)
    return tuple(held), tuple(undecided)


def _level(grid, setting, spec, at, arms, failed, calls) -> dict:
    """One setting's row: its measured mismatch (the cells' probe means), each arm's status."""

    def mean(k):
        return sum(c[k] for c in at) / len(at)

    return {
        "setting": setting,
        "grid": grid.name,
        "task": "reasoning_gym:chain_sum" if "chain" in grid.name else "arithmetic",
        "what": _what(spec, grid.name),
        "per_token": round(mean("probe_abs_dlogp"), 4),
        "per_sequence": round(mean("probe_abs_seq_dlogp"), 4),
        "kl": float(f"{mean('probe_kl_b_theta'):.3g}"),
        "kind": KIND.get(spec.family, spec.family),
        "held": _status(arms, calls, failed)[0],
        "undecided": _status(arms, calls, failed)[1],
        "failed": failed,
        "calls": calls,
    }


def levels_v5(grid_path: str, report_dir: str) -> list:
    """The levels of a sequential (v5) grid from its committed ``calls.csv`` (the final calls:
    an arm **failed** where it is called worse than P3O, P3O where an arm is called better; the
    rest **held**, each level keeping its calls: equivalent, undecided at cap, …)."""
    from megatron_p3o.stress.grid import arm_of, load_grid

    grid = load_grid(grid_path)
    cells = _cells(Path(report_dir))
    calls = list(csv.DictReader(open(Path(report_dir) / "calls.csv")))
    out = []
    for mm, spec in grid.mismatch.items():
        at = [c for c in cells if c["mismatch"] == mm and c["probe_abs_dlogp"] is not None]
        if spec.family not in EXOGENOUS or not at:
            continue

        arms = sorted({arm_of(c["objective"]) for c in cells if c["mismatch"] == mm})
        failed, got = {}, {}
        # a v6 row comparing one arm across two settings (comparator_setting) is not a call
        # between arms at this level
        same = (r for r in calls if r.get("comparator_setting", "") in ("", r["setting"]))
        for r in (r for r in same if r["setting"] == mm):
            got[r["arm"]] = r["call"]
            ci = f"[{float(r['ci_lo']):+.3f}, {float(r['ci_hi']):+.3f}]"
            what = (
                f"{float(r['delta']):+.3f} {ci} at look {r['look']} ({r['test_seeds']} seeds), "
                f"p {r['p_adjusted']}"
            )
            if r["call"] == "worse":
                failed[r["arm"]] = f"worse than {r['comparator']} ({what})"
            elif r["call"] == "better":
                sep = "; " if failed.get(r["comparator"]) else ""
                failed[r["comparator"]] = (
                    failed.get(r["comparator"], "") + f"{sep}{r['arm']} better ({what})"
                )
        setting = mm if "chain" not in grid.name else f"chain {mm}"
        out.append(_level(grid, setting, spec, at, arms, failed, got))
    return out


def levels(grid_path: str, report_dir: str) -> list:
    from megatron_p3o.stress.grid import arm_of, load_grid
    from megatron_p3o.stress.report import _base_lr, adjust_family, v4_tests

    grid = load_grid(grid_path)
    cells = _cells(Path(report_dir))
    declared, _ = v4_tests(grid, cells, _base_lr(grid))
    rows = adjust_family(declared)
    out = []
    for mm, spec in grid.mismatch.items():
        if spec.family not in EXOGENOUS:
            continue
        at = [c for c in cells if c["mismatch"] == mm and c["probe_abs_dlogp"] is not None]
        if not at:
            continue

        arms = sorted({arm_of(c["objective"]) for c in cells if c["mismatch"] == mm})
        failed, calls = {}, {}
        for _, setting, arm, comp, _, _, t in rows:
            if setting != mm or t is None:
                continue
            call = t.verdict()
            calls[arm] = call
            what = f"{t.mean:+.3f} [{t.lo:+.3f}, {t.hi:+.3f}], Holm p {t.p_adj:.2g}"
            if call == "worse":
                failed[arm] = f"worse than {comp} by {-t.mean:.3f} ({what})"
            elif call == "better":
                failed.setdefault(comp, "")
                sep = "; " if failed[comp] else ""
                failed[comp] += f"{sep}{arm} better by {t.mean:.3f} ({what})"
        setting = mm if grid.name.endswith("v4_tiny_cpu") else f"chain {mm}"
        out.append(_level(grid, setting, spec, at, arms, failed, calls))
    return out


def main(argv) -> None:
    import pprint

    if len(argv) % 2:
        sys.exit("usage: verdict_levels.py GRID REPORT_DIR [GRID REPORT_DIR ...]")
    for g, d in zip(argv[::2], argv[1::2]):
        v5 = (Path(d) / "calls.csv").is_file()
        for lv in (levels_v5 if v5 else levels)(g, d):
            pprint.pprint(lv, width=92, sort_dicts=False)


if __name__ == "__main__":
    main(sys.argv[1:])
