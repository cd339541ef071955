"""Log-probs, the global ESS and the policy objectives (one module each)."""

from .logprob import vocab_parallel_logprobs

__all__ = ["vocab_parallel_logprobs"]
