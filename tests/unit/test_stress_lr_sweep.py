"""The learning-rate section of the stress report (stress/lr_sweep.py) on synthetic cells, checked
against sums written out here."""

import math

from megatron_p3o.stress.grid import GridConfig, MismatchSpec, ObjectiveSpec
from megatron_p3o.stress.lr_sweep import best_rates, learning_rates, lr_section


def _grid():
    o = {
        "p3o": ObjectiveSpec("p3o"),
        "p3o@lr1e-3": ObjectiveSpec("p3o", set={"optim.lr": 1e-3}),
        "grpo": ObjectiveSpec("grpo"),
        "grpo@lr1e-3": ObjectiveSpec("grpo", set={"optim.lr": 1e-3}),
        "tis": ObjectiveSpec("tis"),  # one rate only: not a sweep
    }
    m = {"bf16": MismatchSpec("baseline"), "reuse": MismatchSpec("reuse", 4.0)}
    return GridConfig(
        base="x", objectives=o, mismatch=m, seeds=[1, 2, 3, 4], comparators=["grpo"],
        set={"optim.lr": 3e-4},
    )  # fmt: skip


def _cells():
    # acc = base[label][setting] + seed noise (same offset per seed across labels)
    base = {
        "p3o": {"bf16": 0.60, "reuse": 0.40},
        "p3o@lr1e-3": {"bf16": 0.70, "reuse": 0.50},
        "grpo": {"bf16": 0.65, "reuse": 0.60},
        "grpo@lr1e-3": {"bf16": 0.50, "reuse": 0.30},
        "tis": {"bf16": 0.6, "reuse": 0.6},
    }
    noise = {1: 0.01, 2: -0.02, 3: 0.03, 4: -0.02}  # sums to 0: seed means are exact
    return [
        {"objective": lab, "mismatch": mm, "seed": s, "status": "ok", "acc_end": v + noise[s]}
        for lab, by in base.items()
        for mm, v in by.items()
        for s in noise
    ]


def test_rates_best_rate_and_sensitivity():
    g, cells = _grid(), _cells()
    rates = learning_rates(g)
    assert rates == {
        "p3o": {3e-4: "p3o", 1e-3: "p3o@lr1e-3"},
        "grpo": {3e-4: "grpo", 1e-3: "grpo@lr1e-3"},
    }
    # chosen on the control (first setting): p3o's 1e-3 (0.70 > 0.60), grpo's 3e-4 (0.65 > 0.50)
    assert best_rates(g, cells, rates) == {"p3o": "p3o@lr1e-3", "grpo": "grpo"}
    md = "\n".join(lr_section(g, cells))
    assert "| p3o | bf16 | 0.0003: 0.600 ± 0.024; **0.001: 0.700 ± 0.024** | 0.001 | 0.100 |" in md
    assert "| grpo | reuse |" in md and "| 0.0003 | 0.300 |" in md  # grpo reuse: 0.60 vs 0.30
    # the best-rate comparison is made outside the control only: reuse, p3o@1e-3 − grpo@3e-4
    # = 0.50 − 0.60 for every seed (the seed offsets cancel): −0.100 with a zero-width interval
    assert "| reuse | `p3o@lr1e-3` − `grpo` | -0.10, -0.10, -0.10, -0.10 | -0.100" in md
    assert "| bf16 | `p3o@lr1e-3`" not in md
    # 4 seeds: the exact sign-flip test cannot go below 2/2^4 = 0.125, so no call is made
    assert "| 0.125 | **tie** |" in md


def test_no_sweep_no_section():
    g = _grid()
    g = GridConfig(**{**g.__dict__, "objectives": {"p3o": ObjectiveSpec("p3o")}})
    assert lr_section(g, _cells()) == []
    assert math.isclose(3e-4, learning_rates(_grid())["p3o"].__iter__().__next__())
