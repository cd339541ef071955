"""Reward functions (one per module) and the registry that resolves ``reward.kind``."""

from .registry import RewardError, build_reward, score_samples

__all__ = ["RewardError", "build_reward", "score_samples"]
