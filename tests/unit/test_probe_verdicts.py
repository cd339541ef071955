"""The probe's verdict table (``stress/verdicts.py``) against the committed v5 reports it says it
comes from, and the rule that places an engine against it."""

import importlib.util
from pathlib import Path

import pytest

from megatron_p3o.stress import verdicts

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    path = ROOT / "tools" / "verdict_levels.py"
    spec = importlib.util.spec_from_file_location("verdict_levels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_v5_levels_are_the_committed_reports_calls():
    """Recomputed from docs/stress_v5_*/calls.csv and cells.csv: a look committed without
    regenerating the table (or a hand edit of the table) fails here."""
    tool = _tool()
    fresh = []
    for name in ("stress_v5_tiny_cpu", "stress_v5_chain_tiny_cpu"):
        fresh += tool.levels_v5(str(ROOT / "recipes" / f"{name}.yaml"), ROOT / "docs" / name)
    shipped = [lv for lv in verdicts.LEVELS if lv["study"] == "v5"]
    assert [lv["setting"] for lv in shipped] == [lv["setting"] for lv in fresh]
    for a, b in zip(shipped, fresh):
        for k in ("per_token", "per_sequence", "kl", "held", "calls", "failed"):
            assert a[k] == b[k], (a["setting"], k)
    # every engine-side setting of the v5 plan is in the table, none of v4's remains
    assert {lv["setting"] for lv in shipped} == {
        "bf16", "logit_0.9", "logit_1.2", "round_1", "round_2", "round_3",
        "chain logit_0.6", "chain logit_1.2",
    }  # fmt: skip
    assert {lv["study"] for lv in verdicts.LEVELS} == {"v3", "v5"}


def test_v4_reports_still_give_v4s_calls():
    """The tool's v4 path (the Holm family of fixed-sample tests) on the committed v4 reports
    gives the calls docs/stress_v4.md reports: the better-than-P3O calls and nothing worse."""
    tool = _tool()
    better = set()
    for name in ("stress_v4_tiny_cpu", "stress_v4_chain_tiny_cpu"):
        for lv in tool.levels(str(ROOT / "recipes" / f"{name}.yaml"), ROOT / "docs" / name):
            assert "worse" not in lv["calls"].values(), lv["setting"]
            better |= {(lv["setting"], a) for a, c in lv["calls"].items() if c == "better"}
    assert better == {
        ("logit_1.2", "grpo_recompute"), ("round_2", "p3o_capped"), ("round_3", "p3o_no_kl"),
        ("round_3", "tis"), ("chain logit_1.2", "p3o_no_kl"),
        ("chain logit_1.2", "p3o_capped"), ("chain logit_1.2", "tis"),
    }  # fmt: skip


def test_verdict_rule():
    low = verdicts.verdict(0.005, 0.01)  # below every level: held wherever P3O held above it
    assert low["objectives"]["p3o"]["call"] == "held" and not low["beyond_study"]
    r3 = next(lv for lv in verdicts.LEVELS if lv["setting"] == "round_3")
    at = verdicts.verdict(r3["per_token"], r3["per_sequence"])
    assert at["nearest_level"]["setting"] == "round_3" and at["nearest_level"]["p3o"] == "failed"
    assert at["objectives"]["p3o"]["call"] in ("failed", "mixed")
    assert "tis" in at["held"] and at["objectives"]["tis"]["call"] == "held"
    far = verdicts.verdict(5.0, 50.0)
    assert far["beyond_study"] and far["objectives"]["p3o"]["call"] in ("failed", "mixed")
    assert "v5" in far["summary"] and verdicts.STUDY == "v5"
    # bf16: every arm v5 ran is called equivalent there, and P3O held below it
    bf = verdicts.verdict(0.008, 0.02)
    assert bf["objectives"]["p3o"]["call"] == "held"
    assert bf["objectives"]["grpo_recompute"]["call"] in ("held", "mixed")


@pytest.mark.parametrize("lv", verdicts.LEVELS, ids=lambda lv: f"{lv['study']}:{lv['setting']}")
def test_every_level_is_complete(lv):
    assert lv["study"] in ("v3", "v5") and lv["per_token"] > 0 and lv["per_sequence"] > 0
    assert not set(lv["held"]) & set(lv["failed"])
