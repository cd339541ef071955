"""Determinism and a regression record that hold on any x86-64 CPU (issue 25, item 1).

A golden record of a *trained-at-test-time* run only reproduces on the CPU that wrote it: BLAS
kernels of another instruction set round differently, so the base model and every sampled token
differ (a fresh clone on another AVX-512 machine: n_tokens 903 vs 885). So:

- determinism is "the same command twice gives bitwise-identical metrics and checkpoints", on
  whatever machine runs it;
- the regression record comes only from quantities fixed inputs determine: the shipped tiny model
  (``data/fixed_update/hf``) and a shipped rollout batch (``batch.json``: token ids, the engine's
  ℓb, rewards), one optimizer step of ``Trainer.step`` (``fixed_update_driver.py``). Loss, e_B,
  grad norm, the new parameters' Σθ² and ‖Δθ‖ are compared at 1e-4 relative; Δθ·θ₀ at 2e-2: a
  first Adam step moves each parameter by about lr·sign(g), and the sign of a near-zero gradient
  may differ on another ISA (measured: 2e-4 between this CPU's AVX-512 and forced AVX2 kernels,
  5e-7 for the loss). A run on ATen's baseline kernels and MKL's compatible path
  (``OTHER_MACHINE``) is part of the test, as a second machine.

Re-record only for an intended change of behaviour: ``P3O_RECORD=1 pytest this file``.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from .cli import ENV, ROOT
from .test_resume import _tensors, _train

DATA = ROOT / "tests/e2e/data/fixed_update"
RECORD = DATA / "record.json"
DRIVER = ROOT / "tests/e2e/fixed_update_driver.py"
OTHER_MACHINE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
TOL = {"loss": 1e-4, "ess": 1e-4, "grad_norm": 1e-4, "param_sq_sum": 1e-4, "delta_norm": 1e-4,
       "delta_dot_theta": 2e-2, "n_tokens": 0.0}  # fmt: skip


@pytest.fixture(scope="module")
def fixed_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixed") / "ckpt"
    r = subprocess.run(
        [sys.executable, "-m", "checkpoints_convert.hf_to_megatron", "--hf", str(DATA / "hf"),
         "--out", str(out)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _close(a: float, b: float, rel: float) -> bool:
    """Within ``rel`` of the larger magnitude, with a floor of 1e-3 for quantities near zero
    (GRPO's first-step loss is -mean(A) ≈ 1e-8: rounding, not signal); NaN only equals NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-3)


def _fixed_step(ckpt, out, objective, env=None, sets=()):
    r = subprocess.run([sys.executable, str(DRIVER), str(ckpt), str(out), objective, *sets],
                       capture_output=True, text=True, env={**ENV, **(env or {})}, cwd=ROOT,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.e2e
def test_one_step_on_fixed_inputs_matches_the_record(fixed_ckpt, tmp_path):
    got = {
        "p3o": _fixed_step(fixed_ckpt, tmp_path / "p3o.json", "p3o"),
        "grpo": _fixed_step(fixed_ckpt, tmp_path / "grpo.json", "grpo"),
        # another machine: the same step with other kernels — ATen's baseline (non-vector)
        # kernels and MKL's compatible code path (ATEN_CPU_CAPABILITY alone leaves MKL's matmul
        # and exp, the kernels that differ between Intel and AMD hosts, unchanged)
        "p3o_avx2": _fixed_step(
            fixed_ckpt, tmp_path / "other.json", "p3o", OTHER_MACHINE
        ),  # fmt: skip
        # the unfused output layer (logits materialised): the same step within the tolerances
        "p3o_unfused": _fixed_step(
            fixed_ckpt, tmp_path / "unfused.json", "p3o", sets=["model.fused_logprob=false"]
        ),  # fmt: skip
    }
    if os.environ.get("P3O_RECORD"):
        RECORD.write_text(json.dumps({k: got[k] for k in ("p3o", "grpo")}, indent=1) + "\n")
        pytest.skip(f"recorded {RECORD}")
    want = json.loads(RECORD.read_text())
    want["p3o_avx2"] = want["p3o_unfused"] = want["p3o"]
    for name, w in want.items():
        g = got[name]
        diff = {k: (w[k], g[k]) for k, tol in TOL.items() if not _close(g[k], w[k], tol)}
        assert not diff, f"{name} differs from the record (recorded, now): {diff}"
    # the shipped recipe takes the fused log-prob path; the override really turned it off
    assert got["p3o"]["fused_calls"] > 0 and got["p3o_unfused"]["fused_calls"] == 0
    assert 0.9 < got["p3o"]["ess"] < 1.0  # the shipped batch is off-policy (bf16 engine)
    assert got["p3o"]["loss"] != got["grpo"]["loss"]


def _comparable(row: dict) -> dict:
    """Everything but wall-clock times and rates."""
    timing = ("_s", "_per_s")
    return {k: v for k, v in row.items() if not (k.endswith(timing) or "rollout_wait" in k)}


@pytest.mark.e2e
def test_the_same_command_twice_is_bitwise_identical(base, tmp_path):
    """Metrics (all but timings) and the final checkpoint's tensors, bit for bit. 32 prompts × 8
    samples: at this size MKL's load-dependent thread counts (``MKL_DYNAMIC``, which train.py
    turns off) can make two runs' step-1 losses differ on 2 cores (seen in 2 of 2 trials by
    hand; intermittent, as it depends on the load)."""
    runs = []
    for name in ("a", "b"):
        r = _train(base, tmp_path, name, 2, "--set", "batch.prompts_per_rollout=32")
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs.append(([_comparable(x) for x in rows], tmp_path / name / "checkpoints/step_000002"))
    assert runs[0][0] == runs[1][0]
    ta, tb = (_tensors(ck, tmp_path) for _, ck in runs)
    assert ta.keys() == tb.keys() and len(ta) > 10
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
