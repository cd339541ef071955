"""Shared e2e fixtures."""

import json
import subprocess
import sys

import pytest

from .cli import ENV, ROOT


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "base"
    r = subprocess.run([sys.executable, str(ROOT / "tools/make_tiny_base.py"), "--out", str(out),
                        "--steps", "25", "--target-acc", "0"], capture_output=True, text=True, env=ENV,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "base.json").read_text())["sft_steps"] == 25
    return out
