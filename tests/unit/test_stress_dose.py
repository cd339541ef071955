"""Break points of the stress report (stress/dose.py) on synthetic cells, against differences
written out here."""

from megatron_p3o.stress.dose import axes, break_points, dose_section, plot_dose
from megatron_p3o.stress.grid import GridConfig, MismatchSpec, ObjectiveSpec


def _grid():
    m = {
        "bf16": MismatchSpec("baseline"),
        "noise_0.6": MismatchSpec("logit_noise", 0.6),
        "noise_0.3": MismatchSpec("logit_noise", 0.3),  # listed out of order on purpose
        "temp_1.15": MismatchSpec("engine_temperature", 1.15),
        "temp_0.9": MismatchSpec("engine_temperature", 0.9),
    }
    o = {"p3o": ObjectiveSpec("p3o"), "tis": ObjectiveSpec("tis")}
    return GridConfig(base="x", objectives=o, mismatch=m, seeds=list(range(1, 9)))


# mean accuracy per (objective, setting); every seed adds the same offset to all of its cells
MEANS = {
    "p3o": {"bf16": 0.70, "noise_0.3": 0.69, "noise_0.6": 0.40, "temp_0.9": 0.50, "temp_1.15": 0.3},
    "tis": {"bf16": 0.70, "noise_0.3": 0.70, "noise_0.6": 0.68, "temp_0.9": 0.70, "temp_1.15": 0.7},
}
OFFSET = {s: 0.01 * ((s * 7) % 5 - 2) for s in range(1, 9)}
JITTER = {s: 0.002 * (-1) ** s for s in range(1, 9)}  # level cells only: sd > 0 differences


def _cells():
    return [
        {
            "objective": o,
            "mismatch": mm,
            "seed": s,
            "status": "ok",
            "acc_end": v + OFFSET[s] + (0 if mm == "bf16" else JITTER[s]),
        }  # fmt: skip
        for o, by in MEANS.items()
        for mm, v in by.items()
        for s in OFFSET
    ]


def test_axes_are_ordered_from_the_control():
    assert axes(_grid()) == {
        "logit_noise": ["noise_0.3", "noise_0.6"],
        "engine_temperature": ["temp_0.9", "temp_1.15"],  # |0.9 − 1| < |1.15 − 1|
    }


def test_break_points_and_table(tmp_path):
    rows, points = break_points(_grid(), _cells())
    assert len(rows) == 8  # 2 axes × 2 levels × 2 objectives, one Holm family
    # p3o: noise 0.3 is −0.01 (a shift of 0.01 with ±0.002 jitter: clearly significant at n=8,
    # sign-flip p = 2/256 — also a loss), so the first level already breaks it
    diffs = {(f, o, m): t.mean for f, o, m, t in rows}
    assert abs(diffs[("logit_noise", "p3o", "noise_0.6")] - (0.40 - 0.70)) < 1e-9
    assert abs(diffs[("engine_temperature", "tis", "temp_0.9")]) < 1e-9
    assert points[("logit_noise", "p3o")] == "noise_0.3"
    assert points[("engine_temperature", "p3o")] == "temp_0.9"
    assert points[("logit_noise", "tis")] == "noise_0.6"  # 0.3: no shift; 0.6: −0.02
    assert points[("engine_temperature", "tis")] is None  # no shift at any level
    md = "\n".join(dose_section(_grid(), _cells()))
    control = f"{0.70 + sum(OFFSET.values()) / len(OFFSET):.3f}"  # the seed mean of bf16
    assert f"| tis | {control} | +0.000" in md and "| none |" in md
    assert f"| p3o | {control} | **-0.010" in md
    png = plot_dose(tmp_path, _grid(), _cells())
    assert png.is_file() and png.stat().st_size > 10_000


def test_corrupted_reported_logprobs_are_labelled_reporting_noise():
    """Issue 28: corrupted reported ℓb is its own family, labelled as reporting noise (the engine
    samples from its own πb); a genuine shift of πb (logit noise) is not labelled so."""
    from megatron_p3o.stress.grid import REPORTING_NOISE, family_label, reports_noise

    m = dict(_grid().mismatch)
    m["corrupt_0.3"] = MismatchSpec("reported_lb_noise", 0.3, {"rollout.logprob_noise": 0.3})
    m["zero_0"] = MismatchSpec("reported_lb_zero", 0.0, {"rollout.logprob_noise": 0.0})
    g = GridConfig(base="x", objectives=_grid().objectives, mismatch=m, seeds=list(range(1, 9)))
    assert reports_noise(m["corrupt_0.3"]) and not reports_noise(m["noise_0.3"])
    assert not reports_noise(m["zero_0"])  # σ = 0 corrupts nothing
    assert family_label(g, "reported_lb_noise") == f"reported_lb_noise ({REPORTING_NOISE})"
    assert family_label(g, "logit_noise") == "logit_noise"
    cells = _cells() + [
        {"objective": o, "mismatch": "corrupt_0.3", "seed": s, "status": "ok", "acc_end": 0.7}
        for o in ("p3o", "tis")
        for s in OFFSET
    ]
    text = "\n".join(dose_section(g, cells))
    assert f"**reported_lb_noise ({REPORTING_NOISE})**" in text
    assert "**logit_noise**" in text
