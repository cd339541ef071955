"""Mechanisms behind a stress grid's accuracies, per setting and objective: what each optimizer
step looked like, so a break point can be explained rather than only located.

Columns (each the mean over seeds ± seed s.d. of a per-cell run average):
- ``e_B``: the normalized ESS against πb per optimizer step (mean, and the run's minimum);
- ``‖g‖``: the gradient norm *before* clipping, and the share of steps ``clip_grad`` cut;
- ``‖Δθ‖/‖θ‖``: the update's relative size after clipping, under Adam (``optim.log_update_size``);
- entropy: the policy's mean token entropy over the first and the last five rollout batches (an
  entropy that keeps falling under fresh engine noise is the "entropy ratchet");
- KL(πb‖πθ): the per-token mismatch the run faced (reuse and staleness included), an outcome of
  the objective as much as of the setting (the setting's own mismatch is the probe's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_p3o.stress.grid import GridConfig
from megatron_p3o.stress.stats import mean_sd

# (column, cell key, format); the cell keys come from stress.runner.summarize
COLUMNS = (
    ("e_B mean", "ess_mean", ".3f"),
    ("e_B min", "ess_step_min", ".3f"),
    ("‖g‖ before clip", "grad_norm_mean", ".2f"),
    ("steps clipped", "grad_clipped_run", ".0%"),
    ("‖Δθ‖/‖θ‖ ×1e3", "update_rel_run", "1e3"),
    ("entropy first 5", "entropy_first5", ".3f"),
    ("entropy last 5", "entropy_last5", ".3f"),
    ("KL(πb‖πθ) run", "kl_b_theta_run", ".4f"),
)

K3_NOTE = (
    "The (1 − e_B)·k3 term of P3O and P4O is evaluated on tokens sampled from πb, so it "
    "estimates E_b[k3] = χ²(πb‖πθ) − KL(πb‖πθ), not KL(πθ‖πb) (faithful to the paper and "
    "FeynRL; checked by exact enumeration in "
    "`tests/unit/test_objectives.py::test_k3_on_behaviour_samples_estimates_chi2_minus_kl`)."
)


def mean_sd_text(xs: List[float], fmt: str) -> str:
    """``"mean ± s.d."`` of the finite values of ``xs`` over seeds ("—" when there are none);
    ``fmt`` is a format spec, or "1e3" for the value ×1000 to two decimals."""
    xs = [float(x) for x in xs if _finite(x)]
    if not xs:
        return "—"
    m, sd = mean_sd(xs)
    if fmt == "1e3":
        return f"{m * 1e3:.2f} ± {sd * 1e3:.2f}"
    return f"{m:{fmt}} ± {sd:{fmt}}"


def seed_table(
    grid: GridConfig,
    cells: List[dict],
    cols: Sequence[Tuple[str, str, str]],
    value: Callable[[dict, str], float],
) -> List[str]:
    """A markdown table, one row per (setting, objective) with cells, one column per
    ``(name, key, fmt)`` of ``cols``: :func:`mean_sd_text` of ``value(cell, key)`` over seeds."""
    lines = [
        "| setting | objective | " + " | ".join(n for n, _, _ in cols) + " |",
        "|---" * (len(cols) + 2) + "|",
    ]
    for mm in grid.mismatch:
        for obj in grid.objectives:
            sel = [c for c in cells if c["mismatch"] == mm and c["objective"] == obj]
            if sel:
                vals = [mean_sd_text([value(c, k) for c in sel], f) for _, k, f in cols]
                lines.append(f"| {mm} | {obj} | " + " | ".join(vals) + " |")
    return lines


def mechanisms_section(grid: GridConfig, cells: List[dict]) -> List[str]:
    """The markdown section (empty when no cell recorded the mechanism columns)."""
    ok = [c for c in cells if c.get("status") == "ok"]
    have = [k for _, k, _ in COLUMNS if any(_finite(c.get(k)) for c in ok)]
    if "grad_clipped_run" not in have:  # cells from before the mechanism columns
        return []
    cols = [(n, k, f) for n, k, f in COLUMNS if k in have]
    lines = [
        "## Mechanisms (per optimizer step, mean ± seed s.d.)",
        "",
        "What each step looked like, to explain the break points: the ESS e_B against πb, the "
        "gradient norm before `clip_grad` and the share of steps it cut, the update's relative "
        "size under Adam, the policy entropy at the start and end of the run, and the "
        "KL(πb‖πθ) the run faced.",
        "",
    ]
    lines += seed_table(grid, ok, cols, lambda c, k: c.get(k, float("nan")))
    return lines + ["", K3_NOTE]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# -- reuse: what each epoch over the same rollout batch looks like ------------------------------

# (column, per_step key, format)
EPOCH_COLUMNS = (
    ("e_B", "ess", ".3f"),
    ("KL(πb‖πθ)", "kl_behavior_theta", ".4f"),
    ("KL(π one epoch back‖πθ)", "kl_prev_epoch", ".4f"),
    ("tokens with ρ > e_B", "frac_rho_above_ess", ".0%"),
    ("score weight at the cap", "capped_weight_share", ".0%"),
    ("‖g‖ before clip", "grad_norm", ".2f"),
    ("steps clipped", "grad_clipped", ".0%"),
    ("‖Δθ‖/‖θ‖ ×1e3", "update_rel", "1e3"),
)
EPOCH_ARMS = ("p3o", "p3o_no_kl", "p3o_capped", "tis")


def cell_epochs(metrics: Path) -> Dict[int, Dict[str, float]]:
    """``{epoch: {per_step key: mean over the run's rollout batches}}`` from a cell's
    ``metrics.jsonl`` (each line's ``per_step``: one entry per optimizer step, with its epoch)."""
    acc: Dict[int, Dict[str, List[float]]] = {}
    for line in metrics.read_text().splitlines():
        for st in json.loads(line).get("per_step") or []:
            row = acc.setdefault(int(st.get("epoch", 0)), {})
            for _, k, _ in EPOCH_COLUMNS:
                if _finite(st.get(k)):
                    row.setdefault(k, []).append(float(st[k]))
    return {e: {k: sum(v) / len(v) for k, v in row.items()} for e, row in sorted(acc.items())}


def epoch_rows(
    grid: GridConfig, cells: List[dict], chosen: Dict[tuple, Optional[str]]
) -> List[dict]:
    """One row per (reuse setting, arm at its chosen rate, seed, epoch), read from the finished
    cells' run directories under ``grid.work`` (settings of family ``reuse_epochs``)."""
    rows = []
    for mm, spec in grid.mismatch.items():
        if spec.family != "reuse_epochs":
            continue
        for (arm, setting), label in sorted(chosen.items(), key=lambda kv: kv[0]):
            if setting != mm or label is None:
                continue
            for c in cells:
                if c["objective"] != label or c["mismatch"] != mm or c.get("status") != "ok":
                    continue
                seed = c["seed"]
                f = Path(grid.work) / c["cell"] / "metrics.jsonl"
                if not f.is_file():
                    continue
                for e, vals in cell_epochs(f).items():
                    rows.append(
                        {"setting": mm, "arm": arm, "label": label, "seed": seed,
                         "epoch": e + 1, **vals}
                    )  # fmt: skip
    return rows


def epoch_section(grid: GridConfig, rows: List[dict]) -> List[str]:
    """Markdown: per reuse setting, arm (:data:`EPOCH_ARMS`) and epoch, mean ± seed s.d. of each
    :data:`EPOCH_COLUMNS` value (empty without reuse cells)."""
    if not rows:
        return []
    lines = [
        "## Reuse: each epoch over the same rollout batch (mean ± seed s.d.)",
        "",
        "Per epoch of `batch.epochs` (the same rollout batch trained on again), each arm at its "
        "chosen rate, all seeds: the step's e_B, the KL(πb‖πθ) to the engine that sampled the "
        "batch, the KL from the policy one epoch earlier to this epoch's start on the same "
        "tokens (what the previous epoch moved; from epoch 2), the share of valid tokens whose ρ "
        "exceeds e_B (capped in P3O's score term) and their share of the score term's weight "
        "Σ|min(ρ, e_B)·A| (of the gradient's coefficients, not of its norm), the gradient norm "
        "before clipping, the share of steps clipped and the update's relative size. Every "
        "arm's rows are in `epochs.csv`.",
        "",
        "| setting | arm | epoch | " + " | ".join(n for n, _, _ in EPOCH_COLUMNS) + " |",
        "|---" * (len(EPOCH_COLUMNS) + 3) + "|",
    ]
    for mm in dict.fromkeys(r["setting"] for r in rows):
        for arm in EPOCH_ARMS:
            sel = [r for r in rows if r["setting"] == mm and r["arm"] == arm]
            if not sel:
                continue
            lab = sel[0]["label"]
            rate = lab.split("@lr", 1)[1] if "@lr" in lab else ""
            for e in sorted({r["epoch"] for r in sel}):
                at = [r for r in sel if r["epoch"] == e]
                vals = [mean_sd_text([r.get(k, float("nan")) for r in at], f)
                        for _, k, f in EPOCH_COLUMNS]  # fmt: skip
                name = f"{arm} (lr {rate})" if rate else arm
                lines.append(f"| {mm} | {name} | {e} | " + " | ".join(vals) + " |")
    return lines
