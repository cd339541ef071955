"""Runs, logs and progress as users expect (issue 41, item 5).

* the final evaluation runs once when ``eval_every`` divides ``steps`` (it ran twice: two rows
  for the last step in ``eval.jsonl``);
* the same command on a finished run says so, exits 0, builds nothing and writes no new rows (it
  re-evaluated, appended duplicates and printed "change: +0.0 points");
* resuming with another ``run.seed`` (which orders the prompts) is refused unless
  ``run.allow_config_change`` (every ``run.*`` key used to be free on resume);
* step lines read ``step N/total`` with an ETA; the base-model bar ends at 100% when the target
  is reached early (it ended at "18%").
"""

import json
import re
import subprocess
import sys

import pytest

from .cli import ENV, ROOT

pytestmark = pytest.mark.e2e


def _train(base, run_dir, *sets):
    args = {
        "model.checkpoint": base / "ckpt", "data.path": base / "train.jsonl",
        "data.eval_path": base / "heldout.jsonl", "data.eval_every": 2, "steps": 2,
        "batch.prompts_per_rollout": 8, "run.dir": run_dir, "run.name": "life",
    }  # fmt: skip
    cmd = [sys.executable, "-m", "megatron_p3o.train", str(ROOT / "recipes/tiny_cpu.yaml")]
    for k, v in args.items():
        cmd += ["--set", f"{k}={v}"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)


def _eval_rows(run):
    return [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]


def test_a_run_evaluates_once_per_step_and_a_finished_run_stays_finished(base, tmp_path):
    r = _train(base, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "life"
    steps = [x["step"] for x in _eval_rows(run) if "eval/heldout_accuracy" in x]
    assert steps == [0, 2], steps
    lines = [x for x in r.stdout.splitlines() if x.lstrip().startswith("step")]
    assert re.search(r"step\s+1/2\s.*ETA \d+:\d\d:\d\d", lines[0]), lines
    assert re.search(r"step\s+2/2\s.*ETA 0:00:00", lines[1]), lines
    before = (run / "eval.jsonl").read_bytes()
    again = _train(base, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished" in again.stdout and "step_000002" in again.stdout, again.stdout
    assert "held-out accuracy" not in again.stdout and "change:" not in again.stdout
    assert (run / "eval.jsonl").read_bytes() == before  # no new rows
    # more steps with another seed: the prompt order would change mid-epoch → refused
    seed = _train(base, tmp_path, "steps=3", "run.seed=7")
    assert seed.returncode == 2, seed.stdout[-2000:] + seed.stderr[-2000:]
    assert "run.seed" in seed.stderr and len(seed.stderr.strip().splitlines()) == 1, seed.stderr
    assert (run / "eval.jsonl").read_bytes() == before


def test_the_base_model_bar_ends_at_100_percent_when_it_stops_early(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/make_tiny_base.py"), "--out", str(tmp_path / "b"),
         "--target-acc", "0", "--eval-every", "1", "--max-steps", "50"],
        capture_output=True, text=True, env={**ENV, "COLUMNS": "160"}, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    bar = [x for x in r.stdout.splitlines() if "SFT warm-up" in x]
    assert bar and "100%" in bar[-1], r.stdout[-2000:]
    assert json.loads((tmp_path / "b/base.json").read_text())["sft_steps"] == 1
