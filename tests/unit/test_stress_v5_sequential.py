"""Stress study v5's sequential design (issue 54): each look's repeated confidence interval
against scipy's t-interval at that look's share of the error, the error each look spends by
simulation, the vectorised simulation against the per-comparison rule, and — by simulation of at
least 2,000 studies with v4's per-setting seed s.d.s — the study-wide error at or below its α and
the power at +0.05 the plan claims."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from megatron_p3o.stress.sequential import (
    Design,
    binomial_ci,
    decide,
    rci,
    repeated_p,
    shares,
    simulate,
    spent,
    wrong,
)

ROOT = Path(__file__).resolve().parents[2]
LOOKS = (8, 16, 32, 64)


@pytest.mark.parametrize("kind,gamma", [("hsd", -2.0), ("hsd", 1.0), ("obf", 0.0), ("pocock", 0)])
def test_each_look_spends_its_share_and_the_interval_is_scipys(kind, gamma):
    """Look k's interval is scipy's paired t-interval at level 1 − (α/m)·w_k, w_k the spending
    function's increment there; the shares add up to 1 (the union bound's total is α/m)."""
    des = Design(LOOKS, alpha=0.05, m=7, margin=0.02, spending=kind, gamma=gamma)
    w = des.shares
    assert sum(w) == pytest.approx(1.0) and all(x > 0 for x in w)
    fr = [n / LOOKS[-1] for n in LOOKS]
    cum = [spent(t, 0.05, kind, gamma) / 0.05 for t in fr]
    assert list(w) == pytest.approx(np.diff([0.0] + cum).tolist())
    rng = np.random.default_rng(1)
    d = (0.01 + 0.03 * rng.standard_normal(LOOKS[-1])).tolist()
    for k, n in enumerate(LOOKS):
        _, _, lo, hi = rci(d[:n], des, k)
        ci = scipy.stats.ttest_1samp(d[:n], 0.0).confidence_interval(
            confidence_level=1 - 0.05 / 7 * w[k]
        )
        assert (lo, hi) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_each_look_errs_at_its_share_by_simulation():
    """400,000 null comparisons: the share of intervals that first exclude 0 at look k is at
    most its level a_k (an interval misses at look k with probability a_k exactly; stopping at
    the first miss can only lower the later ones), and the total at most α/m."""
    des = Design(LOOKS, alpha=0.05, m=33, margin=0.02)
    sim = simulate(des, [0.0], [0.05], [0], n_sim=400_000, seed=3)
    c, lk = sim["call"][:, 0], sim["look"][:, 0]
    for k in range(len(LOOKS)):
        got = float(((c < 2) & (lk == k + 1)).mean())
        se = math.sqrt(des.level(k) / 400_000)
        assert got <= des.level(k) + 3 * se, (k, got, des.level(k))
    assert float((c < 2).mean()) <= 0.05 / 33 + 3 * math.sqrt(0.05 / 33 / 400_000)


def test_spending_functions_by_hand():
    assert spent(1.0, 0.05, "obf") == pytest.approx(0.05)
    assert spent(1.0, 0.05, "pocock") == pytest.approx(0.05)
    assert spent(0.5, 0.05, "hsd", 0.0) == pytest.approx(0.025)
    # HSD γ = −4 at t = 1/2: (1 − e²)/(1 − e⁴)
    assert spent(0.5, 0.05, "hsd", -4.0) == pytest.approx(0.05 * (1 - math.e**2) / (1 - math.e**4))
    assert shares((10, 20), "hsd", 0.0) == pytest.approx((0.5, 0.5))
    assert spent(0.0, 0.05, "obf") == 0.0


def test_one_look_is_the_fixed_sample_t_interval():
    """With a single look the repeated interval is scipy's t-interval at level 1 − α/m."""
    d = [0.03, 0.01, -0.02, 0.05, 0.04, 0.00, 0.02, 0.06]
    des = Design((8,), alpha=0.05, m=5, margin=0.02)
    mean, sd, lo, hi = rci(d, des, 0)
    ci = scipy.stats.ttest_1samp(d, 0.0).confidence_interval(confidence_level=1 - 0.05 / 5)
    assert (lo, hi) == pytest.approx((ci.low, ci.high), abs=1e-9)
    # the repeated p-value is then m × the t-test's p
    p = scipy.stats.ttest_1samp(d, 0.0).pvalue
    assert repeated_p(des, 0, 8, abs(mean) / (sd / math.sqrt(8))) == pytest.approx(
        min(1.0, 5 * p), rel=1e-4
    )


def test_calls_from_the_interval():
    des = Design(LOOKS, alpha=0.05, m=4, margin=0.02)
    rng = np.random.default_rng(3)
    big = (0.3 + 0.02 * rng.standard_normal(8)).tolist()
    c = decide([big], des, "s", "tis", "p3o")
    assert c.call == "better" and c.look == 1 and c.final and c.lo > 0
    # a tight null difference: equivalent once the interval fits in ±0.02
    flat = (0.002 * rng.standard_normal(64)).tolist()
    by_look = [flat[:n] for n in LOOKS]
    c = decide(by_look, des, "s", "tis", "p3o")
    assert c.call == "equivalent" and -0.02 < c.lo and c.hi < 0.02
    assert c.p_adjusted < 0.05
    # a noisy gap near the margin: undecided at the cap, with the seeds it would still need
    noisy = (0.1 * rng.standard_normal(64)).tolist()
    c = decide([noisy[:n] for n in LOOKS], des, "s", "tis", "p3o")
    assert c.call == "undecided" and c.final and c.look == 4 and c.seeds_needed > 64
    # an earlier look not run yet: not final
    c = decide([noisy[:8], None], des, "s", "tis", "p3o")
    assert not c.final and c.look == 1


def test_the_vectorised_simulation_makes_the_same_calls_as_decide():
    des = Design(LOOKS, alpha=0.05, m=3, margin=0.03)
    deltas, sds, groups = [0.0, 0.04, 0.15], [0.02, 0.12, 0.05], [0, 0, 1]
    sim = simulate(des, deltas, sds, groups, n_sim=20, seed=5, keep=True)
    codes = ("better", "worse", "equivalent", "undecided")
    assert set(sim["call"].ravel()) >= {0, 2, 3}  # the draw exercises three of the four calls
    for i in range(20):
        for j in range(3):
            x = sim["x"][i, j]
            c = decide([x[:n].tolist() for n in LOOKS], des, "s", str(j), "p3o")
            assert codes[sim["call"][i, j]] == c.call and sim["look"][i, j] == c.look, (i, j)


def _v4_sds():
    """Per setting, the seed s.d. of v4's declared paired differences (TIS, GRPO with ℓold
    recomputed, P3O without k3, each − P3O at v4's chosen rates, all 8 seeds), by scipy."""
    from megatron_p3o.stress.grid import load_grid
    from megatron_p3o.stress.lr_sweep import chosen_rates
    from megatron_p3o.stress.study import read_cells

    grid = load_grid(ROOT / "recipes/stress_v4_tiny_cpu.yaml")
    cells = read_cells(ROOT / "docs/stress_v4_tiny_cpu/cells.csv")
    chosen = chosen_rates(grid, cells, 2e-4)
    acc = {(c["objective"], c["mismatch"], c["seed"]): c["acc_end"] for c in cells}
    out = []
    for mm in grid.mismatch:
        for arm in ("tis", "grpo_recompute", "p3o_no_kl"):
            d = [
                acc[(chosen[(arm, mm)], mm, s)] - acc[(chosen[("p3o", mm)], mm, s)]
                for s in range(1, 9)
            ]
            out.append((mm, float(scipy.stats.tstd(d))))
    return out


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_the_study_wide_error_stays_at_or_below_alpha(rho):
    """2,400 simulated studies of v5's design (its looks, α, spending and margin from the grid),
    one comparison per v4 (setting, arm) with v4's seed s.d.: every true difference 0 (a wrong
    call: better or worse), then every true difference at ±margin (a wrong call: equivalent). The
    Monte-Carlo 95% interval of the study-wide error is printed; its estimate is ≤ α."""
    from megatron_p3o.stress.grid import load_grid
    from megatron_p3o.stress.looks import design

    des = design(load_grid(ROOT / "recipes/stress_v5_tiny_cpu.yaml"))
    sds = _v4_sds()
    settings = [mm for mm, _ in sds]
    m = len(sds)
    des = Design(des.looks, des.alpha, m, des.margin, des.spending, des.gamma)
    s = [sd for _, sd in sds]
    for deltas in ([0.0] * m, [des.margin * (-1) ** j for j in range(m)]):
        sim = simulate(des, deltas, s, settings, rho=rho, n_sim=2400, seed=11)
        bad = int(wrong(sim["call"], deltas, des.margin).any(axis=1).sum())
        lo, hi = binomial_ci(bad, 2400)
        print(f"rho {rho}: study-wide error {bad / 2400:.4f} [{lo:.4f}, {hi:.4f}] (α {des.alpha})")
        assert bad / 2400 <= des.alpha


def _plan_power():
    """The plan's table per setting: planning s.d., power at +0.05 by the cap and by each look
    before it, power at +0.025 by the cap, P(equivalent) at Δ 0."""
    text = (ROOT / "docs/stress_v5_plan.md").read_text()
    block = text.split("<!-- power-table -->")[1]
    rows = []
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and re.fullmatch(r"`[\w.]+`", cells[0]):
            rows.append((cells[0].strip("`"), *map(float, cells[1:-2])))
    assert rows, "the plan's power table (between <!-- power-table --> marks) is missing"
    return rows


def test_the_power_at_005_is_what_the_plan_claims():
    """Per setting, at its planning s.d., the design calls a true +0.05 `better` by the cap and
    by each look, a true +0.025 `better` by the cap, and a true 0 `equivalent`, with the
    probabilities the plan states (simulated again here: 4,000 studies, other draws, within
    0.03)."""
    from megatron_p3o.stress.grid import load_grid
    from megatron_p3o.stress.looks import design

    des = design(load_grid(ROOT / "recipes/stress_v5_tiny_cpu.yaml"))
    k = len(des.looks)
    for mm, sd, cap, *rest in _plan_power():
        by_look, p025, eq0 = rest[: k - 1], rest[k - 1], rest[k]
        sim = simulate(des, [0.05, 0.025, 0.0], [sd] * 3, [0, 1, 2], n_sim=4000, seed=1234)
        c, lk = sim["call"], sim["look"]
        assert float((c[:, 0] == 0).mean()) == pytest.approx(cap, abs=0.03), mm
        for i, claimed in enumerate(by_look):
            got = float(((c[:, 0] == 0) & (lk[:, 0] <= i + 1)).mean())
            assert got == pytest.approx(claimed, abs=0.03), (mm, i + 1, got, claimed)
        assert float((c[:, 1] == 0).mean()) == pytest.approx(p025, abs=0.03), mm
        assert float((c[:, 2] == 2).mean()) == pytest.approx(eq0, abs=0.03), mm
