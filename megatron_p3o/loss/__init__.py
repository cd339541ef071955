"""Log-probs, the global ESS and the policy objectives (one module each)."""

from megatron_p3o.logprob.kernels import vocab_parallel_logprobs
from megatron_p3o.loss.ess import EmptyStepError, NonFiniteLogprobError
from megatron_p3o.loss.registry import OBJECTIVES, Objective, build_objective, policy_loss

__all__ = [
    "vocab_parallel_logprobs",
    "policy_loss",
    "build_objective",
    "Objective",
    "OBJECTIVES",
    "NonFiniteLogprobError",
    "EmptyStepError",
]
