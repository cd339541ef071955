"""The loss stage's configuration (``loss:`` in a recipe)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Literal, Optional

from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.runtime.fields import check_ranges


@dataclass(frozen=True)
class LossConfig:
    """Attributes:
    objective: one of ``megatron_p3o.loss.OBJECTIVES`` (p3o by default).
    hyper: the objective's hyper-parameters (checked against its dataclass).
    ess_scope: "step" (exact, one extra no-grad forward) or "microbatch" (FeynRL).
    nonfinite: "error" (default) or "mask" (drop and count) for NaN/inf log-probs.
    logprob_chunk: tokens per block in the log-prob kernel (None = automatic).
    log_entropy: compute the policy entropy for metrics (one more reduction).
    prepass_fuse: micro-batches concatenated into one no-grad forward of the ESS pre-pass
        (fewer, larger forwards; costs k micro-batches' logits at once, no activations).
    old_logprobs: for the objectives that clip a ratio to πold (PPO, GRPO, DAPO, GSPO, CISPO):
        "recompute" ℓold with the weights before the rollout batch's first update (standard
        semantics) or use the engine's ℓb ("behaviour", the bypass).
    """

    objective: str = "p3o"
    hyper: Dict[str, Any] = field(default_factory=dict)
    ess_scope: Literal["step", "microbatch"] = "step"
    nonfinite: Literal["error", "mask"] = "error"
    logprob_chunk: Optional[int] = None
    log_entropy: bool = True
    prepass_fuse: int = 4
    old_logprobs: Literal["recompute", "behaviour"] = "recompute"

    RANGES: ClassVar[Dict[str, str]] = {"prepass_fuse": ">= 1", "logprob_chunk": ">= 1"}

    def __post_init__(self):
        """Ranges, and the objective's name and hyper-parameters (its dataclass checks them)."""
        from megatron_p3o.loss.registry import build_objective

        check_ranges(self, self.RANGES, "loss")
        try:
            build_objective(self.objective, **self.hyper)
        except ValueError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith("loss.") else f"loss: {msg}") from None
