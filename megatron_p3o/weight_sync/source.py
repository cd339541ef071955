"""The trainer's live weights, as the rollout backends ask for them.

Why: an embedded engine on every rank needs the full HF-named tensors on every rank; a central
server needs them streamed to global rank 0 only. Both are collectives over the model-parallel
groups, so every rank calls the same method at the same point.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_p3o.model.description import ModelDescription
from megatron_p3o.runtime.collectives import all_gather_objects
from megatron_p3o.runtime.parallel import ParallelGroups
from megatron_p3o.weight_sync.export import is_expert, iter_hf_tensors

NamedTensors = List[Tuple[str, torch.Tensor]]


class TrainerWeights:
    """HF-named views of the model chunks of this rank's pipeline stage."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        groups: ParallelGroups,
        desc: ModelDescription,
        extra: Optional[Callable[[], "NamedTensors"]] = None,
    ):
        """``extra``: more HF-named tensors of this stage (R2PO's rollout head)."""
        self.chunks, self.groups, self.desc, self.extra = chunks, groups, desc, extra

    def full(self) -> NamedTensors:
        """Every HF tensor, full size, on every rank (all ranks call this)."""
        tensors = list(iter_hf_tensors(self.chunks, self.groups, self.desc))
        if self.extra is not None:
            tensors += self.extra()
        if self.groups.layout.pp_enabled:
            parts = all_gather_objects(tensors, self.groups.pp, "each stage exported its own "
                                       "layers; every rank's engine needs them all")  # fmt: skip
            tensors = [t for p in parts for t in p]
        if self.groups.layout.ep_enabled:
            mine = [(n, t) for n, t in tensors if is_expert(n)]
            parts = all_gather_objects(
                mine,
                self.groups.ep,
                "each EP rank holds num_experts / ep "
                "of every MoE layer's experts; every engine needs all",
            )
            tensors = [(n, t) for n, t in tensors if not is_expert(n)]
            tensors += [t for p in parts for t in p]
        return tensors

    def to_rank0(self, bucket_bytes: Optional[int] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """Every HF tensor, streamed stage by stage to global rank 0 (all ranks iterate); later
        stages send ``bucket_bytes`` at a time, when rank 0 asks for them."""
        from megatron_p3o.weight_sync.stream import STREAM_BUCKET_BYTES, iter_hf_tensors_to_rank0

        return iter_hf_tensors_to_rank0(
            self.chunks, self.groups, self.desc, bucket_bytes or STREAM_BUCKET_BYTES
        )
