"""``python -m megatron_p3o.probe`` against a real SGLang 0.5.23 server on CPU, launched by the
probe's trainer from recipes/tiny_cpu_sglang.yaml: fp32 serving is the trainer's numbers up to
fp32 rounding, bf16 serving is at the bf16 level (the embedded bf16 engine's range). One server
launch per dtype; every statistic recomputed here in float64 from the returned log-probs."""

import json
import subprocess

import pytest

from megatron_p3o.runtime.ports import free_port
from tests.e2e.cli import ENV, ROOT
from tests.e2e.test_probe import check_report, probe_cmd

from .conftest import kill_launched, log_tail

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]
RECIPE = str(ROOT / "recipes/tiny_cpu_sglang.yaml")


def _probe(base, out, dtype: str) -> dict:
    sets = (
        f"rollout.sglang.model_path={base / 'hf'}", f"rollout.sglang.dtype={dtype}",
        f"rollout.sglang.port={free_port()}", f"rollout.weight_sync_port={free_port()}",
        "rollout.sglang.startup_timeout_s=300",
    )  # fmt: skip
    cmd = probe_cmd(base, *sets, recipe=RECIPE) + ["--out", str(out)]
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=out.parent
        )
        assert r.returncode == 0, r.stderr[-3000:] + "\n" + log_tail(out)
    finally:
        kill_launched(out)  # the server is stopped by the probe; this is the safety net
    rep = json.loads((out / "probe.json").read_text())
    assert rep["rollout"]["engine"] == "sglang" and rep["rollout"]["launched"]
    assert rep["rollout"]["dtype"] == dtype and (out / "probe.png").is_file()
    assert (out / "trainer" / "sglang").is_dir()  # the server's log stays with the probe
    assert not list(out.rglob("step_*"))  # never a checkpoint
    return rep


def test_fp32_serving_is_exact_to_fp32_rounding(base, reap):
    rep = _probe(base, reap / "fp32", "float32")
    dl = check_report(rep, 32)
    p99 = rep["per_token"]["p99_abs_dlogp"]
    print(f"SGLang fp32: per-token |Δℓ| mean {dl.abs().mean():.3e} p99 {p99:.3e} "
          f"max {dl.abs().max():.3e}, e_B {rep['ess']:.8f}")  # fmt: skip
    assert dl.abs().mean().item() <= 1e-5 and rep["per_token"]["p99_abs_dlogp"] <= 1e-5
    assert rep["ess"] > 0.9999
    v = rep["verdict"]  # no study ran an fp32 server: not studied, no call carried to it
    assert v["kind"] == "sglang_fp32" and v["studied"] is False


def test_bf16_serving_is_at_the_bf16_level(base, reap):
    rep = _probe(base, reap / "bf16", "bfloat16")
    dl = check_report(rep, 32)
    mean = dl.abs().mean().item()
    p99, seq = rep["per_token"]["p99_abs_dlogp"], rep["per_sequence"]["mean_abs_sum_dlogp"]
    print(f"SGLang bf16: per-token |Δℓ| mean {mean:.4f} p99 {p99:.4f}, |ΣΔℓ| {seq:.4f}, "
          f"e_B {rep['ess']:.5f}")  # fmt: skip
    assert 1e-3 < mean < 0.2, mean  # as the embedded bf16 engine (tests/e2e/test_probe.py)
    assert 0.99 < rep["ess"] < 1.0
    v = rep["verdict"]  # v3's SGLang bf16 level on the shipped base: no loss detected there
    assert v["kind"] == "sglang_bf16" and v["nearest_level"]["setting"] == "sglang_bf16"
    assert v["objectives"]["p3o"]["call"] == "undecided"
