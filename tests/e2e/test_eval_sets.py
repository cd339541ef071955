"""Multi-set evaluation through the CLI on the tiny task: every set's pass@k, mean pass@1 and
greedy accuracy reach eval.jsonl, TensorBoard and an offline W&B run; over-long shaping and
truncation masking run end to end."""

import json
import subprocess
import sys

import pytest

from .cli import ENV, ROOT


@pytest.mark.e2e
def test_eval_sets_reach_jsonl_tensorboard_and_wandb(base, tmp_path):
    rows = [json.loads(x) for x in (base / "heldout.jsonl").read_text().splitlines()[:12]]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    renamed = [{"question": r["prompt"], "solution": r["answer"]} for r in rows[4:]]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
    sets = (
        f"eval.sets={{a: {{path: {tmp_path / 'a.jsonl'}, n: 5, k: [1, 2, 5]}}, "
        f"b: {{path: {tmp_path / 'b.jsonl'}, prompt_key: question, answer_key: solution, "
        f"n: 2, k: [2], temperature: 0.7, greedy: false}}}}"
    )
    args = {
        "model.checkpoint": base / "ckpt",
        "data.path": base / "train.jsonl",
        "data.eval_path": "''",
        "steps": 2,
        "run.dir": tmp_path,
        "run.name": "ev",
        "batch.prompts_per_rollout": 8,
        "eval.every": 1,
        "wandb.enabled": "true",
        "wandb.mode": "offline",
        "reward.overlong": "{max_len: 5, cache: 2}",
        "batch.mask_truncated": "true",
    }
    cmd = [sys.executable, "-m", "megatron_p3o.train", str(ROOT / "recipes/tiny_cpu.yaml")]
    cmd += [x for k, v in args.items() for x in ("--set", f"{k}={v}")] + ["--set", sets]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    run = tmp_path / "ev"
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [1, 2]
    keys = {
        "eval/a/pass@1", "eval/a/pass@2", "eval/a/pass@5", "eval/a/pass@1_mean",
        "eval/a/greedy_acc", "eval/b/pass@2", "eval/b/pass@1_mean",
    }  # fmt: skip
    for e in evals:
        assert keys <= set(e), set(e)
        assert e["eval/a/prompts"] == 8 and e["eval/b/prompts"] == 8
        assert e["eval/a/pass@1"] == pytest.approx(e["eval/a/pass@1_mean"])
        assert e["eval/a/pass@1"] <= e["eval/a/pass@2"] <= e["eval/a/pass@5"] <= 1
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert 0 <= m["truncation_rate"] <= 1 and m["completion_len_max"] <= 5
    # TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run / "tensorboard"))
    ea.Reload()
    assert keys <= set(ea.Tags()["scalars"])
    assert [e.step for e in ea.Scalars("eval/a/pass@5")] == [1, 2]
    # W&B, offline: the run's record file holds every key (protobuf keeps them as UTF-8)
    (wb,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    data = wb.read_bytes()
    for k in keys | {"train/loss", "train/ess", "train/log_ratio_hist"}:
        assert k.encode() in data, k
    run_id = (run / "wandb_id.txt").read_text().strip()
    assert run_id in wb.name
    # the same command with more steps resumes from the checkpoint and the same W&B run
    more = [c if c != "steps=2" else "steps=3" for c in cmd]
    r = subprocess.run(more, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout
    assert (run / "wandb_id.txt").read_text().strip() == run_id
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(run_id in f.name for f in files)
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [
        1, 2, 3,
    ]  # fmt: skip
