"""Context-parallel core attention for the local (non-TE) layer spec.

Why: Megatron-Core's local ``DotProductAttention`` refuses context parallelism ("only supported by
TEDotProductAttention"), and Transformer Engine needs a GPU. To test CP on CPU machines this module
all-gathers K and V over the CP group and applies a causal mask built from *global* token
positions, consistent with Megatron's load-balanced chunking (``get_batch_on_this_cp_rank``:
the sequence is cut into 2·cp chunks and CP rank r holds chunks r and 2·cp−1−r). On GPUs TE's
ring attention is used instead; this module is a correctness reference, not a fast path.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward sums every rank's gradient of my slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        # CP group: every rank needs every rank's K/V chunks to attend across the whole sequence.
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        # CP group: queries on every rank attended to my K/V, so my K/V gradient is their sum.
        dist.all_reduce(grad, group=ctx.group)
        n = grad.shape[0] // ctx.group.size()
        r = ctx.group.rank()
        return grad[r * n : (r + 1) * n], None


def cp_chunk_positions(local_len: int, cp_rank: int, cp_size: int) -> Tensor:
    """Global positions ``[local_len]`` of the tokens CP rank ``cp_rank`` holds (chunks r and
    2cp−1−r)."""
    c = local_len // 2
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    return torch.cat([first, second])


class CPAllGatherAttention(MegatronModule):
    """Causal core attention over a context-parallel sequence (drop-in for ``core_attention``).

    Shapes: query ``[s/cp, b, n/tp, d]``, key/value ``[s/cp, b, g/tp, d]`` → ``[s/cp, b, n·d/tp]``.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError(
                "CPAllGatherAttention (CPU context parallelism) needs attention_dropout=0"
            )
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(
                f"CPAllGatherAttention supports causal masks only, got {attn_mask_type}"
            )
        self.cp_group = pg_collection.cp
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.window = getattr(config, "window_size", None)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("CPAllGatherAttention: packed sequences / attention bias")
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        sq, b, nh, d = query.shape
        k = _AllGatherSeq.apply(key, self.cp_group)  # [s, b, g, d], rank-major chunk order
        v = _AllGatherSeq.apply(value, self.cp_group)
        q_pos = cp_chunk_positions(sq, cp_rank, cp_size)
        k_pos = torch.cat([cp_chunk_positions(key.shape[0], r, cp_size) for r in range(cp_size)])
        rep = nh // k.shape[2]
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        qf, kf, vf = (t.permute(1, 2, 0, 3).float() for t in (query, k, v))  # [b, n, s, d]
        scores = torch.matmul(qf, kf.transpose(-1, -2)) * self.softmax_scale  # [b, n, sq, sk]
        masked = k_pos[None, :] > q_pos[:, None]
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, vf).to(query.dtype)  # [b, n, sq, d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, nh * d)
