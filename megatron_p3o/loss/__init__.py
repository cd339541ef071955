"""Log-probs, the global ESS and the policy objectives (one module each)."""

from .ess import EmptyStepError, NonFiniteLogprobError
from .logprob import vocab_parallel_logprobs
from .registry import OBJECTIVES, Objective, build_objective, policy_loss

__all__ = [
    "vocab_parallel_logprobs",
    "policy_loss",
    "build_objective",
    "Objective",
    "OBJECTIVES",
    "NonFiniteLogprobError",
    "EmptyStepError",
]
