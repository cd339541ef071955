"""The probe's verdict table (``stress/verdicts.py``) against the committed v4 reports it says it
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


def test_v4_levels_are_the_committed_reports_calls():
    """Recomputed from docs/stress_v4_*/cells.csv by the declared family's tests: a report
    regenerated without regenerating the table (or a hand edit of the table) fails here."""
    tool = _tool()
    fresh = []
    for name in ("stress_v4_tiny_cpu", "stress_v4_chain_tiny_cpu"):
        fresh += tool.levels(str(ROOT / "recipes" / f"{name}.yaml"), ROOT / "docs" / name)
    shipped = [lv for lv in verdicts.LEVELS if lv["study"] == "v4"]
    assert [lv["setting"] for lv in shipped] == [lv["setting"] for lv in fresh]
    for a, b in zip(shipped, fresh):
        for k in ("per_token", "per_sequence", "kl", "held", "calls"):
            assert a[k] == b[k], (a["setting"], k)
        assert set(a["failed"]) == set(b["failed"]), a["setting"]


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
    assert "v4" in far["summary"] and verdicts.STUDY == "v4"


@pytest.mark.parametrize("lv", verdicts.LEVELS, ids=lambda lv: f"{lv['study']}:{lv['setting']}")
def test_every_level_is_complete(lv):
    assert lv["study"] in ("v3", "v4") and lv["per_token"] > 0 and lv["per_sequence"] > 0
    assert not set(lv["held"]) & set(lv["failed"])
