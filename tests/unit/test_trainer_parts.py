"""The trainer's small parts: the record of several optimizer steps, the phase timer, the train
batch (no renumbering of samples), Literal config choices, capabilities, the tiny task's reward."""

import time

import pytest
import torch

from megatron_p3o.config.loading import load_config
from megatron_p3o.loss import build_objective
from megatron_p3o.observability.metrics import PhaseTimer, combine_optimizer_steps
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.types import Group, Sample, TrainBatch


def test_one_optimizer_step_is_reported_as_it_is():
    m = {"loss": 0.5, "ess": 0.9, "log_ratio_hist": [1, 2]}
    out = combine_optimizer_steps([(0, 0, m)])
    assert out == {**m, "per_step": [{"epoch": 0, "minibatch": 0, "loss": 0.5, "ess": 0.9}]}


def test_every_optimizer_step_of_a_rollout_batch_is_covered():
    # 2 mini-batches × 2 epochs; values chosen so that mean/sum/per-epoch differ
    steps = [
        (0, 0, {"loss": 1.0, "ess": 0.9, "skipped_steps": 0.0, "log_ratio_hist": [1, 0]}),
        (0, 1, {"loss": 3.0, "ess": 0.7, "skipped_steps": 1.0, "log_ratio_hist": [0, 2]}),
        (1, 0, {"loss": 5.0, "ess": 0.5, "skipped_steps": 0.0, "log_ratio_hist": [1, 1]}),
        (1, 1, {"loss": 7.0, "ess": 0.3, "skipped_steps": 1.0, "log_ratio_hist": [3, 0]}),
    ]
    for _, _, m in steps:
        m.update(k3_to_behavior=m["loss"] / 10, clip_frac=m["ess"] / 2)
    out = combine_optimizer_steps(steps)
    assert out["opt_steps"] == 4
    assert out["loss"] == pytest.approx(4.0)  # mean over the 4 steps, not the last one's 7
    assert out["skipped_steps"] == 2.0  # summed: every skipped step is counted
    assert out["ess_steps"] == [0.9, 0.7, 0.5, 0.3]
    assert out["ess_epoch0"] == pytest.approx(0.8) and out["ess_epoch1"] == pytest.approx(0.4)
    assert out["ess_min"] == 0.3
    assert out["log_ratio_hist"] == [5, 3]
    # every epoch × mini-batch keeps its own e_B, k3 and clip fraction
    per = out["per_step"]
    assert [(p["epoch"], p["minibatch"]) for p in per] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p["ess"] for p in per] == [0.9, 0.7, 0.5, 0.3]
    assert [p["k3_to_behavior"] for p in per] == [0.1, 0.3, 0.5, 0.7]
    assert [p["clip_frac"] for p in per] == [0.45, 0.35, 0.25, 0.15]


def test_phase_timer_adds_up_named_phases():
    t = PhaseTimer()
    with t("train"):
        time.sleep(0.01)
    with t("train"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError):
        with t("sync"):
            raise RuntimeError("boom")
    assert set(t.seconds) == {"train_s", "sync_s"}
    assert t.seconds["train_s"] >= 0.02


def _group(gid, rewards):
    return Group(
        0, [1], "a", [Sample([1], [2], [-0.1], "stop", 0, group_id=gid, reward=r) for r in rewards]
    )


def test_train_batch_indexes_groups_without_touching_samples():
    groups = [_group(5, [1.0, 0.0]), _group(5, [0.0, 0.0, 1.0])]  # a replayed group keeps id 5
    b = TrainBatch.from_groups(groups)
    assert b.group_index.tolist() == [0, 0, 1, 1, 1]
    assert b.rewards.dtype == torch.float64 and b.rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert all(s.group_id == 5 for g in groups for s in g.samples)


def test_literal_choices_are_checked_by_the_loader():
    with pytest.raises(ConfigError, match=r"rollout.precision='bf61'.*did you mean 'bf16'"):
        load_config(None, ["rollout.precision=bf61"])
    with pytest.raises(ConfigError, match=r"loss.ess_scope='batch'"):
        load_config(None, ["loss.ess_scope=batch"])
    with pytest.raises(ConfigError, match=r"loss.prepass_fuse=0 must be >= 1"):
        load_config(None, ["loss.prepass_fuse=0"])
    cfg = load_config(None, ["rollout.sampling.top_k=5"])
    assert cfg.rollout.sampling.top_k == 5  # rollout.sampling is SamplingParams itself


def test_objectives_declare_what_they_need():
    assert build_objective("p3o").behavior_ratio and build_objective("p4o").behavior_ratio
    assert not build_objective("grpo").behavior_ratio
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    gids = torch.tensor([0, 0, 1, 1])
    assert build_objective("grpo").advantages(rewards, gids) is None
    oapl = build_objective("oapl").advantages(rewards, gids)
    assert oapl.shape == (4,) and oapl[1] < 0 < oapl[0]  # A* = r − V*, V* between 0 and 1


def test_tiny_task_reward_ignores_the_character_tokenizer_spaces():
    from megatron_p3o.data.tasks.arithmetic import reward

    assert reward("2 8", "28") == 1.0 and reward("28", "28") == 1.0 and reward("2 9", "28") == 0.0


def test_a_sample_spanning_two_versions_is_counted_and_trained_per_token():
    """SGLang retracted a request at a push and resumed it under new weights: 3 tokens of
    version 4, 2 of version 5. Staleness per sequence counts its oldest token, per token each
    one; the loss side gets each token's own ℓb; a checkpoint keeps the versions."""
    from megatron_p3o.observability.metrics import staleness
    from megatron_p3o.update.batching import packed_microbatch

    lb = [-0.1, -0.2, -0.3, -1.4, -1.5]
    span = Sample([1, 2], [7, 8, 9, 10, 11], lb, "length", 4, token_versions=[4, 4, 4, 5, 5])
    fresh = Sample([1, 2], [7, 8], [-0.5, -0.6], "stop", 5)
    st = staleness([span, fresh], trained=5)
    assert st["staleness_mean"] == (1 + 0) / 2 and st["staleness_max"] == 1.0
    assert st["staleness_token_mean"] == 3 / 7 and st["staleness_token_max"] == 1.0
    assert st["straddling_frac"] == 0.5
    mb = packed_microbatch([span, fresh], [1.0, -1.0], [0, 1], seq_length=16)
    resp = mb["response"]
    got = resp["behavior_logprobs"][resp["mask"] > 0].tolist()
    assert got == pytest.approx(lb + [-0.5, -0.6])
    back = Group.from_dict(Group(0, [1, 2], "3", [span]).to_dict()).samples[0]
    assert back.token_versions == [4, 4, 4, 5, 5] and back.versions() == [4, 4, 4, 5, 5]
    with pytest.raises(ValueError, match="2 token weight versions"):
        Sample([1], [7, 8, 9], [-0.1] * 3, "stop", 1, token_versions=[1, 2])
