"""Credit in multi-turn rollouts (issue 62): aborted members leave their group's baseline for
every advantage kind, and turn-level rewards-to-go with a leave-one-out baseline per turn index,
against float64 references written here from the formulas (not the code under test)."""

import math
import random

import pytest
import torch

from megatron_p3o.advantage.estimators import group_advantages
from megatron_p3o.advantage.turns import step_advantages, token_advantages, turn_advantages
from megatron_p3o.loss.oapl import oapl_advantages
from megatron_p3o.types import Sample


def _sample(group, status="completed", reward=1.0, turns=(), spans=()):
    n = spans[-1][1] if spans else 3
    return Sample([1, 2], [5] * n, [0.0] * n, "stop", 0, group_id=group, reward=reward,
                  meta={"status": status, "turn_rewards": list(turns),
                        "turn_spans": [list(x) for x in spans]},
                  policy_mask=[1] * n)  # fmt: skip


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "oapl"])
def test_aborted_members_leave_the_baseline(kind):
    """Six members with reward 1 and two aborted ones (reward 0, mask 0): counted, they gave the
    six +0.577 under GRPO; left out, the six are all equal — advantage 0 — and so are the
    aborted. A second group's values are what the kind gives its members alone."""
    samples = [_sample(0) for _ in range(6)] + [_sample(0, "aborted", 0.0) for _ in range(2)]
    other = [0.0, 1.0, 0.5, 0.25]
    samples += [_sample(1, reward=r) for r in other]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    groups = torch.tensor([s.group_id for s in samples])
    own = (lambda r, g: oapl_advantages(r, g)) if kind == "oapl" else None
    adv = step_advantages(samples, rewards, groups, own, "grpo" if kind == "oapl" else kind,
                          1e-6)  # fmt: skip
    assert adv[:8].abs().max() == 0.0
    counted = group_advantages(rewards[:8], groups[:8], "grpo")
    assert abs(float(counted[0]) - 0.5773) < 1e-3  # the defect's value, for the record
    r = torch.tensor(other, dtype=torch.float64)
    if kind == "grpo":
        want = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    elif kind == "dr_grpo":
        want = r - r.mean()
    elif kind == "rloo":
        want = torch.stack([r[i] - (r.sum() - r[i]) / 3 for i in range(4)])
    else:
        want = r - torch.logsumexp(r, 0) + math.log(4)
    assert torch.allclose(adv[8:], want, atol=1e-12)


def test_a_group_left_with_one_member_has_no_baseline():
    samples = [_sample(0, reward=1.0), _sample(0, "aborted", 0.0), _sample(1, reward=0.0),
               _sample(1, reward=1.0)]  # fmt: skip
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    adv = step_advantages(samples, rewards, groups, None, "rloo", 1e-6)
    assert adv.tolist() == [0.0, 0.0, -1.0, 1.0]


def _reference_turn_advantages(rewards, groups, valid, gamma, scale, eps=1e-6):
    """The module docstring's formulas, written out: G by explicit powers of γ; baseline the
    mean over the *other* valid members that reached turn k; scale the group's population std
    of G_0."""
    b = len(rewards)
    G = [[sum(gamma ** (j - k) * rewards[i][j] for j in range(k, len(rewards[i])))
          for k in range(len(rewards[i]))] for i in range(b)]  # fmt: skip
    out = []
    for i in range(b):
        if not valid[i]:
            out.append([])
            continue
        mates = [j for j in range(b) if valid[j] and groups[j] == groups[i]]
        s = 1.0
        if scale == "grpo":
            g0 = [G[j][0] for j in mates]
            mu = sum(g0) / len(g0)
            s = math.sqrt(sum((x - mu) ** 2 for x in g0) / len(g0)) + eps
        row = []
        for k in range(len(G[i])):
            others = [G[j][k] for j in mates if j != i and len(G[j]) > k]
            row.append((G[i][k] - (sum(others) / len(others) if others else 0.0)) / s)
        out.append(row)
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("scale", ["grpo", "none"])
def test_turn_advantages_equal_the_float64_reference(gamma, scale):
    """Trajectories that stop after 1 to 5 turns (the policy decides), rewards per turn, some
    members aborted: every turn's advantage equals the formulas evaluated directly."""
    rng = random.Random(0)
    rewards = [[rng.choice([0.0, 0.5, 1.0]) for _ in range(rng.randint(1, 5))] for _ in range(24)]
    groups = [i // 6 for i in range(24)]
    valid = [rng.random() > 0.15 for _ in range(24)]
    got = turn_advantages(rewards, groups, valid, gamma, scale)
    want = _reference_turn_advantages(rewards, groups, valid, gamma, scale)
    assert [len(x) for x in got] == [len(x) for x in want]
    for g, w in zip(got, want):
        assert all(abs(a - b) <= 1e-12 for a, b in zip(g, w)), (g, w)


def test_the_baseline_of_a_turn_does_not_depend_on_the_trajectory_itself():
    """Changing one member's own turns (its rewards, when it stops) changes no baseline it
    gets: each of its turns is compared with the same others' returns."""
    base = [[1.0, 0.0], [0.0, 0.0, 1.0], [0.5], [1.0, 1.0]]
    groups, valid = [0, 0, 0, 0], [True] * 4
    a = turn_advantages(base, groups, valid, 1.0, "none")
    changed = [[0.0, 1.0, 1.0, 1.0]] + base[1:]
    b = turn_advantages(changed, groups, valid, 1.0, "none")
    g_a = [sum(base[0][k:]) for k in range(2)]
    g_b = [sum(changed[0][k:]) for k in range(4)]
    # baseline = G − A for trajectory 0, turn by turn (the turns both have)
    assert [g_a[k] - a[0][k] for k in range(2)] == [g_b[k] - b[0][k] for k in range(2)]


def test_token_advantages_fill_each_turns_tokens():
    s = _sample(0, spans=[(0, 3), (5, 7)], turns=[0.0, 1.0])
    (row,) = token_advantages([s], [[0.25, -1.0]])
    assert row == [0.25, 0.25, 0.25, 0.0, 0.0, -1.0, -1.0]
