"""The main job end to end, as a user runs it: base model tool, then the trainer CLI on one
process and under torchrun (2 ranks)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from .cli import ENV, ROOT, torchrun


def _sets(base, run_dir, name, steps=2):
    return [
        "--set",
        f"model.checkpoint={base / 'ckpt'}",
        "--set",
        f"data.path={base / 'train.jsonl'}",
        "--set",
        f"data.eval_path={base / 'heldout.jsonl'}",
        "--set",
        f"steps={steps}",
        "--set",
        f"run.dir={run_dir}",
        "--set",
        f"run.name={name}",
        "--set",
        "data.eval_every=0",
        "--set",
        "batch.prompts_per_rollout=8",
    ]


def _check_run(run: Path, steps: int, out: str):
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for m in lines:
        for key in (
            "ess",
            "loss",
            "reward_mean",
            "abs_logprob_diff",
            "ratio_p99",
            "rollout_s",
            "train_s",
            "grad_norm",
            "weight_version",
            "n_tokens",
        ):
            assert key in m, key
        assert 0 < m["ess"] <= 1 and m["weight_version"] == m["step"]
    assert (run / "checkpoints" / "latest").read_text() == f"step_{steps:06d}"
    assert (run / "checkpoints" / f"step_{steps:06d}" / "metadata.json").is_file()
    assert "held-out accuracy before training" in out and "change:" in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(run / "tensorboard"))
    ev.Reload()
    tags = ev.Tags()["scalars"]
    assert {"train/ess", "train/loss", "train/reward_mean", "eval/heldout_accuracy"} <= set(tags)
    assert [e.step for e in ev.Scalars("train/ess")] == list(range(1, steps + 1))


@pytest.mark.e2e
def test_single_process_run(base, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_p3o.train",
            str(ROOT / "recipes/tiny_cpu.yaml"),
            *_sets(base, tmp_path, "one"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    _check_run(tmp_path / "one", 2, r.stdout)
    cfg = json.loads((tmp_path / "one" / "config.json").read_text())
    assert cfg["loss"]["objective"] == "p3o" and cfg["rollout"]["precision"] == "bf16"


@pytest.mark.e2e
@pytest.mark.distributed
def test_torchrun_two_ranks(base, tmp_path):
    r = subprocess.run(
        [
            *torchrun(2),
            "-m",
            "megatron_p3o.train",
            str(ROOT / "recipes/tiny_cpu.yaml"),
            *_sets(base, tmp_path, "two", steps=3),
            "--set",
            "batch.micro_batch_size=16",
            # the off-policy machinery on the DP path: async K=1, DAPO refills, BAPO
            "--set",
            "rollout.max_staleness=1",
            "--set",
            "rollout.dynamic_sampling=true",
            "--set",
            "replay.policy=bapo",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    _check_run(tmp_path / "two", 3, r.stdout)
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    # the fresh rollouts lag by 0, 1, 1 versions (async K=1); a step that trained BAPO-replayed
    # groups may also hold older ones (whether the base's sampled groups get replayed depends on
    # the tokens drawn, hence on the CPU's rounding): at most as old as the run
    for i, (m, fresh) in enumerate(zip(lines, [0.0, 1.0, 1.0])):
        if m["replay_groups"] == 0:
            assert m["staleness_max"] == fresh, (i, m["staleness_max"])
        else:
            assert fresh <= m["staleness_max"] <= i, (i, m["staleness_max"])
    assert [m["rollout_version"] for m in lines] == [0.0, 0.0, 1.0]
    # both switched on and both acted: dynamic sampling dropped and refilled homogeneous groups
    # (1 prompt in 4 is all-right or all-wrong at the base's 0.48), BAPO kept mixed groups for
    # reuse or remembered difficult ones
    assert sum(m["dynamic_refilled"] for m in lines) > 0, [m["dynamic_refilled"] for m in lines]
    assert max(m["replay_stored"] + m["replay_difficult"] for m in lines) > 0


@pytest.mark.e2e
def test_off_policy_knobs(base, tmp_path):
    """Several optimizer steps per rollout batch (2 mini-batches × 2 epochs) and a rollout policy
    refreshed every 2 steps: the engine lags, the recorded weight version shows it, and the step
    loss sees the off-policy data (e_B < 1)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_p3o.train",
            str(ROOT / "recipes/tiny_cpu.yaml"),
            *_sets(base, tmp_path, "offp", steps=3),
            "--set",
            "batch.minibatches=2",
            "--set",
            "batch.epochs=2",
            "--set",
            "batch.micro_batch_size=16",
            "--set",
            "rollout.sync_every=2",
            "--set",
            "optim.lr=3e-3",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "offp" / "metrics.jsonl").read_text().splitlines()]
    # batch j is rolled out with version 2·⌊j/2⌋: steps 1–3 train on versions 0, 0, 2
    assert [m["rollout_version"] for m in lines] == [0, 0, 2]
    assert [m["staleness_max"] for m in lines] == [0, 1, 0]
    assert [m["weight_version"] for m in lines] == [1, 2, 3]
    assert all(0 < m["ess"] < 1 for m in lines)
    for m in lines:  # every optimizer step of the rollout batch is in the record, not the last
        assert m["opt_steps"] == 4 and len(m["ess_steps"]) == 4 and m["skipped_steps"] == 0
        assert m["ess_min"] == min(m["ess_steps"])
        assert m["ess_epoch0"] == pytest.approx(sum(m["ess_steps"][:2]) / 2)
        assert m["ess_epoch1"] == pytest.approx(sum(m["ess_steps"][2:]) / 2)
        # reuse diagnostics: the second epoch sees how far the first moved the policy on the
        # same tokens (lr 3e-3 moves it); P3O's capped tokens carry a share of its score weight
        per = m["per_step"]
        assert [("kl_prev_epoch" in s) for s in per] == [False, False, True, True]
        assert all(s["kl_prev_epoch"] > 0 for s in per if s["epoch"] == 1)
    shares = [s["capped_weight_share"] for m in lines for s in m["per_step"]]
    assert any(math.isfinite(x) for x in shares)  # nan: a step whose advantages are all 0
    assert all(0 <= x <= 1 for x in shares if math.isfinite(x))


def test_base_model_matches_the_committed_config(base):
    """recipes/models/tiny-llama/config.json (the tiny recipe's --dry-run model) is what the
    base-model tool writes."""
    made = json.loads((base / "ckpt" / "hf" / "config.json").read_text())
    committed = json.loads((ROOT / "recipes/models/tiny-llama/config.json").read_text())
    made.pop("transformers_version", None)
    assert made == committed


@pytest.mark.e2e
def test_main_job_learns(base, tmp_path):
    """The tiny recipe as shipped (P3O, bf16 rollouts, its learning rate and batch), shortened to
    20 steps: held-out greedy accuracy must rise by at least 10 points (the full 60-step run
    gains 20–30)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_p3o.train",
            str(ROOT / "recipes/tiny_cpu.yaml"),
            "--set",
            f"model.checkpoint={base / 'ckpt'}",
            "--set",
            f"data.path={base / 'train.jsonl'}",
            "--set",
            f"data.eval_path={base / 'heldout.jsonl'}",
            "--set",
            "steps=20",
            "--set",
            f"run.dir={tmp_path}",
            "--set",
            "run.name=learn",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(tmp_path / "learn" / "tensorboard"))
    ev.Reload()
    acc = {e.step: e.value for e in ev.Scalars("eval/heldout_accuracy")}
    assert min(acc) == 0 and max(acc) == 20, acc
    assert acc[20] - acc[0] >= 0.10, acc


@pytest.mark.e2e
def test_bf16_params_train_and_checkpoint(base, tmp_path):
    """bf16 parameters (the GPU setting) on the local spec: the torch norms are cast with the
    rest, so Megatron's fp16/bf16 optimizer can map every parameter when the checkpoint is
    written (it could not: "Param id … does not match any model sharded param")."""
    r = subprocess.run(
        [sys.executable, "-m", "megatron_p3o.train", str(ROOT / "recipes/tiny_cpu.yaml"),
         *_sets(base, tmp_path, "bf16"), "--set", "model.params_dtype=bfloat16"],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    _check_run(tmp_path / "bf16", 2, r.stdout)
