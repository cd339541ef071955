"""Metrics of multi-turn, tool-using trajectories (``megatron_p3o.rollout.turns``): the policy's
tokens and the environment's counted apart, turns, tool calls and how trajectories ended.

Why apart: a trajectory's length mixes what the policy sampled with what the environment wrote;
only the former is trained, so throughput, lengths and the loss's token counts are the policy's,
and the environment's share is its own number.

Names say what they count: ``mt_turns``, ``mt_tool_calls``, ``mt_tool_errors`` are means *per
trajectory* (a tool error is a step that raised, died or timed out); ``mt_ended_<status>`` is
the *share* of trajectories that ended that way (``mt_ended_tool_error``: ended by a tool that
ran past its timeout or died). ``mt_env_s`` / ``mt_engine_s``: a trajectory's mean wall
seconds in its environment and waiting for its engine turns. ``mt_policy_lengths`` /
``mt_lengths``: every trajectory's policy tokens / all its tokens, as TensorBoard histograms
(not in metrics.jsonl).
"""

from __future__ import annotations

from typing import Dict, Sequence

from megatron_p3o.rollout.trajectory import STATUSES

# per-sequence means, averaged over DP ranks like the trainer's other rollout means
TURN_MEANS = (
    "mt_policy_tokens",
    "mt_env_tokens",
    "mt_turns",
    "mt_tool_calls",
    "mt_tool_errors",
    "mt_observation_cut",
    "mt_env_s",
    "mt_engine_s",
    *(f"mt_ended_{s}" for s in STATUSES),
)
HISTOGRAMS = ("mt_policy_lengths", "mt_lengths")  # lists: TensorBoard histograms only


def turn_metrics(samples: Sequence) -> Dict[str, float]:
    """Per-sequence means over ``samples`` and the length lists (``{}`` when none is a
    multi-turn trajectory)."""
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
        "mt_env_s": mean(lambda s: s.meta.get("env_s", 0.0)),
        "mt_engine_s": mean(lambda s: s.meta.get("engine_s", 0.0)),
    }
    for st in STATUSES:
        out[f"mt_ended_{st}"] = mean(lambda s, st=st: float(s.meta.get("status") == st))
    out["mt_policy_lengths"] = [s.policy_tokens for s in turns]
    out["mt_lengths"] = [len(s.completion_ids) for s in turns]
    return out


def turn_line(m: Dict) -> str:
    """The step line's multi-turn part: per trajectory turns, tool calls, tool errors, and the
    share that ended by a tool failure or was aborted ("" for single-turn steps)."""
    if "mt_turns" not in m:
        return ""
    return (f"  turns {m['mt_turns']:.1f} tools {m['mt_tool_calls']:.1f} "
            f"tool errors {m['mt_tool_errors']:.2f}/traj (ended by one "
            f"{m['mt_ended_tool_error']:.0%}, aborted {m['mt_ended_aborted']:.0%})")  # fmt: skip
