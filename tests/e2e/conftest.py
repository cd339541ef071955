"""Shared e2e fixtures."""

import json
import subprocess
import sys

import pytest

from .cli import ENV, ROOT


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "base"
    # the quickstart's own base model (trained to its target accuracy, ~30 s), so the learning
    # test below measures what a user gets
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/make_tiny_base.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "base.json").read_text())["heldout_greedy_acc"] >= 0.4
    return out
