"""The reference model, ReVal and R2PO through the CLI: P3O's ``ref_kl_coef`` and entropy bonus
wired to the reference (and its reset), and checkpoint/resume of the reference's reset step, the
ReVal FIFO and the R2PO head (a resumed run equals an uninterrupted one, bit for bit)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .cli import ENV, ROOT
from .test_resume import _tensors
from .test_tiny_recipe import _sets


def _train(recipe, base, run_dir, name, steps, *extra):
    cmd = [sys.executable, "-m", "megatron_p3o.train", str(ROOT / "recipes" / recipe),
           *_sets(base, run_dir, name, steps), *extra]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _metrics(run: Path):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_p3o_reference_kl_entropy_bonus_and_reset(base, tmp_path):
    sets = ["--set", "loss.hyper.ref_kl_coef=0.5", "--set", "loss.hyper.entropy_coef=0.01",
            "--set", "reference.reset_every=2"]  # fmt: skip
    _train("tiny_cpu.yaml", base, tmp_path, "refkl", 3, *sets)
    m = _metrics(tmp_path / "refkl")
    # step 1: the reference is the policy (same checkpoint); step 2: one update apart; step 3:
    # the reference was reset to the policy after step 2
    assert abs(m[0]["kl_ref"]) < 1e-7 and m[1]["kl_ref"] > 1e-6 and abs(m[2]["kl_ref"]) < 1e-7
    assert [x["ref_reset_step"] for x in m] == [0.0, 0.0, 2.0]
    assert all(x["entropy"] > 0 and x["ref_forward_s"] > 0 for x in m)


def _straight_vs_resumed(recipe, base, tmp_path, extra):
    ck = ["--set", "checkpoint.every=2", "--set", "checkpoint.keep_last=3", *extra]
    _train(recipe, base, tmp_path, "straight", 4, *ck)
    _train(recipe, base, tmp_path, "resumed", 2, *ck)
    r = _train(recipe, base, tmp_path, "resumed", 4, *ck)
    assert "resumed from" in r.stdout
    ta = _tensors(tmp_path / "straight" / "checkpoints" / "step_000004", tmp_path)
    tb = _tensors(tmp_path / "resumed" / "checkpoints" / "step_000004", tmp_path)
    assert ta.keys() == tb.keys()
    diff = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not diff, diff
    ma, mb = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    keys = [k for k in ma[-1] if k.startswith(("loss", "replay/", "head/loss", "reward_mean"))]
    assert keys
    for a, b in zip(ma, mb):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
    return ta, ma


@pytest.mark.e2e
def test_reval_resume_keeps_fifo_and_reference_reset(base, tmp_path):
    ta, m = _straight_vs_resumed(
        "reval_tiny_cpu.yaml", base, tmp_path, ["--set", "reference.reset_every=2"]
    )
    assert any(k.startswith("reference.") for k in ta)  # the reset reference is checkpointed
    assert "replay/loss" in m[2] and "replay/loss" in m[3]  # replay updates ran after resume
    assert m[3]["ref_reset_step"] == 2.0


@pytest.mark.e2e
def test_r2po_resume_keeps_head_and_its_optimizer(base, tmp_path):
    extra = ["--set", "r2po.head_steps=1", "--set", "r2po.policy_steps=1"]
    ta, m = _straight_vs_resumed("r2po_tiny_cpu.yaml", base, tmp_path, extra)
    assert {"rollout_head.w1", "rollout_head.w2.exp_avg"} <= set(ta)
    assert [x["r2po_head_phase"] for x in m] == [1.0, 0.0, 1.0, 0.0]
