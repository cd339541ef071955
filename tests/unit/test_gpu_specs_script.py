"""tools/gpu_check.sh's spec step (tools/gpu_specs.py) works here on a dense and an MoE family:
the local spec's logits and embedding gradient against transformers, the fused log-prob against
float64. On the lent GPU the same script runs every family on CUDA."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_specs_script_runs_here(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/gpu_specs.py"), "--device", "cpu", "--out",
         str(tmp_path), "--families", "qwen2", "mixtral"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / "specs.json").read_text())
    assert set(rep["specs"]) == {"qwen2", "mixtral"}
    for fam, s in rep["specs"].items():
        assert s["ok"] and s["max_abs_logit_diff"] < 1e-4 and s["embedding_grad_rel_err"] < 1e-3
        assert not s["params_without_finite_grad"], fam
    assert rep["specs"]["mixtral"]["moe"] and not rep["specs"]["qwen2"]["moe"]
    assert all(v < 1e-4 for v in rep["fused"]["fp32_vs_float64"].values()), rep["fused"]
    assert "RESULT specs_ok=2/2 fused_ok=True" in r.stdout
