"""The stress tool end to end on a 4-cell grid with two workers: every cell trains, the report,
CSVs and plots are written, a second run skips the finished cells, and a rerun from scratch
reproduces the table exactly."""

import csv
import json
import subprocess
import sys

import pytest
import yaml

from .cli import ENV, ROOT


@pytest.mark.e2e
def test_small_grid_runs_resumes_and_reports(base, tmp_path):
    grid = {
        "name": "mini",
        "base": str(ROOT / "recipes/tiny_cpu.yaml"),
        "out": str(tmp_path / "out"),
        "work": str(tmp_path / "work"),
        "eval_limit": 20,
        "probe_prompts": 16,
        "seeds": [1],
        "set": {
            "steps": 2,
            "batch.prompts_per_rollout": 8,
            "data.eval_every": 0,
            "checkpoint.every": 0,
            "optim.log_update_size": True,
            # a long run's curves: eval sets at the base weights, every step and at the end;
            # the reference model for the KL to it
            "reference.enabled": True,
            "eval.every": 1,
            "eval.sets": {
                "h": {"path": str(base / "heldout.jsonl"), "n": 2, "k": [1, 2], "limit": 8}
            },
            "model.checkpoint": str(base / "ckpt"),
            "data.path": str(base / "train.jsonl"),
            "data.eval_path": str(base / "heldout.jsonl"),
        },
        "objectives": {"p3o": {"objective": "p3o"}, "tis": {"objective": "tis"}},
        "mismatch": {
            "bf16": {"family": "baseline", "level": 0, "set": {}},
            "noise": {
                "family": "logit_noise",
                "level": 1.0,
                "set": {"rollout.logit_noise": 1.0},
            },
        },
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    cmd = [sys.executable, "-m", "megatron_p3o.stress", str(path), "--workers", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "out" / "cells.csv")))
    assert sorted(x["cell"] for x in rows) == [
        "p3o__bf16__s1",
        "p3o__noise__s1",
        "tis__bf16__s1",
        "tis__noise__s1",
    ]
    assert all(x["status"] == "ok" and x["steps"] == "2" for x in rows)
    # the invocation's wall time is logged, copied next to the report and stated in it
    logged = [
        json.loads(x) for x in (tmp_path / "out" / "grid_runs.jsonl").read_text().splitlines()
    ]
    assert len(logged) == 1 and logged[0]["cells_run"] == 4 and logged[0]["workers"] == 2
    assert "measured wall time" in (tmp_path / "out" / "report.md").read_text()
    noisy = {x["objective"]: x for x in rows if x["mismatch"] == "noise"}
    clean = {x["objective"]: x for x in rows if x["mismatch"] == "bf16"}
    for o in noisy:  # engine logit noise: a measured mismatch far above bf16's, lower e_B
        assert float(noisy[o]["ess_mean"]) < float(clean[o]["ess_mean"])
        assert float(noisy[o]["abs_diff_first"]) > 10 * float(clean[o]["abs_diff_first"])
        for k in ("probe_abs_dlogp", "probe_abs_seq_dlogp", "probe_kl_b_theta"):
            assert float(noisy[o][k]) > 10 * float(clean[o][k]) > 0, (k, noisy[o][k], clean[o][k])
    # the probe is exogenous: measured before training, it is the setting's, not the objective's
    for setting in (noisy, clean):
        probes = {tuple(x[k] for k in x if k.startswith("probe_")) for x in setting.values()}
        assert len(probes) == 1, probes
    for f in (
        "report.md",
        "steps.csv",
        "reward_vs_step.png",
        "ess_vs_step.png",
        "ratio_hist.png",
        "final_acc_vs_mismatch.png",
        "acc_vs_measured_mismatch.png",
        "entropy_vs_step.png",
    ):
        assert (tmp_path / "out" / f).stat().st_size > 0, f
    report = (tmp_path / "out" / "report.md").read_text()
    assert "mean Δ [95% t-CI]" in report and "| bf16 | P3O − tis |" in report
    # the mechanisms: clip share a fraction, an update under Adam (lr 2e-4 per coordinate: a
    # relative size well below 1), the policy's entropy, one table row per setting × objective
    for x in rows:
        assert 0.0 <= float(x["grad_clipped_run"]) <= 1.0
        assert 0.0 < float(x["update_rel_run"]) < 0.1 and float(x["update_norm_run"]) > 0
        assert float(x["entropy_first5"]) > 0
    assert "## Mechanisms" in report and "| noise | tis |" in report
    for x in rows:  # the eval set's last point, and the KL to the (initial-policy) reference
        assert 0.0 <= float(x["h_pass@1_mean_end"]) <= float(x["h_pass@2_end"]) <= 1.0
        assert float(x["kl_ref_last5"]) > 0 and float(x["completion_len_last5"]) >= 1
    assert "## Long runs" in report and (tmp_path / "out" / "eval_curves.png").stat().st_size
    cell = json.loads((tmp_path / "work" / "p3o__bf16__s1" / "cell.json").read_text())
    assert len(cell["final_per_prompt"]) == 20 and cell["opt_steps"] == 2
    assert [p["step"] for p in cell["eval_curve"]] == [0, 1, 2]
    marks = {p: p.stat().st_mtime_ns for p in (tmp_path / "work").glob("*/cell.json")}
    again = subprocess.run(cmd + ["--list"], capture_output=True, text=True, env=ENV, timeout=600)
    assert again.stdout.count("done ") == 4 and "0 to run" in again.stdout
    rerun = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in marks} == marks  # finished cells are not rerun
    assert json.loads(next(iter(marks)).read_text())["status"] == "ok"
    # a rerun from scratch (same --workers) reproduces every number but the wall time
    import shutil

    first = (tmp_path / "out" / "cells.csv").read_text()
    shutil.rmtree(tmp_path / "work")
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    def table(text):
        rows = list(csv.DictReader(text.splitlines()))
        return [{k: v for k, v in x.items() if k != "wall_s"} for x in rows]

    assert table((tmp_path / "out" / "cells.csv").read_text()) == table(first)
    # tools/rerun_cells.py: one cell again from scratch equals its committed row, every column
    tool = [sys.executable, str(ROOT / "tools/rerun_cells.py"), str(path)]
    r = subprocess.run(
        tool + ["--cells", "tis__noise__s1"], capture_output=True, text=True, env=ENV, timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("tis__noise__s1:")]
    n = line.split()[1]
    assert n.split("/")[0] == n.split("/")[1] and int(n.split("/")[0]) > 30, line
    bad = subprocess.run(tool + ["--cells", "nope"], capture_output=True, text=True, env=ENV)
    assert bad.returncode == 2 and "nope" in bad.stderr and "Traceback" not in bad.stderr
