"""The structures that cross stage boundaries: sampling parameters, samples, prompt groups.

Why: one ``Sample`` is the contract between the rollout engines (SGLang, embedded) and the
trainer; nothing else passes between those stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional, Tuple

from megatron_p3o.runtime.errors import UserError

if TYPE_CHECKING:
    import torch


class SamplingError(UserError, ValueError):
    """Sampling parameters that cannot be honoured; the message names the parameter."""


@dataclass(frozen=True)
class SamplingParams:
    """How the engine samples. The behaviour log-probs are those of *this* distribution.

    Attributes:
        temperature: softmax temperature T > 0 (the trainer must use the same T).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        max_new_tokens: completion length limit (≥ 1).
        stop_token_ids: tokens that end a completion (kept in it).
        seed: sampling seed (None: nondeterministic).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: Tuple[int, ...] = ()
    seed: Optional[int] = None

    def __post_init__(self):
        if not self.temperature > 0:
            raise SamplingError(f"sampling.temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise SamplingError(f"sampling.top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.max_new_tokens < 1:
            raise SamplingError(f"sampling.max_new_tokens={self.max_new_tokens} must be >= 1")

    @property
    def truncated(self) -> bool:
        """True when top-p or top-k changes the distribution sampled from."""
        return self.top_p < 1.0 or self.top_k > 0


@dataclass
class Sample:
    """One completion of one prompt.

    Attributes:
        prompt_ids: prompt token ids.
        completion_ids: generated token ids.
        logprobs: behaviour log-prob of each completion token under the distribution sampled
            from (temperature, and top-p/top-k truncation if enabled), in the engine's precision.
        finish_reason: "stop" (a stop token) or "length" (max_new_tokens).
        weight_version: the engine's weight version of the sample's first completion token
            (the oldest policy that produced any of it).
        group_id: index of the prompt in the request (the G completions of a prompt share it).
        reward: filled by the reward stage.
        meta: free-form (answer, data index...).
        routed_experts: MoE only: ``[P + C − 1, layers, k]`` (uint8/int16 tensor) the experts
            the engine's routers chose for every token it fed through the model (all but the
            last), for routing replay; None otherwise.
        token_versions: the weight version of each completion token when they differ (SGLang
            retracts in-flight requests at a weight push and resumes them under the new
            weights); None when every token has ``weight_version``. ``logprobs`` are per token
            under whichever weights sampled that token, so per-token ratios stay exact. A token
            the environment wrote has version −1.
        policy_mask: multi-turn trajectories (``megatron_p3o.rollout.turns``): 1 for each
            completion token the policy sampled, 0 for the tokens the environment and the chat
            template wrote (their ``logprobs`` are 0 and mean nothing); None: all the policy's.
            No ratio, ESS, KL, entropy or normaliser sees a 0 position.
    """

    prompt_ids: List[int]
    completion_ids: List[int]
    logprobs: List[float]
    finish_reason: str
    weight_version: int
    group_id: int = 0
    reward: Optional[float] = None
    meta: dict = field(default_factory=dict)
    routed_experts: Optional["torch.Tensor"] = None
    token_versions: Optional[List[int]] = None
    policy_mask: Optional[List[int]] = None

    def __post_init__(self):
        if len(self.completion_ids) != len(self.logprobs):
            raise ValueError(
                f"sample of group {self.group_id}: {len(self.completion_ids)} tokens but "
                f"{len(self.logprobs)} log-probs"
            )
        if self.token_versions is not None and len(self.token_versions) != len(self.logprobs):
            raise ValueError(
                f"sample of group {self.group_id}: {len(self.completion_ids)} tokens but "
                f"{len(self.token_versions)} token weight versions"
            )
        if self.policy_mask is not None and len(self.policy_mask) != len(self.completion_ids):
            raise ValueError(
                f"sample of group {self.group_id}: {len(self.completion_ids)} tokens but "
                f"{len(self.policy_mask)} policy-mask entries"
            )

    def versions(self) -> List[int]:
        """The weight version of every completion token (−1: the environment's)."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.weight_version] * len(self.completion_ids)

    def policy_versions(self) -> List[int]:
        """The weight versions of the tokens the policy sampled (staleness acts on these)."""
        v = self.versions()
        if self.policy_mask is None:
            return v
        return [x for x, m in zip(v, self.policy_mask) if m]

    @property
    def policy_tokens(self) -> int:
        """How many completion tokens the policy sampled."""
        if self.policy_mask is None:
            return len(self.completion_ids)
        return int(sum(self.policy_mask))

    def mask(self) -> List[int]:
        """1 per completion token the policy sampled, 0 per token the environment wrote."""
        if self.policy_mask is None:
            return [1] * len(self.completion_ids)
        return list(self.policy_mask)


@dataclass
class Group:
    """The scored completions of one prompt: the unit of advantages, filtering and replay.

    Attributes:
        index: the prompt's row in the data file.
        prompt_ids: prompt token ids.
        answer: the reference answer the reward checks against.
        samples: its completions, each with ``reward`` filled in.
        source: "fresh" (new prompt), "reeval" (a difficult prompt rolled out again) or
            "replay" (stored completions reused off-policy).
        uses: optimizer steps this group's completions have been trained on so far.
    """

    index: int
    prompt_ids: List[int]
    answer: str
    samples: List[Sample]
    source: str = "fresh"
    uses: int = 0

    @property
    def rewards(self) -> List[float]:
        return [float(s.reward) for s in self.samples]

    @property
    def mean_reward(self) -> float:
        r = self.rewards
        return sum(r) / len(r)

    @property
    def homogeneous(self) -> bool:
        """All completions scored the same: zero group-relative advantage, no learning signal."""
        r = self.rewards
        return all(x == r[0] for x in r)

    @property
    def oldest_version(self) -> int:
        return min(s.weight_version for s in self.samples)

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "prompt_ids": self.prompt_ids,
            "answer": self.answer,
            "source": self.source,
            "uses": self.uses,
            "samples": [
                {
                    "completion_ids": s.completion_ids,
                    "logprobs": s.logprobs,
                    "finish_reason": s.finish_reason,
                    "weight_version": s.weight_version,
                    "reward": s.reward,
                    "routed_experts": routes_out(s.routed_experts),
                    "token_versions": s.token_versions,
                    "policy_mask": s.policy_mask,
                    "meta": {k: v for k, v in s.meta.items() if k in TRAJECTORY_META},
                }
                for s in self.samples
            ],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Group":
        samples = [
            Sample(
                prompt_ids=list(d["prompt_ids"]),
                group_id=0,
                **{**s, "routed_experts": routes_in(s.get("routed_experts"))},
            )
            for s in d["samples"]
        ]
        return cls(
            int(d["index"]),
            list(d["prompt_ids"]),
            str(d["answer"]),
            samples,
            d["source"],
            int(d["uses"]),
        )


# a multi-turn trajectory's own facts (megatron_p3o.rollout.turns), kept with it in checkpoints
TRAJECTORY_META = ("status", "turns", "tool_calls", "tool_errors", "observation_cut")


def routes_out(r):
    """Recorded routes in a checkpoint: nested lists (None without MoE)."""
    return None if r is None else {"dtype": str(r.dtype).replace("torch.", ""), "v": r.tolist()}


def routes_in(d):
    import torch

    return None if d is None else torch.tensor(d["v"], dtype=getattr(torch, d["dtype"]))


@dataclass
class TrainBatch:
    """The batch one trainer step learns from, after replay composition: samples in group
    order, each sample's group index in *this* batch (samples are not renumbered: a replayed
    group keeps the ids it was generated with) and rewards.

    Attributes:
        samples: ``N`` samples, group after group.
        group_index: ``[N]`` long, group of each sample within this batch.
        rewards: ``[N]`` float64.
    """

    samples: List[Sample]
    group_index: "torch.Tensor"
    rewards: "torch.Tensor"

    @classmethod
    def from_groups(cls, groups: List["Group"]) -> "TrainBatch":
        import torch

        samples = [s for g in groups for s in g.samples]
        index = [gi for gi, g in enumerate(groups) for _ in g.samples]
        rewards = [float(s.reward) for s in samples]
        return cls(
            samples,
            torch.tensor(index, dtype=torch.long),
            torch.tensor(rewards, dtype=torch.float64),
        )
