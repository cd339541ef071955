"""The frozen reference model: a forward-only copy of the initial policy, sharded like it.

Why: KL-to-reference terms (P3O's ``ref_kl_coef``, GRPO's ``kl_coef``), ReVal's reference
shaping (ℓref and V_ref(s₁)) and R2PO's head-phase k3 all need the reference policy's per-token
log-probs on the trainer's own tokens. The reference is built with the policy's layout (same TP /
PP / CP / VPP chunks, so the same schedule and the same collectives), loaded from
``model.checkpoint``, and never gets gradients or an optimizer: its cost is one set of
parameters (bf16/fp32 as the policy's) and one no-grad forward per optimizer step.

``reference.reset_every: N`` copies the current policy into the reference after every N-th
optimizer step (0 = never). The step of the last reset goes into the training checkpoint, with
the reference's weights when that step is > 0 (before any reset they are ``model.checkpoint``'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Dict, List, Optional

import torch

from megatron_p3o.checkpoint.state import load_model_state, sharded_model_state
from megatron_p3o.logprob.scoring import score_responses
from megatron_p3o.model.builder import BuildOptions, build_model
from megatron_p3o.model.description import ModelDescription
from megatron_p3o.model.forward import MicroBatch
from megatron_p3o.runtime.fields import check_ranges
from megatron_p3o.runtime.parallel import ParallelGroups

PREFIX = "reference."


@dataclass(frozen=True)
class ReferenceConfig:
    """Attributes:
    enabled: build the reference model (None = when the objective needs reference log-probs:
        ReVal, R2PO, P3O's ``ref_kl_coef``, the clip family's ``kl_coef``).
    reset_every: copy the policy into the reference every N optimizer steps (0 = never).
    """

    enabled: Optional[bool] = None
    reset_every: int = 0

    RANGES: ClassVar[Dict[str, str]] = {"reset_every": ">= 0"}

    def __post_init__(self):
        check_ranges(self, self.RANGES, "reference")

    @staticmethod
    def needed(objective, r2po_enabled: bool) -> bool:
        """The run needs ℓref: the objective reads it, or R2PO (its head is anchored to it)."""
        return bool(objective.needs_ref_logprobs or r2po_enabled)

    def wanted(self, objective, r2po_enabled: bool) -> bool:
        """Whether the run builds the reference model (the one rule the trainer, the dry-run's
        memory plan and the config check share): ``enabled`` when set, else when needed."""
        return self.needed(objective, r2po_enabled) if self.enabled is None else self.enabled


class ReferenceModel:
    """Forward-only reference chunks; :meth:`score` fills ``response.ref_logprobs`` (and
    ``response.ref_values``, V_ref(s₁) ``[n]``) of each micro-batch on the last stage."""

    def __init__(
        self,
        desc: ModelDescription,
        groups: ParallelGroups,
        opts: BuildOptions,
        checkpoint: str | Path,
        temperature: float,
        chunk: Optional[int] = None,
    ):
        self.groups, self.temperature, self.chunk = groups, temperature, chunk
        self.vocab_size = desc.vocab_size
        self.chunks = build_model(desc, groups, opts)
        load_model_state(self.chunks, checkpoint)
        for c in self.chunks:
            c.requires_grad_(False)
            c.eval()
        self.reset_step = 0  # optimizer step of the last copy from the policy (0 = initial)

    def score(self, microbatches: List[MicroBatch], with_value: bool = False) -> None:
        """ℓref (and V_ref(s₁)) of every micro-batch, written into its ``response`` dict on the
        last pipeline stage (all ranks call this: the forward runs the layout's collectives)."""
        score_responses(
            self.chunks, self.groups, microbatches, "ref_logprobs", self.temperature,
            self.vocab_size, self.chunk, value_key="ref_values" if with_value else None,
        )  # fmt: skip

    @torch.no_grad()
    def reset_from(self, policy_chunks, step: int) -> None:
        """Copy the policy's current weights into the reference (same layout: local copies)."""
        for ref, pol in zip(self.chunks, policy_chunks):
            pol = getattr(pol, "module", pol)
            mine = dict(ref.named_parameters())
            for name, p in pol.named_parameters():
                mine[name].copy_(p)
        self.reset_step = step

    # -- checkpoints ---------------------------------------------------------------------------
    def sharded_state(self) -> Dict[str, dict]:
        """The reference's weights for the training checkpoint (only once it has been reset:
        before that they are ``model.checkpoint``'s)."""
        return sharded_model_state(self.chunks, PREFIX) if self.reset_step else {}

    def load(self, ckpt: Path, reset_step: int) -> None:
        """Restore a reset reference from a training checkpoint (at any layout)."""
        self.reset_step = int(reset_step)
        if self.reset_step:
            load_model_state(self.chunks, ckpt, PREFIX)
