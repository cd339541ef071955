"""The agent recipe as a user runs it (issue 64): ``recipes/tiny_cpu_code.yaml``, whose rollout
is the bundled code agent on the ``openai`` client through the trainer's OpenAI-compatible
endpoint, the model's hermes ``python`` calls run in the sandbox. The shipped base
(``bases/tool_code``) shrugs at greedy decoding and writes a call on about a third of its
samples; a few steps raise held-out accuracy (greedy, through the same agent) and the rate of
parsed tool calls. The recipe's own curve (the full batch, 40 steps) is in docs/agents.md."""

import json
import sys

import pytest

from .cli import ROOT
from .test_preemption import _metrics_lines, _run

RECIPE = str(ROOT / "recipes/tiny_cpu_code.yaml")


@pytest.mark.e2e
def test_the_code_recipe_learns_through_the_endpoint(code_base, tmp_path):
    steps = 8
    held = tmp_path / "heldout100.jsonl"  # the first 100 held-out prompts: CI's budget
    held.write_text("".join((code_base / "heldout.jsonl").read_text().splitlines(True)[:100]))
    sets = {"model.checkpoint": code_base / "ckpt", "data.path": code_base / "train.jsonl",
            "data.eval_path": held, "data.eval_every": steps, "run.dir": tmp_path,
            "run.name": "learn", "steps": steps, "batch.prompts_per_rollout": 16,
            "rollout.n_samples": 4}  # fmt: skip
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    cmd = [sys.executable, "-m", "megatron_p3o.train", RECIPE, *args]
    rc, log = _run(cmd, tmp_path, "learn")
    assert rc == 0, log[-3000:]
    acc = [json.loads(x)["eval/heldout_accuracy"]
           for x in (tmp_path / "learn" / "eval.jsonl").read_text().splitlines()]  # fmt: skip
    rows = [json.loads(x) for x in _metrics_lines(tmp_path / "learn")]
    assert len(acc) == 2 and acc[-1] - acc[0] >= 0.15, acc
    assert rows[-1]["mt_tool_calls"] > rows[0]["mt_tool_calls"] + 0.1, rows
    assert all(r["mt_ended_aborted"] == 0 for r in rows), rows  # no agent failed
