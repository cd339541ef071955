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
        for k in ("per_token", "per_sequence", "kl", "kind", "held", "undecided", "calls",
                  "failed"):  # fmt: skip
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


def test_held_has_one_meaning():
    """Held: called equivalent (±0.02) or better than the comparator; undecided is never held
    (issue 65). v5 bf16: every arm equivalent → all held, P3O too; round_1: GRPO recomputed
    called worse → failed, P3O held; chain σ 0.6: every call undecided at the cap → all
    undecided; v3 (no equivalence margin): nothing held."""
    lv = {x["setting"]: x for x in verdicts.LEVELS if x["study"] == "v5"}
    assert set(lv["bf16"]["held"]) == {"p3o", "tis", "grpo_recompute", "p3o_no_kl"}
    assert "grpo_recompute" in lv["round_1"]["failed"] and "p3o" in lv["round_1"]["held"]
    chain = lv["chain logit_0.6"]
    assert chain["held"] == () and set(chain["undecided"]) == {"p3o", "tis", "grpo_recompute",
                                                             "p3o_no_kl"}  # fmt: skip
    assert all(x["held"] == () for x in verdicts.LEVELS if x["study"] == "v3")


def test_an_engine_is_placed_only_among_levels_of_its_kind_and_task():
    # the embedded bf16 engine on the shipped addition base: v5's bf16 level
    bf = verdicts.verdict(0.008, 0.02, "embedded_bf16", "arithmetic")
    assert bf["studied"] and bf["nearest_level"]["setting"] == "bf16" and not bf["beyond_study"]
    assert bf["objectives"]["p3o"]["call"] == "held"
    # chain σ 0.6 was undecided for every arm: a chain engine there is told so, not "held"
    ch = verdicts.verdict(0.04, 0.7, "logit_noise", "reasoning_gym:chain_sum")
    assert ch["nearest_level"]["setting"] == "chain logit_0.6"
    assert ch["objectives"]["p3o"]["call"] == "undecided" and not ch["held"]
    # no study ran these: not studied (an fp32 engine, another model, a kind on another task)
    for kind, task in [("embedded_fp32", "arithmetic"), ("sglang_bf16", ""),
                       ("weight_rounding", "reasoning_gym:chain_sum"),
                       ("logit_noise+weight_rounding", "arithmetic")]:  # fmt: skip
        v = verdicts.verdict(0.03, 0.08, kind, task)
        assert v["studied"] is False and v["summary"].startswith("not studied"), (kind, task)
        assert v["objectives"] == {} and v["nearest_level"] is None
    # rounding far past round_3: beyond the kind's range, said so, no call carried there
    far = verdicts.verdict(5.0, 50.0, "weight_rounding", "arithmetic")
    assert far["beyond_study"] and far["nearest_level"]["setting"] == "round_3"
    assert "beyond the weight_rounding levels run" in far["summary"]
    # an SGLang bf16 server on the shipped base: v3's level, where no loss was detected
    sg = verdicts.verdict(0.0075, 0.02, "sglang_bf16", "arithmetic")
    assert sg["nearest_level"]["study"] == "v3" and sg["objectives"]["p3o"]["call"] == "undecided"


def test_engine_kind_and_studied_task(tmp_path):
    import json

    assert verdicts.engine_kind({"engine": "embedded", "precision": "bf16"}) == "embedded_bf16"
    assert verdicts.engine_kind({"engine": "embedded", "precision": "fp8_w8a8"}) == "embedded_fp8"
    assert verdicts.engine_kind({"engine": "sglang", "dtype": "bfloat16"}) == "sglang_bf16"
    assert verdicts.engine_kind({"engine": "sglang", "dtype": "bfloat16",
                                 "quantization": "fp8"}) == "sglang_fp8"  # fmt: skip
    assert verdicts.engine_kind({"engine": "embedded", "precision": "fp32",
                                 "logit_noise": 0.9}) == "logit_noise"  # fmt: skip
    (tmp_path / "ckpt").mkdir()
    assert verdicts.studied_task(tmp_path / "ckpt") == ""  # no base.json: another model
    (tmp_path / "base.json").write_text(json.dumps({"shipped": "tiny_addition"}))
    assert verdicts.studied_task(tmp_path / "ckpt") == "arithmetic"
    (tmp_path / "base.json").write_text(json.dumps({"task": "addition"}))  # trained anew
    assert verdicts.studied_task(tmp_path / "ckpt") == ""


@pytest.mark.parametrize("lv", verdicts.LEVELS, ids=lambda lv: f"{lv['study']}:{lv['setting']}")
def test_every_level_is_complete(lv):
    assert lv["study"] in ("v3", "v5") and lv["per_token"] > 0 and lv["per_sequence"] > 0
    assert not set(lv["held"]) & set(lv["failed"])
    assert not set(lv["undecided"]) & (set(lv["held"]) | set(lv["failed"]))
    assert lv["kind"] and lv["task"] in ("arithmetic", "reasoning_gym:chain_sum")
