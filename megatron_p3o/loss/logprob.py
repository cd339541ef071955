"""Log-probabilities (and entropy) of target tokens from vocabulary-parallel logits.

Why: every objective needs ℓθ(y_t) = log softmax(z_t / T)[y_t] from logits that are split over
the tensor-parallel group along the vocabulary. Megatron's ``vocab_parallel_cross_entropy`` keeps
a full fp32 softmax for backward and has no temperature, entropy, padding or chunking. This module
keeps only per-token statistics (max, log-sum-exp) for backward and recomputes the softmax there
chunk by chunk, so peak memory stays one chunk above the logits themselves.

Maths (per token, vocab shard ``v`` of rank r, temperature T, padded columns dropped):
    z = logits / T;   m = max_v z (all-reduce MAX over TP);   S = Σ_v exp(z − m) (all-reduce SUM)
    lse = m + log S;  ℓ(y) = z_y − lse;   H = lse − Σ_v softmax(z)·z
    ∂ℓ/∂logits = (onehot(y) − p) / T;    ∂H/∂logits = −p ⊙ (log p + H) / T
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor


def _shard_bounds(v_local: int, tp_group, vocab_size: Optional[int]) -> Tuple[int, int]:
    """(first global id of this shard, number of real, non-padded columns in it)."""
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    start = rank * v_local
    real = v_local if vocab_size is None else max(0, min(v_local, vocab_size - start))
    return start, real


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, tp_group, temperature: float,
                vocab_size: Optional[int], chunk_size: Optional[int], with_entropy: bool):
        v_local = logits.shape[-1]
        lead = logits.shape[:-1]
        flat = logits.reshape(-1, v_local)
        tgt = target.reshape(-1)
        n = flat.shape[0]
        start, real = _shard_bounds(v_local, tp_group, vocab_size)
        local_t = tgt - start
        in_shard = (local_t >= 0) & (local_t < real)
        local_t = torch.where(in_shard, local_t, torch.zeros_like(local_t))
        step = chunk_size or max(n, 1)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        logp = torch.empty_like(lse)
        ent = torch.empty_like(lse) if with_entropy else None
        inv_t = 1.0 / temperature
        for s in range(0, n, step):
            e = min(n, s + step)
            z = flat[s:e, :real].float()
            if inv_t != 1.0:
                z = z * inv_t
            m = z.max(dim=-1).values if real > 0 else torch.full((e - s,), -float("inf"))
            if tp_group is not None:
                # TP group: the max over the whole vocabulary, for a stable log-sum-exp.
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
            ez = torch.exp(z - m[:, None])
            # the target logit in float64, straight from the input (no fp32 rounding of z/T)
            xt = flat[s:e].gather(1, local_t[s:e, None]).squeeze(1).double() * inv_t
            parts = [ez.sum(-1).double(), torch.where(in_shard[s:e], xt, torch.zeros_like(xt))]
            if with_entropy:
                parts.append((ez * z).sum(-1).double())
            sums = torch.stack(parts)
            if tp_group is not None:
                # TP group: Σexp, the target logit (held by one rank) and Σexp·z over all shards.
                dist.all_reduce(sums, group=tp_group)
            # per-token combination in float64: the fp32 sums are exact enough, their
            # differences (z_y − lse) are where fp32 would lose digits.
            chunk_lse = m.double() + torch.log(sums[0])
            lse[s:e] = chunk_lse.float()
            logp[s:e] = (sums[1] - chunk_lse).float()
            if with_entropy:
                ent[s:e] = (chunk_lse - sums[2] / sums[0]).float()
        ctx.save_for_backward(logits, local_t, in_shard, lse, ent if with_entropy else lse)
        ctx.cfg = (inv_t, real, step, with_entropy)
        out_ent = ent.reshape(lead) if with_entropy else None
        return logp.reshape(lead), out_ent

    @staticmethod
    def backward(ctx, g_logp: Tensor, g_ent: Optional[Tensor]):
        logits, local_t, in_shard, lse, ent = ctx.saved_tensors
        inv_t, real, step, with_entropy = ctx.cfg
        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local)
        n = flat.shape[0]
        grad = torch.zeros_like(flat)
        g_lp = g_logp.reshape(-1).float() if g_logp is not None else torch.zeros(n)
        use_ent = with_entropy and g_ent is not None
        g_h = g_ent.reshape(-1).float() if use_ent else None
        for s in range(0, n, step):
            e = min(n, s + step)
            z = flat[s:e, :real].float()
            if inv_t != 1.0:
                z = z * inv_t
            logp_all = z - lse[s:e, None]
            p = torch.exp(logp_all)
            gz = p * (-g_lp[s:e, None])
            if use_ent:
                gz -= g_h[s:e, None] * p * (logp_all + ent[s:e, None])
            rows = torch.arange(e - s, device=gz.device)
            gz[rows, local_t[s:e]] += torch.where(in_shard[s:e], g_lp[s:e], torch.zeros_like(g_lp[s:e]))
            if inv_t != 1.0:
                gz *= inv_t
            grad[s:e, :real] = gz.to(grad.dtype)
        return grad.reshape(logits.shape), None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: Tensor,
    target_ids: Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    with_entropy: bool = False,
    vocab_size: Optional[int] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Log-prob of each target token (and the entropy) under softmax(logits / temperature).

    Args:
        logits: ``[..., V/tp]`` this rank's contiguous vocabulary shard (any float dtype;
            accumulation is fp32). Rank r of ``tp_group`` holds global ids ``[r·V/tp, (r+1)·V/tp)``.
        target_ids: ``[...]`` global token ids.
        tp_group: the tensor-parallel group the vocabulary is split over; None = whole vocab here.
        temperature: sampling temperature T; the distribution is softmax(logits / T).
        chunk_size: tokens per chunk (bounds the fp32 temporaries); None = all at once.
        with_entropy: also return the entropy of softmax(logits / T) per token.
        vocab_size: true vocabulary size; padded columns (global id ≥ vocab_size) are excluded.

    Returns:
        ``(logprobs [...] fp32, entropy [...] fp32 or None)``; differentiable w.r.t. ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target_ids {tuple(target_ids.shape)} disagree"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    return _VocabParallelLogprob.apply(
        logits, target_ids.long(), tp_group, float(temperature), vocab_size, chunk_size, with_entropy
    )
