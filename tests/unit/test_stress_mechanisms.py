"""The stress report's mechanisms table (stress/mechanisms.py) on synthetic cells, against
means and seed standard deviations written out here."""

from megatron_p3o.stress.grid import GridConfig, MismatchSpec, ObjectiveSpec
from megatron_p3o.stress.mechanisms import K3_NOTE, mechanisms_section


def _grid():
    m = {"bf16": MismatchSpec("baseline"), "noise": MismatchSpec("logit_noise", 1.0)}
    o = {"p3o": ObjectiveSpec("p3o"), "grpo": ObjectiveSpec("grpo")}
    return GridConfig(base="x", objectives=o, mismatch=m, seeds=[1, 2, 3])


def _cell(obj, mm, seed, **kw):
    base = {"objective": obj, "mismatch": mm, "seed": seed, "status": "ok", "cell": "x"}
    return {**base, **kw}


def test_mechanisms_table_means_and_seed_sd():
    cells = []
    # p3o under noise: clipped 0, 0.5, 1 of its steps -> 50% ± 50%; update_rel 1e-3, 2e-3,
    # 3e-3 -> "2.00 ± 1.00" ×1e3; entropy falls 0.9 -> 0.3 on every seed
    for s, (clip, rel) in enumerate([(0.0, 1e-3), (0.5, 2e-3), (1.0, 3e-3)], start=1):
        cells.append(
            _cell(
                "p3o",
                "noise",
                s,
                ess_mean=0.5,
                ess_step_min=0.25,
                grad_norm_mean=2.0,
                grad_clipped_run=clip,
                update_rel_run=rel,
                entropy_first5=0.9,
                entropy_last5=0.3,
                kl_b_theta_run=0.01,
            )  # fmt: skip
        )
    cells.append(_cell("grpo", "bf16", 1, grad_clipped_run=0.0, status="failed: x"))
    lines = mechanisms_section(_grid(), cells)
    row = next(x for x in lines if x.startswith("| noise | p3o |"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    assert cols[2:] == [
        "0.500 ± 0.000",
        "0.250 ± 0.000",
        "2.00 ± 0.00",
        "50% ± 50%",
        "2.00 ± 1.00",
        "0.900 ± 0.000",
        "0.300 ± 0.000",
        "0.0100 ± 0.0000",
    ]
    assert not any(x.startswith("| bf16 | grpo |") for x in lines)  # failed cells are left out
    assert lines[-1] == K3_NOTE


def test_no_section_for_cells_without_the_columns():
    cells = [_cell("p3o", "bf16", 1, ess_mean=0.9)]  # a grid run before the mechanism columns
    assert mechanisms_section(_grid(), cells) == []


def test_long_run_curve_columns_and_table():
    from megatron_p3o.stress.long_run import _by_step, long_run_section
    from megatron_p3o.stress.runner import curve_summary

    def curve(start, end):
        return [
            {"step": k, "eval/h/pass@1_mean": v, "eval/h/pass@4": v + 0.2, "eval/h/prompts": 9}
            for k, v in ((0, start), (30, end))
        ]

    s = curve_summary(curve(0.5, 0.7))
    assert s["h_pass@1_mean_end"] == 0.7 and s["h_pass@4_end"] == 0.7 + 0.2
    assert "h_prompts_end" not in s and len(s["eval_curve"]) == 2
    assert curve_summary([]) == {}
    cells = [
        _cell("p3o", "bf16", seed, eval_curve=curve(0.5, end), steps=30, entropy_last5=0.2)
        for seed, end in ((1, 0.6), (2, 0.8))
    ]
    assert _by_step(cells, "eval/h/pass@1_mean") == ([0, 30], [0.5, 0.7], [0.0, 0.1 * 2**0.5])
    lines = long_run_section(_grid(), cells)
    assert lines[0].startswith("## Long runs") and "after 30 steps" in lines[0]
    row = next(x for x in lines if x.startswith("| bf16 | p3o |"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    # pass@1 mean 0.7 ± 0.141 (0.6, 0.8); pass@4 0.9 ± 0.141; entropy; no KL / length recorded
    assert cols[2:] == ["0.700 ± 0.141", "0.900 ± 0.141", "0.200 ± 0.000", "—", "—"]
    assert long_run_section(_grid(), [_cell("p3o", "bf16", 1)]) == []


def test_mean_pass1_is_shown_once_when_pass1_is_a_k():
    from megatron_p3o.stress.long_run import _curve_keys

    point = {"step": 0, "eval/h/pass@1_mean": 0.3, "eval/h/pass@1": 0.3, "eval/h/pass@4": 0.6}
    assert _curve_keys([{"eval_curve": [point]}]) == ["eval/h/pass@1", "eval/h/pass@4"]
    del point["eval/h/pass@1"]  # k without 1: the mean pass@1 is the only pass@1 there is
    assert _curve_keys([{"eval_curve": [point]}]) == ["eval/h/pass@1_mean", "eval/h/pass@4"]


def test_cell_epochs_averages_each_epoch_over_rollout_batches(tmp_path):
    """Issue 43, item 3: the per-epoch mechanism table reads each optimizer step's record and
    averages per epoch over the run's rollout batches (2 batches x 2 epochs x 2 mini-batches)."""
    import json

    import pytest

    from megatron_p3o.stress.mechanisms import cell_epochs

    lines = []
    for batch in range(2):
        steps = [
            {
                "epoch": e,
                "minibatch": mb,
                "ess": 1.0 - 0.1 * e - 0.01 * batch,
                "update_rel": 1e-3,
                "kl_behavior_theta": 0.01 * (e + 1) + mb * 0.002,
            }  # fmt: skip
            for e in range(2)
            for mb in range(2)
        ]
        lines.append(json.dumps({"step": batch + 1, "per_step": steps}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    got = cell_epochs(tmp_path / "metrics.jsonl")
    assert sorted(got) == [0, 1]
    assert got[0]["ess"] == pytest.approx(1.0 - 0.005) and got[1]["ess"] == pytest.approx(0.895)
    assert got[1]["kl_behavior_theta"] == pytest.approx(0.021)
    assert "grad_norm" not in got[0]  # not recorded: not invented
