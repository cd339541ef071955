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

import math
from typing import Callable, List, Sequence, Tuple

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
