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

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .checkpoint import load_model_state
from .model.builder import BuildOptions, build_model
from .model.description import ModelDescription
from .model.forward import MicroBatch, forward_backward
from .parallel import ParallelGroups
from .policy_update import response_logprobs

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

    def __post_init__(self):
        if self.reset_every < 0:
            raise ValueError(f"reference.reset_every={self.reset_every} must be >= 0")


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


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
        self.seconds = 0.0  # forward time of the current optimizer step (metrics)

    def param_bytes(self) -> int:
        """Bytes of this rank's reference parameters (the memory the reference costs)."""
        return sum(p.numel() * p.element_size() for c in self.chunks for p in c.parameters())

    @torch.no_grad()
    def score(self, microbatches: List[MicroBatch], with_value: bool = False) -> None:
        """ℓref (and V_ref(s₁)) of every micro-batch, written into its ``response`` dict on the
        last pipeline stage (all ranks call this: the forward runs the layout's collectives)."""
        t0 = time.perf_counter()
        out: List[tuple] = []

        def loss_fn(batch, logits):
            lp, _, value = response_logprobs(
                batch, logits, self.groups, self.temperature, self.vocab_size, self.chunk,
                with_value=with_value,
            )  # fmt: skip
            out.append((lp.float() * batch["response"]["mask"].float(), value))
            return torch.zeros((), device=logits.device), 0, {}

        forward_backward(self.chunks, self.groups, microbatches, loss_fn, forward_only=True)
        if self.groups.is_last_stage():
            for mb, (lp, value) in zip(microbatches, out):
                dev = mb["response"]["mask"].device
                mb["response"]["ref_logprobs"] = lp.to(dev)
                if value is not None:
                    mb["response"]["ref_values"] = value.float().to(dev)
        self.seconds += time.perf_counter() - t0

    @torch.no_grad()
    def reset_from(self, policy_chunks, step: int) -> None:
        """Copy the policy's current weights into the reference (same layout: local copies)."""
        for ref, pol in zip(self.chunks, policy_chunks):
            mine = dict(_unwrap(ref).named_parameters())
            for name, p in _unwrap(pol).named_parameters():
                mine[name].copy_(p)
        self.reset_step = step

    def due(self, step: int, every: int) -> bool:
        return bool(every) and step % every == 0

    # -- checkpoints ---------------------------------------------------------------------------
    def sharded_state(self) -> Dict[str, dict]:
        """The reference's weights for the training checkpoint (only once it has been reset:
        before that they are ``model.checkpoint``'s)."""
        if not self.reset_step:
            return {}
        return {
            f"reference{i}": _unwrap(c).sharded_state_dict(prefix=PREFIX)
            for i, c in enumerate(self.chunks)
        }

    def load(self, ckpt: Path, reset_step: int) -> None:
        """Restore a reset reference from a training checkpoint (at any layout)."""
        from .checkpoint import load_into, load_sharded

        self.reset_step = int(reset_step)
        if not self.reset_step:
            return
        request = {
            f"reference{i}": _unwrap(c).sharded_state_dict(prefix=PREFIX)
            for i, c in enumerate(self.chunks)
        }
        loaded = load_sharded(request, ckpt)
        for i, c in enumerate(self.chunks):
            state = {k[len(PREFIX) :]: v for k, v in loaded[f"reference{i}"].items()}
            load_into(c, state, ckpt)
