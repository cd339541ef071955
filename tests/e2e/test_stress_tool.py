"""The stress tool end to end on a 4-cell grid: every cell trains, the report, CSVs and plots are
written, and a second run skips the finished cells."""

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
        "seeds": [1],
        "set": {
            "steps": 2,
            "batch.prompts_per_rollout": 8,
            "batch.micro_batch_size": 32,
            "data.eval_every": 0,
            "checkpoint.every": 0,
            "model.checkpoint": str(base / "ckpt"),
            "data.path": str(base / "train.jsonl"),
            "data.eval_path": str(base / "heldout.jsonl"),
        },
        "objectives": {"p3o": {"objective": "p3o"}, "tis": {"objective": "tis"}},
        "mismatch": {
            "bf16": {"family": "baseline", "level": 0, "set": {}},
            "noise": {
                "family": "logprob_noise",
                "level": 0.5,
                "set": {"rollout.logprob_noise": 0.5},
            },
        },
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    cmd = [sys.executable, "-m", "megatron_p3o.stress", str(path)]
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
    noisy = {x["objective"]: float(x["ess_mean"]) for x in rows if x["mismatch"] == "noise"}
    clean = {x["objective"]: float(x["ess_mean"]) for x in rows if x["mismatch"] == "bf16"}
    assert all(noisy[o] < clean[o] for o in noisy)  # injected ℓb noise lowers e_B
    for f in (
        "report.md",
        "steps.csv",
        "reward_vs_step.png",
        "ess_vs_step.png",
        "ratio_hist.png",
        "final_acc_vs_mismatch.png",
    ):
        assert (tmp_path / "out" / f).stat().st_size > 0, f
    assert "P3O" in (tmp_path / "out" / "report.md").read_text()
    marks = {p: p.stat().st_mtime_ns for p in (tmp_path / "work").glob("*/cell.json")}
    again = subprocess.run(cmd + ["--list"], capture_output=True, text=True, env=ENV, timeout=600)
    assert again.stdout.count("done ") == 4 and "0 to run" in again.stdout
    rerun = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in marks} == marks  # finished cells are not rerun
    assert json.loads(next(iter(marks)).read_text())["status"] == "ok"
