"""The output layer's side of fused log-probs (``model.fused_logprob``): what the last stage hands
the loss in place of logits, and the tensor-parallel mapping of the output layer's input.

Why here and not beside the kernel (:mod:`megatron_p3o.logprob.fused`): the model's output layer
(:class:`~megatron_p3o.model.forward.FusedOutputLayer`) and R2PO's residual head
(:mod:`.rollout_head`) build these, and logprob/ runs the model (scoring, the reference model);
a folder that imports another is never imported back by it (docs/layout.md), so what the model
needs sits in model/ and the kernel takes it from here.

The mapping is Megatron's ``ColumnParallelLinear`` input mapping: with sequence parallelism the
input ``[s/tp, b, d]`` is all-gathered to ``[s, b, d]`` and dh reduce-scattered back; without it
the forward is the identity and dh (each TP rank's partial sum over its vocabulary shard) is
all-reduced over TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_p3o.runtime.collectives import all_gather_flat, all_sum, reduce_scatter_flat


@dataclass
class OutputLayerInput:
    """What the last stage hands the loss instead of logits on the fused path.

    Attributes:
        hidden: ``[b, s, d]`` the output layer's input, already mapped for TP
            (:func:`output_layer_input`: gathered over sequence parallelism, its gradient summed
            over TP).
        weight: ``[V/tp, d]`` the output layer's vocabulary shard (the embedding weight when the
            embeddings are tied).
        extra: ``((r [b, s, d_i], W_i [V/tp, d_i]), …)`` terms added to the logits (R2PO's
            residual head, z^μ = h·Wᵀ + ReLU(h·W₁ᵀ)·W₂ᵀ), each ``r`` mapped for TP like ``hidden``.
    """

    hidden: Tensor
    weight: Tensor
    extra: Tuple[Tuple[Tensor, Tensor], ...] = ()

    @property
    def device(self) -> torch.device:
        return self.hidden.device


# -- the input mapping of a column-parallel output layer ---------------------------------------
class SumGradOverTP(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.contiguous()
        all_sum(g, ctx.group, "dh: each TP rank's is the partial sum over its vocabulary shard")
        return g, None


class _GatherSequenceParallel(torch.autograd.Function):
    """``[s/tp, …]`` → ``[s, …]`` (all-gather along dim 0); the backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        tp = dist.get_world_size(group)
        out = x.new_empty((tp * x.shape[0],) + tuple(x.shape[1:]))
        all_gather_flat(out, x.contiguous(), group, "the output layer needs every token's hidden "
                        "state (sequence parallelism left each TP rank a slice)")  # fmt: skip
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        tp = dist.get_world_size(ctx.group)
        out = g.new_empty((g.shape[0] // tp,) + tuple(g.shape[1:]))
        reduce_scatter_flat(out, g.contiguous(), ctx.group, "dh summed over the vocabulary "
                            "shards, to the TP rank holding each token's slice")  # fmt: skip
        return out, None


def output_layer_input(hidden: Tensor, tp_group=None, sequence_parallel: bool = False) -> Tensor:
    """What a column-parallel output layer does to its input before the matmul: with sequence
    parallelism ``[s/tp, b, d]`` → ``[s, b, d]`` (all-gather; dh reduce-scattered in backward),
    without it the identity with dh all-reduced over TP. No-op at TP = 1."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return hidden
    if sequence_parallel:
        return _GatherSequenceParallel.apply(hidden, tp_group)
    return SumGradOverTP.apply(hidden, tp_group)
