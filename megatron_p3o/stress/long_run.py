"""Long runs in a stress grid: the eval sets' curves over training (pass@k, greedy accuracy) and
where each objective ends on entropy, KL to the reference and completion length.

A grid turns this on with ``eval.sets`` and ``eval.every`` in its ``set:`` (and
``reference.enabled: true`` for the KL to the reference): each cell then evaluates the sets at
the base weights, every ``eval.every`` steps and at the end (``stress.runner``), and keeps the
curve in its ``cell.json``. The per-step curves of entropy, KL to the reference and completion
length come from ``metrics.jsonl`` (``plots.plot_curves``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megatron_p3o.stress.grid import GridConfig
from megatron_p3o.stress.mechanisms import seed_table
from megatron_p3o.stress.plots import _legend
from megatron_p3o.stress.stats import mean_sd


def _curve_keys(cells: List[dict]) -> List[str]:
    """The eval-set metrics on the curves: each set's greedy accuracy, mean pass@1 (unless
    pass@1 is among its k) and pass@k."""
    keys: Dict[str, None] = {}
    for c in cells:
        for point in c.get("eval_curve") or []:
            for k in point:
                if k.startswith("eval/") and not k.endswith("/prompts"):
                    keys.setdefault(k)
    # the mean pass@1 equals the unbiased pass@1 estimate: shown once when both are there
    return [k for k in keys if not (k.endswith("/pass@1_mean") and k[:-5] in keys)]


def _by_step(cells: List[dict], key: str) -> Tuple[List[int], List[float], List[float]]:
    """(steps, seed means, seed s.d.) of ``key`` over the cells' curves, at the steps all have."""
    runs = [{p["step"]: p[key] for p in c["eval_curve"] if key in p} for c in cells]
    runs = [r for r in runs if r]
    if not runs:
        return [], [], []
    steps = sorted(set.intersection(*(set(r) for r in runs)))
    stats = [mean_sd([r[s] for r in runs]) for s in steps]
    return steps, [m for m, _ in stats], [sd for _, sd in stats]


def plot_eval_curves(out: Path, grid: GridConfig, cells: List[dict]) -> Optional[Path]:
    """One column per setting, one row per eval metric; a line per objective (seed mean, band ±
    one seed s.d.)."""
    ok = [c for c in cells if c.get("status") == "ok" and c.get("eval_curve")]
    keys = _curve_keys(ok)
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mms = [mm for mm in grid.mismatch if any(c["mismatch"] == mm for c in ok)]
    fig, axes = plt.subplots(
        len(keys), len(mms), figsize=(4.5 * len(mms), 2.8 * len(keys)), squeeze=False,
        sharex=True, sharey="row",
    )  # fmt: skip
    for j, mm in enumerate(mms):
        for i, key in enumerate(keys):
            ax = axes[i][j]
            for obj in grid.objectives:
                sel = [c for c in ok if c["mismatch"] == mm and c["objective"] == obj]
                xs, ms, sds = _by_step(sel, key)
                if not xs:
                    continue
                lw = 2.2 if obj.startswith("p3o") else 1.0
                ax.plot(xs, ms, marker="o", ms=3, lw=lw, label=obj)
                lo = [m - s for m, s in zip(ms, sds)]
                hi = [m + s for m, s in zip(ms, sds)]
                ax.fill_between(xs, lo, hi, alpha=0.12)
            ax.set_title(f"{mm}: {key.removeprefix('eval/')}", fontsize=9)
            ax.grid(alpha=0.3)
            if i == len(keys) - 1:
                ax.set_xlabel("step")
    _legend(axes[0][0], fontsize=7)
    from megatron_p3o.stress.plots import _save

    title = f"{grid.name}: eval sets over training (seed mean ± s.d.)"
    return _save(fig, out / "eval_curves.png", title)


def long_run_section(grid: GridConfig, cells: List[dict]) -> List[str]:
    """Where each objective ends after a long run (empty when no cell has an eval curve)."""
    ok = [c for c in cells if c.get("status") == "ok" and c.get("eval_curve")]
    keys = _curve_keys(ok)
    if not keys:
        return []
    cols = [(k.removeprefix("eval/").replace("/", " "), k, ".3f") for k in keys]
    cols += [
        ("entropy last 5", "entropy_last5", ".3f"),
        ("KL(πθ‖πref) last 5", "kl_ref_last5", ".4f"),
        ("completion len last 5", "completion_len_last5", ".2f"),
    ]
    steps = max((c.get("steps", 0) for c in ok), default=0)
    lines = [
        f"## Long runs: where each objective ends after {steps} steps (mean ± seed s.d.)",
        "",
        "The eval sets at the last step (curves from the base weights on in `eval_curves.png`), "
        "the policy entropy, the k3 estimate of KL(πθ‖πref) to the initial policy on the rollout "
        "samples, and the mean completion length over the last five rollout batches.",
        "",
    ]

    def value(c: dict, k: str) -> float:
        point = c["eval_curve"][-1] if k.startswith("eval/") else c
        return point.get(k, float("nan"))

    return lines + seed_table(grid, ok, cols, value)
