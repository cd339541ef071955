"""The paired bootstrap CI against hand-computed cases."""

import pytest

from megatron_p3o.stress.stats import paired_bootstrap, versus_best_baseline


def test_constant_difference_has_a_zero_width_interval():
    a = [[1, 1, 0, 1], [0, 1, 1, 1], [1, 0, 1, 1]]
    b = [[x - 0.25 for x in row] for row in a]
    r = paired_bootstrap(a, b)
    assert r.diff == pytest.approx(0.25) and r.lo == pytest.approx(0.25)
    assert r.hi == pytest.approx(0.25) and r.verdict == "win"


def test_two_prompt_case_by_hand():
    """One seed, per-prompt differences [0, 1]: a replicate draws two prompts, so its mean is
    0, 0.5 or 1 with probabilities 1/4, 1/2, 1/4 — the 2.5% and 97.5% percentiles are 0 and 1,
    the estimate 0.5, and the interval holds 0: a tie."""
    r = paired_bootstrap([[1, 1]], [[1, 0]], n_boot=4000)
    assert r.diff == 0.5 and r.lo == 0.0 and r.hi == 1.0 and r.verdict == "tie"


def test_seed_level_resampling_widens_the_interval():
    """Prompts agree within each seed but seeds disagree in sign: the prompt level alone would
    give a zero-width interval per seed; resampling seeds spans their spread."""
    a = [[1.0] * 50, [0.0] * 50]
    b = [[0.0] * 50, [1.0] * 50]
    r = paired_bootstrap(a, b)
    assert r.diff == 0.0 and r.lo == -1.0 and r.hi == 1.0


def test_loss_and_best_baseline_selection():
    cells = []
    for seed in (1, 2, 3):
        for obj, acc in (("p3o", 0.2), ("grpo", 0.9), ("tis", 0.5)):
            n = 100
            ok = int(acc * n)
            cells.append(
                {"objective": obj, "mismatch": "bf16", "seed": seed, "status": "ok",
                 "final_per_prompt": [1.0] * ok + [0.0] * (n - ok)}
            )  # fmt: skip
    best, r = versus_best_baseline(cells, "bf16", "p3o", ["grpo", "tis"])
    assert best == "grpo" and r.diff == pytest.approx(-0.7) and r.verdict == "loss"
    assert r.n_seeds == 3 and r.n_prompts == 100
