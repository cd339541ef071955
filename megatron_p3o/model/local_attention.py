"""Causal core attention for the local (non-TE) layer spec: padded or packed (THD) sequences,
with or without context parallelism.

Why: Megatron-Core's local ``DotProductAttention`` refuses context parallelism ("only supported by
TEDotProductAttention") and packed sequences, and Transformer Engine needs a GPU. On machines
without one this module is the attention of every local-spec model, so CP and packing are tested
on CPU with the same Megatron model code. On GPUs TE's attention (THD, ring CP) is used instead.

- Padded ``[s, b, n, d]``: causal attention per row (``scaled_dot_product_attention``).
- Packed ``[t, n, d]`` with ``PackedSeqParams`` (``cu_seqlens``): causal attention *within*
  each sequence, so no token attends across a sequence boundary. Without CP, consecutive
  sequences are grouped into windows of at most ``PACK_WINDOW`` tokens (or one sequence, if
  longer) and each window is one SDPA call with a block-diagonal causal mask: a micro-batch of
  40 short sequences is one call, not 40 (the per-call overhead dominated CPU steps), and the
  cost stays bounded by window², not T². A masked key gets weight exactly 0, so the other
  sequences of a window cannot change a sequence's output.
- Context parallelism (both layouts): K and V are all-gathered over the CP group and the causal
  mask is built from each token's position within its sequence, for the 2·cp chunk split of
  :mod:`megatron_p3o.model.packed` (rank r holds chunks r and 2cp−1−r of every sequence/row).
  This is a correctness reference for CP, not a fast path.
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from megatron_p3o.model.packed import cp_chunk_positions
from megatron_p3o.runtime.collectives import all_gather_into, all_sum

PACK_WINDOW = 128  # tokens per block-diagonal SDPA call of the packed path (see module docstring)


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward sums every rank's gradient of my slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        all_gather_into(parts, x.contiguous(), group, "every CP rank needs every rank's K/V "
                        "chunks to attend across the whole sequence")  # fmt: skip
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        all_sum(grad, ctx.group, "queries on every CP rank attended to my K/V: its gradient is "
                "their sum")  # fmt: skip
        n = grad.shape[0] // ctx.group.size()
        r = ctx.group.rank()
        return grad[r * n : (r + 1) * n], None


def _attend(
    q: Tensor, k: Tensor, v: Tensor, scale: float, allowed: Optional[Tensor] = None
) -> Tensor:
    """``[B, n, sq, d]`` × ``[B, g, sk, d]`` → ``[B, n, sq, d]`` in fp32 (float64 stays float64);
    causal when ``allowed`` is None (sq == sk), else the boolean ``[sq, sk]`` mask (True = may
    attend)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    dt = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(dt), k.to(dt), v.to(dt)
    if allowed is None:
        return F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=scale)


def window_bounds(cu: Sequence[int], window: int) -> List[Tuple[int, int, int]]:
    """``(lo, hi, sequences)`` of each window of the packed layout ``cu``: consecutive
    sequences while they fit in ``window`` tokens (a longer sequence alone). The one rule of the
    windows, for the attention and the step's memory model."""
    bounds, out, start = list(zip(cu[:-1], cu[1:])), [], 0
    while start < len(bounds):
        end = start + 1
        while end < len(bounds) and bounds[end][1] - bounds[start][0] <= window:
            end += 1
        out.append((bounds[start][0], bounds[end - 1][1], end - start))
        start = end
    return out


@functools.lru_cache(maxsize=PACK_WINDOW + 1)
def _causal(width: int) -> np.ndarray:
    """``[w, w]`` lower-triangular boolean (a query attends to itself and the keys before it)."""
    return np.tri(width, dtype=bool)


@functools.lru_cache(maxsize=16)
def _window_plan(cu: tuple, device: torch.device, window: int, dtype=torch.float32) -> tuple:
    """``(lo, hi, mask)`` per window of the packed layout ``cu`` (:func:`window_bounds`);
    ``mask`` is the window's block-diagonal causal ``[w, w]`` additive mask in ``dtype`` (0
    where a query may attend, −inf elsewhere: what SDPA turns a boolean mask into, so the kernel
    sees the same input), None for a one-sequence window (plain causal). Every layer and both
    passes of a micro-batch share one layout, and SDPA's backward keeps a reference to the mask,
    not a copy: cached.

    Windows of one width could share a batched SDPA call bit for bit (the flash kernel runs each
    batch entry alone), but on CPU the backward's cost grows with the windows either way and the
    gathers cost what the forward saves (measured on the tiny recipe at 4,096 tokens): one call
    per window."""
    seg = np.repeat(np.arange(len(cu) - 1), np.diff(cu))  # each token's sequence (host)
    plan = []
    for lo, hi, n in window_bounds(cu, window):
        mask = None
        if n > 1:  # built on the host with numpy (microseconds, not a dozen torch calls) ...
            sg = seg[lo:hi]
            allowed = sg[:, None] == sg[None, :]
            allowed &= _causal(hi - lo)
            # ... straight into torch's own (64-byte aligned) host memory, moved to the device
            # below: SDPA reads a numpy-aligned mask ~5% slower
            mask = torch.empty(hi - lo, hi - lo, dtype=torch.float32, device="cpu")
            add = mask.numpy()
            add.fill(-np.inf)
            np.copyto(add, np.float32(0.0), where=allowed)
            if dtype != torch.float32 or device.type != "cpu":
                mask = mask.to(device=device, dtype=dtype)
        plan.append((lo, hi, mask))
    return tuple(plan)


class LocalCoreAttention(MegatronModule):
    """Drop-in ``core_attention`` of the local spec (see the module docstring).

    Shapes: padded query ``[s/cp, b, n/tp, d]``, key/value ``[s/cp, b, g/tp, d]`` →
    ``[s/cp, b, n·d/tp]``; packed query ``[t/cp, n/tp, d]`` → ``[t/cp, n·d/tp]``.
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
            raise ValueError("LocalCoreAttention (CPU attention) needs attention_dropout=0")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"LocalCoreAttention supports causal masks only, got {attn_mask_type}")
        self.cp_group = pg_collection.cp if pg_collection is not None else None
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def _cp(self):
        g = self.cp_group
        return (g.size(), g.rank()) if g is not None and g.size() > 1 else (1, 0)

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
        if attention_bias is not None:
            raise NotImplementedError("LocalCoreAttention: attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        return self._padded(query, key, value)

    def _padded(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        cp_size, cp_rank = self._cp()
        sq, b, nh, d = query.shape
        q = query.permute(1, 2, 0, 3)  # [b, n, s, d]
        if cp_size == 1:
            out = _attend(q, key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), self.softmax_scale)
        else:
            k = _AllGatherSeq.apply(key, self.cp_group)  # [s, b, g, d], rank-major chunk order
            v = _AllGatherSeq.apply(value, self.cp_group)
            q_pos = cp_chunk_positions(sq, cp_rank, cp_size)
            k_pos = torch.cat([cp_chunk_positions(sq, r, cp_size) for r in range(cp_size)])
            allowed = (k_pos[None, :] <= q_pos[:, None]).to(query.device)
            k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
            out = _attend(q, k, v, self.softmax_scale, allowed)
        return out.to(query.dtype).permute(2, 0, 1, 3).reshape(sq, b, nh * d)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params) -> Tensor:
        if params.qkv_format != "thd":
            raise NotImplementedError(f"LocalCoreAttention: qkv_format={params.qkv_format}")
        cu = params.cu_seqlens_q_padded
        cu = (cu if cu is not None else params.cu_seqlens_q).tolist()
        cp_size, cp_rank = self._cp()
        t, nh, d = query.shape
        if cp_size == 1:
            return self._packed_windows(query, key, value, cu)
        key = _AllGatherSeq.apply(key, self.cp_group)  # [cp·t, g, d], rank-major
        value = _AllGatherSeq.apply(value, self.cp_group)
        outs = []
        local = 0  # where this sequence's tokens start on this rank
        for start, end in zip(cu[:-1], cu[1:]):
            n = (end - start) // cp_size  # this sequence's tokens on every rank
            if n == 0:
                continue
            q = query[local : local + n].permute(1, 0, 2)[None]  # [1, n, L/cp, d]
            rows = torch.cat(
                [torch.arange(r * t + local, r * t + local + n) for r in range(cp_size)]  # host
            ).to(key.device)
            k = key.index_select(0, rows).permute(1, 0, 2)[None]
            v = value.index_select(0, rows).permute(1, 0, 2)[None]
            q_pos = cp_chunk_positions(n, cp_rank, cp_size)
            k_pos = torch.cat([cp_chunk_positions(n, r, cp_size) for r in range(cp_size)])
            allowed = (k_pos[None, :] <= q_pos[:, None]).to(query.device)
            o = _attend(q, k, v, self.softmax_scale, allowed)
            outs.append(o[0].permute(1, 0, 2).to(query.dtype))
            local += n
        if local != t:
            raise ValueError(f"cu_seqlens {cu} cover {local} of this rank's {t} tokens")
        return torch.cat(outs).reshape(t, nh * d)

    def _packed_windows(self, query: Tensor, key: Tensor, value: Tensor, cu) -> Tensor:
        """No CP: one SDPA per window of consecutive sequences, block-diagonal causal mask.
        ``[t, n, d]`` → ``[t, n·d]``; ``cu`` the host list of sequence boundaries.

        What :func:`_attend` does per window is done once for the whole micro-batch — the
        float32 view, GQA's repeat of K and V — and the windows are ``split`` views (one
        gradient ``cat`` in the backward, not a zero-filled full-size tensor per slice): the
        same SDPA inputs, the same numbers, bit for bit."""
        t, nh, d = query.shape
        if cu[0] != 0 or cu[-1] != t:
            raise ValueError(f"cu_seqlens {cu} cover {cu[-1] - cu[0]} of this rank's {t} tokens")
        dt = torch.promote_types(query.dtype, torch.float32)
        rep = nh // key.shape[1]
        if rep > 1:
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        plan = _window_plan(tuple(cu), query.device, PACK_WINDOW, dt)
        sizes = [hi - lo for lo, hi, _ in plan]
        qs, ks, vs = (x.to(dt).split(sizes) for x in (query, key, value))
        outs = []
        for (_, _, mask), q, k, v in zip(plan, qs, ks, vs):
            q, k, v = (x.permute(1, 0, 2)[None] for x in (q, k, v))  # [1, n, w, d]
            scale = self.softmax_scale
            if mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            outs.append(o[0].permute(1, 0, 2).to(query.dtype))
        return (torch.cat(outs) if len(outs) > 1 else outs[0]).reshape(t, nh * d)
