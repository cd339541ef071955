"""Which tokens of a micro-batch each context-parallel rank holds, for padded and packed (THD)
micro-batches, and the way back: the loss sees whole sequences again.

Padded micro-batch: ``tokens [b, s]``; every row is cut into 2·cp chunks of s/(2cp) tokens and CP
rank r holds chunks r and 2cp−1−r (Megatron's ``get_batch_on_this_cp_rank`` split).

Packed micro-batch: ``tokens [1, T]`` holds n sequences back to back; ``cu_seqlens [n+1]`` (int32)
marks where each starts. Each sequence's length is padded to a multiple of 2·cp and *each
sequence* is cut into 2·cp chunks, rank r holding chunks r and 2cp−1−r of every sequence, in
sequence order: the split Transformer Engine's THD context parallelism and Megatron's THD RoPE
(``_get_thd_freqs_on_this_cp_rank``) expect. Causal attention then costs every rank the same.

``token_index(...)`` gives, per CP rank, the positions it holds in the flattened full grid
(``[b·s]`` or ``[T]``); slicing the model inputs and gathering per-token results back both use it.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_p3o.runtime.collectives import all_gather_into


def cp_chunk_positions(local_len: int, cp_rank: int, cp_size: int) -> Tensor:
    """Positions ``[local_len]`` within one sequence that CP rank ``cp_rank`` holds (chunks r and
    2cp−1−r, each ``local_len / 2`` long)."""
    c = local_len // 2
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)  # host
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)  # host
    return torch.cat([first, second])


def token_index(shape, cu_seqlens: Optional[Tensor], cp_rank: int, cp_size: int) -> Tensor:
    """Flattened positions ``[numel / cp]`` (host, int64) of the tokens CP rank ``cp_rank`` holds.

    Args:
        shape: the full ``tokens`` shape, ``(b, s)`` padded or ``(1, T)`` packed.
        cu_seqlens: ``[n+1]`` sequence starts of a packed micro-batch (None = padded rows).
    """
    b, s = shape
    if cp_size == 1:
        return torch.arange(b * s)  # host
    if cu_seqlens is None:
        pos = cp_chunk_positions(s // cp_size, cp_rank, cp_size)
        return (torch.arange(b)[:, None] * s + pos[None]).reshape(-1)  # host
    starts = cu_seqlens.tolist()
    parts = [
        start + cp_chunk_positions((end - start) // cp_size, cp_rank, cp_size)
        for start, end in zip(starts[:-1], starts[1:])
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)  # host


def all_token_indices(shape, cu_seqlens: Optional[Tensor], cp_size: int) -> Tensor:
    """``[cp, numel / cp]``: :func:`token_index` of every CP rank, stacked."""
    return torch.stack([token_index(shape, cu_seqlens, r, cp_size) for r in range(cp_size)])


def check_packed(cu_seqlens: Tensor, total: int, cp_size: int) -> None:
    """A packed layout CP can split: sequence lengths are multiples of 2·cp and cover ``total``
    (``cu_seqlens``: the host micro-batch's, read once)."""
    starts = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    if starts[-1] != total or starts[0] != 0:
        raise ValueError(f"cu_seqlens {starts} do not cover {total} tokens")
    if cp_size > 1 and any(n % (2 * cp_size) for n in lens):
        raise ValueError(
            f"packed sequence lengths {lens} must be multiples of 2×cp = {2 * cp_size}"
        )


def packed_seq_params(cu_seqlens: Tensor, device: torch.device):
    """Megatron's ``PackedSeqParams`` (THD) for one packed micro-batch.

    Each sequence's padding sits at its end and is scored by nobody, so the padded lengths serve
    as the real ones too (a padding token attends only to its own sequence's earlier tokens).
    ``cu_seqlens``: the host micro-batch's (the longest length is read from it, not from the
    device copy).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    starts = cu_seqlens.tolist()
    longest = max(b - a for a, b in zip(starts[:-1], starts[1:]))
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def slice_tokens(batch: Dict, index: Tensor) -> Dict:
    """This CP rank's tokens of every top-level tensor shaped like ``tokens`` (or ``[b, s,
    …]``, e.g. recorded MoE routes; ``index`` from :func:`token_index`, on the tensors'
    device); everything else passes through."""
    shape = batch["tokens"].shape
    b = shape[0]
    out = dict(batch)
    for k, v in batch.items():
        if torch.is_tensor(v) and v.shape[:2] == shape and v.dim() >= 2:
            rest = tuple(v.shape[2:])
            flat = v.reshape((-1,) + rest).index_select(0, index)
            out[k] = flat.reshape((b, -1) + rest)
    return out


class _GatherTokens(torch.autograd.Function):
    """All-gather one value per token over CP; the backward keeps this rank's slice.

    Contract: whatever consumes the gathered values is computed identically on every CP rank
    (same micro-batch, same loss), so ∂L/∂(full) is the same everywhere and each rank's share of
    the gradient is simply its own slice: no collective in the backward, and the DP×CP gradient
    sum then adds each token's contribution exactly once.
    """

    @staticmethod
    def forward(ctx, local: Tensor, all_index: Tensor, numel: int, group) -> Tensor:
        ctx.save_for_backward(all_index[dist.get_rank(group)])
        parts = [torch.empty_like(local) for _ in range(group.size())]
        all_gather_into(parts, local.contiguous(), group, "the loss needs every token of each "
                        "sequence; each CP rank scored its own chunks")  # fmt: skip
        full = local.new_zeros(numel)
        full.index_copy_(0, all_index.reshape(-1), torch.cat(parts))
        return full

    @staticmethod
    def backward(ctx, grad: Tensor):
        (mine,) = ctx.saved_tensors
        return grad.index_select(0, mine), None, None, None


def gather_tokens(local: Tensor, all_index: Optional[Tensor], numel: int, group) -> Tensor:
    """Per-token values of this CP rank (``[b, s/cp]`` or ``[1, T/cp]``) → the flattened full
    grid ``[numel]``, in sequence order. Without CP: a flatten."""
    if group is None or group.size() == 1:
        return local.reshape(-1)
    return _GatherTokens.apply(local.reshape(-1), all_index, numel, group)


def gather_response(values: Tensor, index: Tensor, mask: Tensor) -> Tensor:
    """``[n, L]`` values at each response token's scoring position (``index`` into the flattened
    grid), zero where ``mask`` is 0 (whatever sits at the padding positions)."""
    out = values.index_select(0, index.reshape(-1)).reshape(index.shape)
    return torch.where(mask > 0, out, torch.zeros_like(out))
