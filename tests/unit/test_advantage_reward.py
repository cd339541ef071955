import math

import pytest
import torch

from megatron_p3o.advantage.estimators import group_advantages
from megatron_p3o.reward import RewardError, build_reward, score_samples

R = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.0, 1.0])
G = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])


def _ref(kind):
    out = []
    for i in range(len(R)):
        grp = [float(R[j]) for j in range(len(R)) if G[j] == G[i]]
        mean = sum(grp) / len(grp)
        if kind == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in grp) / len(grp))
            out.append((float(R[i]) - mean) / (std + 1e-6))
        elif kind == "dr_grpo":
            out.append(float(R[i]) - mean)
        else:
            out.append(float(R[i]) - (sum(grp) - float(R[i])) / (len(grp) - 1))
    return out


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages(kind):
    got = group_advantages(R, G, kind).tolist()
    assert all(abs(a - b) < 1e-12 for a, b in zip(got, _ref(kind))), (got, _ref(kind))


def test_advantage_errors():
    with pytest.raises(ValueError, match="non-finite rewards at rows \\[1\\]"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="at least 2 completions"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), "rloo")
    with pytest.raises(ValueError, match="advantage.kind='gae'"):
        group_advantages(R, G, "gae")


def test_rewards():
    mv = build_reward("math_verify")
    assert mv("so the answer is $\\frac{1}{2}$", "0.5") == 1.0 and mv("it is 3", "4") == 0.0
    em = build_reward("exact_match")
    assert em("12+30=42", "42") == 1.0 and em("#### 41", "42") == 0.0


def boom(completion, answer):
    if "x" in completion:
        raise KeyError("no x allowed")
    return float("inf") if completion == "inf" else 1.0


def test_reward_errors_name_the_sample():
    fn = build_reward("python", f"{__name__}:boom")
    assert score_samples(fn, ["a", "b"], ["1", "1"], [0, 0]) == [1.0, 1.0]
    with pytest.raises(RewardError, match="sample 1 \\(prompt group 3\\).*KeyError"):
        score_samples(fn, ["a", "x"], ["1", "1"], [0, 3])
    with pytest.raises(RewardError, match="returned inf for sample 0"):
        score_samples(fn, ["inf"], ["1"], [0])
    with pytest.raises(RewardError, match="module:callable"):
        build_reward("python", "nocolon")
