"""Reward functions (one per module) and the registry that resolves ``reward.kind``."""

from megatron_p3o.reward.registry import (
    RewardError,
    build_reward,
    decode_completions,
    score_samples,
)

__all__ = ["RewardError", "build_reward", "decode_completions", "score_samples"]
