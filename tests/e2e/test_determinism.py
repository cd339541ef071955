"""The tiny recipe's first 5 steps reproduce values recorded before the trainer's redesign.

``data/tiny_recipe_first5.json`` was written by the trainer as it was before the rollout backend,
the phase-structured ``Trainer.step`` and the policy-update module existed (commit 8f02a42), on
the session base model that ``tools/make_tiny_base.py`` makes. A refactor that changes what the
trainer computes (which samples, which advantages, which loss, which update) fails here.
Re-record only for an intended change of behaviour: ``P3O_RECORD=1 pytest this file``.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from .cli import ENV, ROOT

RECORD = ROOT / "tests/e2e/data/tiny_recipe_first5.json"
STEPS = 5


def _comparable(row: dict) -> dict:
    """Everything but wall-clock times and rates."""
    return {
        k: v
        for k, v in row.items()
        if not (k.endswith("_s") or k.endswith("_per_s") or k.startswith("rollout_wait"))
    }


def _close(a, b) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return abs(a - b) <= 1e-5 * max(1.0, abs(a), abs(b))
    return a == b


@pytest.mark.e2e
def test_first_five_steps_match_the_record(base, tmp_path):
    sets = {
        "model.checkpoint": base / "ckpt",
        "data.path": base / "train.jsonl",
        "data.eval_path": "''",
        "steps": STEPS,
        "run.dir": tmp_path,
        "run.name": "det",
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    r = subprocess.run(
        [sys.executable, "-m", "megatron_p3o.train", str(ROOT / "recipes/tiny_cpu.yaml"), *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "det" / "metrics.jsonl").read_text().splitlines()]
    got = [_comparable(x) for x in rows]
    if os.environ.get("P3O_RECORD"):
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        RECORD.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"recorded {RECORD}")
    want = json.loads(RECORD.read_text())
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want), start=1):
        missing = sorted(set(w) - set(g))
        assert not missing, f"step {step}: metrics no longer logged: {missing}"
        diff = {k: (w[k], g[k]) for k in w if not _close(w[k], g[k])}
        assert not diff, f"step {step} differs from the record (recorded, now): {diff}"
