"""REINFORCE: ``loss_t = −sg(A_t) · ℓθ_t``, token-mean (the on-policy limit of P3O)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_p3o.loss.terms import LossInputs, StepStats


@dataclass(frozen=True)
class ReinforceConfig:
    """No hyper-parameters."""


def reinforce_terms(inp: LossInputs, stats: StepStats, h: ReinforceConfig):
    return (-(inp.advantages.detach() * inp.logprobs) * inp.mask).sum(), {}
