"""Credit for multi-turn trajectories: which members a group's baseline counts, and turn-level
rewards (pure tensor functions, float64).

Members that left (``aborted``: the environment's reset failed, the engine aborted). They are
never trained (mask 0). The rule, for every advantage kind (the configured one, or an
objective's own, OAPL's A*): a group's baseline and scale are computed over its members that
were not aborted, as if the aborted ones had never been drawn; an aborted member's advantage is
0. A group left with one member has no baseline from others: under ``rloo`` (leave-one-out) its
advantage is 0; under ``grpo``/``dr_grpo`` it is 0 anyway (its own mean). Counting an aborted
member as reward 0 would give the others a gradient from an environment failure (a group of 6
rewards of 1 and 2 aborted ones: +0.577 each under GRPO instead of 0).

Turn-level credit (``rollout.multi_turn.credit: turn``). Each turn k of trajectory i has the
reward r_{i,k} its environment step returned; its return-to-go is

    G_{i,k} = Σ_{j ≥ k} γ^{j−k} r_{i,j}        (γ = ``rollout.multi_turn.discount``)

and every policy token of turn k gets

    A_{i,k} = (G_{i,k} − b_{i,k}) / s,   b_{i,k} = mean{ G_{i',k} : i' ≠ i in i's group,
                                                          i' reached turn k, not aborted }

(b = 0 when no other member reached turn k), with s = std_j G_{j,0} + ε over the group's
members for ``advantage.kind: grpo`` (population std, as GRPO's), s = 1 for ``dr_grpo`` and
``rloo``. Why this baseline: verl #7244 shows that normalising rewards per turn index and
summing the normalised terms over a trajectory's remaining turns subtracts a number of baseline
terms set by the trajectory's own stopping turn — an action-dependent baseline, biased wherever
the policy decides when to stop (a hidden −E[r] per extra turn). Here the baseline of turn k is
one term, built from the *other* members' returns only: given the history up to turn k it does
not depend on the trajectory's action at k or after, so E[∇log π(a_k|s_k)·b_{i,k}] = 0 and the
estimate stays unbiased however each trajectory stops. With γ = 1 and one reward at the end,
G_{i,k} is the trajectory's reward for every k; only the baseline differs from trajectory
credit (the members that reached the turn).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor


def among_members(
    fn: Callable[[Tensor, Tensor], Tensor], rewards: Tensor, group_ids: Tensor, valid: Tensor
) -> Tensor:
    """``fn(rewards, group_ids)`` over the rows where ``valid [B]`` holds; 0 elsewhere. Groups
    with one valid member get 0 (no baseline from others), whatever ``fn``."""
    out = torch.zeros(rewards.shape[0], dtype=torch.float64)
    keep = valid.bool()
    if not bool(keep.any()):
        return out
    g = group_ids[keep]
    _, inv, count = torch.unique(g, return_inverse=True, return_counts=True)
    multi = count[inv] > 1
    rows = keep.nonzero().flatten()[multi]
    if len(rows):
        out[rows] = fn(rewards[rows], group_ids[rows]).double()
    return out


def returns_to_go(turn_rewards: Sequence[float], gamma: float) -> List[float]:
    """``G_k = Σ_{j≥k} γ^{j−k} r_j`` for each turn k."""
    out, g = [], 0.0
    for r in reversed(list(turn_rewards)):
        g = float(r) + gamma * g
        out.append(g)
    return out[::-1]


def turn_advantages(
    turn_rewards: Sequence[Sequence[float]],
    group_ids: Sequence[int],
    valid: Sequence[bool],
    gamma: float,
    scale: str = "grpo",
    eps: float = 1e-6,
) -> List[List[float]]:
    """``A[i][k]`` of trajectory i's turn k (module docstring); ``[]`` for invalid members.

    Args:
        turn_rewards: per trajectory, the reward after each of its turns (``[B][K_i]``).
        group_ids: ``[B]`` prompt groups.
        valid: ``[B]`` False for aborted members (out of every baseline, advantage none).
        gamma: discount of later turns' rewards.
        scale: "grpo" (divide by the group's std of G_0 + eps) or "none".
    """
    b = len(turn_rewards)
    G = [returns_to_go(r, gamma) if v else [] for r, v in zip(turn_rewards, valid)]
    groups: dict = {}
    for i in range(b):
        if valid[i]:
            groups.setdefault(int(group_ids[i]), []).append(i)
    out: List[List[float]] = [[] for _ in range(b)]
    for members in groups.values():
        s = 1.0
        if scale == "grpo":
            g0 = torch.tensor([G[i][0] if G[i] else 0.0 for i in members], dtype=torch.float64)
            s = float(g0.std(unbiased=False)) + eps
        for i in members:
            row = []
            for k, gk in enumerate(G[i]):
                others = [G[j][k] for j in members if j != i and len(G[j]) > k]
                base = sum(others) / len(others) if others else 0.0
                row.append((gk - base) / s)
            out[i] = row
    return out


def token_advantages(samples, per_turn: Sequence[Sequence[float]]) -> List[Optional[list]]:
    """Each sample's per-completion-token advantages: its turn k's value on turn k's policy
    tokens (``meta["turn_spans"]``), 0 on the environment's tokens (which the loss masks)."""
    out = []
    for s, a in zip(samples, per_turn):
        row = [0.0] * len(s.completion_ids)
        for (lo, hi), v in zip(s.meta.get("turn_spans", []), a):
            row[lo:hi] = [v] * (hi - lo)
        out.append(row)
    return out


def step_advantages(samples, rewards: Tensor, group_ids: Tensor, own, kind: str, eps: float,
                    credit: str = "trajectory", gamma: float = 1.0):  # fmt: skip
    """A step's advantages: ``[B]`` float64, or per-token lists under ``credit: turn``.

    ``own``: the objective's own advantage function (OAPL's A*: ``own(rewards, group_ids)``)
    or None for ``advantage.kind``. Aborted members leave every baseline (module docstring)."""
    from megatron_p3o.advantage.estimators import group_advantages

    if any(s.meta.get("segment", 0) for s in samples):  # an agent's later segments
        return _segments_follow(samples, rewards, group_ids, own, kind, eps, credit, gamma)
    valid = torch.tensor([s.meta.get("status") != "aborted" for s in samples], dtype=torch.bool)
    if credit == "turn":
        per_turn = [
            list(s.meta.get("turn_rewards", []))
            + [0.0] * (len(s.meta.get("turn_spans", [])) - len(s.meta.get("turn_rewards", [])))
            for s in samples
        ]
        adv = turn_advantages(per_turn, group_ids.tolist(), valid.tolist(), gamma,
                              "grpo" if kind == "grpo" else "none", eps)  # fmt: skip
        return token_advantages(samples, adv)
    fn = own if own is not None else (lambda r, g: group_advantages(r, g, kind, eps))
    if bool(valid.all()):
        return fn(rewards, group_ids)
    return among_members(fn, rewards, group_ids, valid)


def _segments_follow(samples, rewards, group_ids, own, kind, eps, credit, gamma) -> Tensor:
    """The segment rule (``megatron_p3o.rollout.agents.session``): a trajectory split into
    segments counts once in its group's baseline (its first segment), and every segment gets
    that first segment's advantage."""
    if credit == "turn":
        raise ValueError("credit: turn does not take segmented (agent) trajectories")
    lead = [i for i, s in enumerate(samples) if not s.meta.get("segment", 0)]
    first = step_advantages([samples[i] for i in lead], rewards[lead], group_ids[lead], own,
                            kind, eps)  # fmt: skip
    at = {(int(group_ids[i]), samples[i].meta.get("trajectory")): k for k, i in enumerate(lead)}
    out = torch.zeros(len(samples), dtype=first.dtype)
    for i, s in enumerate(samples):
        out[i] = first[at[(int(group_ids[i]), s.meta.get("trajectory"))]]
    return out
