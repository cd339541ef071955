"""Metrics of multi-turn, tool-using trajectories (``megatron_p3o.rollout.turns``): the policy's
tokens and the environment's counted apart, turns, tool calls and how trajectories ended.

Why apart: a trajectory's length mixes what the policy sampled with what the environment wrote;
only the former is trained, so throughput, lengths and the loss's token counts are the policy's,
and the environment's share is its own number.
"""

from __future__ import annotations

from typing import Dict, Sequence

STATUSES = ("completed", "truncated", "tool_error", "aborted")
# per-sequence means, averaged over DP ranks like the trainer's other rollout means
TURN_MEANS = (
    "mt_policy_tokens",
    "mt_env_tokens",
    "mt_turns",
    "mt_tool_calls",
    "mt_tool_errors",
    "mt_observation_cut",
    *(f"mt_{s}" for s in STATUSES),
)


def turn_metrics(samples: Sequence) -> Dict[str, float]:
    """Per-sequence means over ``samples`` (``{}`` when none is a multi-turn trajectory)."""
    turns = [s for s in samples if s.policy_mask is not None]
    if not turns:
        return {}
    n = len(turns)

    def mean(f) -> float:
        return sum(f(s) for s in turns) / n

    out = {
        "mt_policy_tokens": mean(lambda s: s.policy_tokens),
        "mt_env_tokens": mean(lambda s: len(s.completion_ids) - s.policy_tokens),
        "mt_turns": mean(lambda s: s.meta.get("turns", 0)),
        "mt_tool_calls": mean(lambda s: s.meta.get("tool_calls", 0)),
        "mt_tool_errors": mean(lambda s: s.meta.get("tool_errors", 0)),
        "mt_observation_cut": mean(lambda s: float(bool(s.meta.get("observation_cut")))),
    }
    for st in STATUSES:
        out[f"mt_{st}"] = mean(lambda s, st=st: float(s.meta.get("status") == st))
    return out
