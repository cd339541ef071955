"""One multi-turn trajectory while it is rolled out, and the :class:`~megatron_p3o.types.Sample`
it becomes.

Append-only: the model's tokens as the engine sampled them (policy mask 1, the engine's
log-probs and weight versions), then the template's pieces and the observation (mask 0,
log-prob 0, version −1). What a turn may add is bounded here: the turn's token budget is what
is left of ``max_total_tokens`` and of the engine's context, and an observation is cut to fit
(keeping room for one model token).

Statuses (``Sample.meta["status"]``): ``completed`` (the environment ended it), ``truncated``
(``max_turns``, the token budget, the context, or ``max_trajectory_staleness``; trained like a
completion cut by ``max_new_tokens``: ``batch.mask_truncated`` drops it), ``tool_error`` (a
step ran past its timeout: its worker was killed and the episode ended with an error
observation; its turns are trained, reward as the environment gave), ``aborted`` (the
environment's reset failed, or the engine aborted the request: never trained, mask 0, reward 0,
and not a member of its group's baseline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from megatron_p3o.types import Sample

ENV_VERSION = -1  # the weight version of a token the environment wrote


def turn_seed(batch_seed: Optional[int], k: int, turn: int) -> Optional[int]:
    """The seed of trajectory ``k``'s turn ``turn`` (None: unseeded): no trajectory's draws
    depend on when the others finish."""
    if batch_seed is None:
        return None
    return ((batch_seed * 1_000_003 + k) * 1009 + turn) % 2**62


STATUSES = ("completed", "truncated", "tool_error", "aborted")


@dataclass
class Trajectory:
    """``index``: the trajectory's place in the rollout (its random stream and its row);
    ``group``: its prompt's index."""

    index: int
    group: int
    prompt: List[int]
    ids: List[int] = field(default_factory=list)  # after the prompt
    mask: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    inputs: List[int] = field(default_factory=list)  # each turn's input length (invariant)
    spans: List[Tuple[int, int]] = field(default_factory=list)  # each turn's policy tokens
    turn_rewards: List[float] = field(default_factory=list)  # the step after each turn
    routes: object = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    cut: bool = False
    stale: bool = False
    env_s: float = 0.0  # wall seconds in its environment's reset and steps
    engine_s: float = 0.0  # wall seconds waiting for its engine turns
    status: Optional[str] = None
    error: Optional[str] = None  # why it was aborted (one line)
    last_finish: str = "stop"  # how the latest model turn ended

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    def append(self, ids, policy: bool, logprobs=None, versions=None) -> None:
        ids = list(ids)
        self.ids += ids
        self.mask += [1 if policy else 0] * len(ids)
        self.logprobs += list(logprobs) if policy else [0.0] * len(ids)
        self.versions += list(versions) if policy else [ENV_VERSION] * len(ids)

    def oldest_version(self) -> Optional[int]:
        pol = [v for v, m in zip(self.versions, self.mask) if m]
        return min(pol) if pol else None

    def turn_budget(self, max_new: int, max_total: int, context: Optional[int]) -> int:
        """New tokens the next turn may ask for: the sampling limit, what is left of
        ``max_total_tokens``, and what is left of the engine's context."""
        room = min(max_new, max_total - len(self.ids))
        if context is not None:
            room = min(room, context - len(self.prompt) - len(self.ids))
        return room

    def take_turn(self, s: Sample, budget_left: bool) -> bool:
        """Append the engine's tokens; whether the environment steps (False: it ended).
        ``budget_left``: tokens remain after this turn (else it ends ``truncated``)."""
        self.turns += 1
        start = len(self.ids)
        self.append(s.completion_ids, True, s.logprobs, s.versions())
        self.spans.append((start, len(self.ids)))
        self.last_finish = s.finish_reason
        if s.routed_experts is not None:  # [input + output − 1, layers, k] of this call
            self.routes = s.routed_experts[: len(self.prompt) + len(self.ids) - 1]
        if s.finish_reason == "abort":
            self.status, self.error = "aborted", "the engine aborted the request"
        elif s.finish_reason == "length" and not budget_left:
            self.status = "truncated"  # the budget ended the turn
        return self.status is None

    def sample(self) -> Sample:
        policy = [v for v, m in zip(self.versions, self.mask) if m]
        aborted = self.status == "aborted"
        return Sample(
            prompt_ids=self.prompt,
            completion_ids=self.ids,
            logprobs=self.logprobs,
            finish_reason={"completed": "stop", "aborted": "abort"}.get(self.status, "length"),
            weight_version=min(policy) if policy else 0,
            group_id=self.group,
            reward=0.0 if aborted else self.reward,
            meta={
                "status": self.status,
                "turns": self.turns,
                "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors,
                "observation_cut": self.cut,
                "stale": self.stale,
                "env_s": self.env_s,
                "engine_s": self.engine_s,
                "turn_inputs": self.inputs,
                "turn_spans": [list(x) for x in self.spans],
                "turn_rewards": [0.0] * len(self.turn_rewards) if aborted else self.turn_rewards,
                **({"error": self.error} if self.error else {}),
            },
            routed_experts=self.routes,  # the batch's grid holds −1 past them
            token_versions=self.versions,
            policy_mask=[0] * len(self.mask) if aborted else self.mask,
        )
