"""Log-probabilities (and entropy) of target tokens from vocabulary-parallel logits.

Why: every objective needs ℓθ(y_t) = log softmax(z_t / T)[y_t] from logits that are split over
the tensor-parallel group along the vocabulary. Megatron's ``vocab_parallel_cross_entropy`` has
no temperature, entropy, padding or chunking, and for bf16 logits keeps a full fp32 softmax for
backward. Here only per-token statistics are kept; work happens in row blocks through one reused
fp32 scratch buffer (on CPUs, fresh multi-hundred-MB allocations cost more than the maths).

With ``inplace_backward=True`` (the training path: the logits feed only this loss) the logits'
own storage is reused, as Megatron does: fp32 logits hold exp(z − m) after the forward, and the
gradient is written into that storage, so no full-size tensor is allocated at all.

Maths (per token, vocab shard ``v`` of rank r, temperature T, padded columns dropped):
    z = logits / T;   m = max_v z (all-reduce MAX over TP);   S = Σ_v exp(z − m) (all-reduce SUM)
    lse = m + log S;  ℓ(y) = z_y − lse;   H = lse − Σ_v softmax(z)·z
    ∂ℓ/∂logits = (onehot(y) − p) / T;    ∂H/∂logits = −p ⊙ (log p + H) / T;   ∂lse/∂logits = p / T
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_p3o.runtime.collectives import all_max, all_sum

# rows per block: the fp32 scratch stays ≈ 32 MB whatever the vocabulary
_BLOCK_ELEMS = 8 * 2**20


def _shard_bounds(v_local: int, tp_group, vocab_size: Optional[int]) -> Tuple[int, int]:
    """(first global id of this shard, number of real, non-padded columns in it)."""
    rank = 0 if tp_group is None else dist.get_rank(tp_group)
    start = rank * v_local
    real = v_local if vocab_size is None else max(0, min(v_local, vocab_size - start))
    return start, real


def _block_rows(n: int, real: int, chunk_size: Optional[int]) -> int:
    rows = max(1, _BLOCK_ELEMS // max(real, 1))
    if chunk_size is not None:
        rows = min(rows, chunk_size)
    return max(1, min(rows, n))


def _row_blocks(n: int, rows: int):
    """``(start, end)`` of each block of ``rows`` rows."""
    for s in range(0, n, rows):
        yield s, min(n, s + rows)


def _scaled(x: Tensor, out: Tensor, inv_t: float) -> Tensor:
    """``x / T`` in fp32, written into ``out`` (``out is x`` on the in-place path)."""
    if out is not x:
        out.copy_(x)
    if inv_t != 1.0:
        out.mul_(inv_t)
    return out


class _VocabParallelLogprob(torch.autograd.Function):
    """ℓ(y) = log softmax(z / T)[y] and the entropy over a vocabulary-parallel shard.

    The forward reads as the maths in the module docstring: the predicted logit, the row max,
    the sum of exponentials (one TP reduction each for the max and the sums), then the per-token
    combination in float64. Each step walks the rows in blocks through one fp32 scratch buffer,
    or through the logits' own storage on the in-place (training) path.
    """

    @staticmethod
    def predicted_logits(flat, real, local_t, in_shard, inv_t, rows, out) -> None:
        """``out [n]`` (float64) = z_y / T straight from the input, before any rounding; 0 on
        ranks whose shard does not hold y (the TP sum then gives every rank the value)."""
        for s, e in _row_blocks(flat.shape[0], rows):
            if real == 0:  # a shard of padding columns only (tiny vocabulary, large TP)
                out[s:e] = 0.0
                continue
            hit = flat[s:e, :real].gather(1, local_t[s:e, None]).squeeze(1).double()
            zero = torch.zeros(e - s, dtype=torch.float64, device=flat.device)
            out[s:e] = torch.where(in_shard[s:e], hit, zero) * inv_t

    @staticmethod
    def row_max(flat, real, inv_t, rows, scratch, tp_group) -> Tensor:
        """``m [n]`` (fp32) = max over the whole vocabulary of z / T. Without ``scratch`` (the
        in-place path) the logits are left scaled by 1/T for :meth:`sum_exp`."""
        n = flat.shape[0]
        m_all = torch.empty(n, dtype=torch.float32, device=flat.device)
        for s, e in _row_blocks(n, rows):
            x = flat[s:e, :real]
            w = _scaled(x, x if scratch is None else scratch[: e - s, :real], inv_t)
            if real > 0:
                m_all[s:e] = w.amax(-1)
            else:
                m_all[s:e] = -float("inf")
        if tp_group is not None:
            all_max(m_all, tp_group, "the max over the whole vocabulary (stable log-sum-exp)")
        return m_all

    @staticmethod
    def sum_exp(flat, real, inv_t, rows, scratch, m_all, stats, with_entropy) -> None:
        """``stats[0]`` = Σ_v exp(z/T − m) and, with the entropy, ``stats[2]`` =
        Σ_v e^{z/T−m}·(z/T − m), both local to the shard (float64). On the in-place path the
        logits' storage ends up holding exp(z/T − m), which the backward reuses."""
        for s, e in _row_blocks(flat.shape[0], rows):
            x = flat[s:e, :real]
            w = x if scratch is None else _scaled(x, scratch[: e - s, :real], inv_t)
            w.sub_(m_all[s:e, None])
            if with_entropy:
                stats[2, s:e] = (torch.exp(w) * w).sum(-1).double()
            w.exp_()
            stats[0, s:e] = w.sum(-1).double()

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        target: Tensor,
        tp_group,
        temperature: float,
        vocab_size: Optional[int],
        chunk_size: Optional[int],
        with_entropy: bool,
        inplace: bool,
        with_lse: bool = False,
    ):
        cls = _VocabParallelLogprob
        v_local, lead = logits.shape[-1], logits.shape[:-1]
        flat, tgt = logits.reshape(-1, v_local), target.reshape(-1)
        n, dev = flat.shape[0], logits.device
        start, real = _shard_bounds(v_local, tp_group, vocab_size)
        local_t = tgt - start
        in_shard = (local_t >= 0) & (local_t < real)
        local_t = torch.where(in_shard, local_t, torch.zeros_like(local_t))
        inv_t = 1.0 / temperature
        # the fp32 logits' own storage can hold exp(z − m) for backward (training path)
        keep_exp = inplace and flat.dtype == torch.float32 and flat.is_contiguous()
        rows = _block_rows(n, real, chunk_size)
        scratch = (
            None if keep_exp else torch.empty(rows, max(real, 1), dtype=torch.float32, device=dev)
        )
        # rows: Σexp (local), z_y / T, and Σ e^{z−m}(z−m) for the entropy
        stats = torch.empty(3 if with_entropy else 2, n, dtype=torch.float64, device=dev)
        cls.predicted_logits(flat, real, local_t, in_shard, inv_t, rows, stats[1])
        m_all = cls.row_max(flat, real, inv_t, rows, scratch, tp_group)
        cls.sum_exp(flat, real, inv_t, rows, scratch, m_all, stats, with_entropy)
        if tp_group is not None:
            all_sum(stats, tp_group, "Σexp, the target logit (one TP rank holds it) and "
                    "Σexp·(z−m) over the vocabulary shards")  # fmt: skip
        # per-token combination in float64: z_y − lse is where fp32 would lose digits
        log_s = torch.log(stats[0])
        lse = m_all.double() + log_s
        logp = (stats[1] - lse).float()
        ent = (log_s - stats[2] / stats[0]).float() if with_entropy else None
        ctx.save_for_backward(
            logits, local_t, in_shard, m_all, log_s.float(), ent if with_entropy else m_all
        )
        ctx.cfg = (inv_t, real, rows, with_entropy, keep_exp, inplace)
        # an output the loss does not use (the metric entropy) gets None, not a zero tensor
        # that would cost the backward a log pass over all logits
        ctx.set_materialize_grads(False)
        return (
            logp.reshape(lead),
            ent.reshape(lead) if with_entropy else None,
            lse.float().reshape(lead) if with_lse else None,
        )

    @staticmethod
    def backward(ctx, g_logp: Tensor, g_ent: Optional[Tensor], g_lse: Optional[Tensor] = None):
        logits, local_t, in_shard, m_all, log_s, ent = ctx.saved_tensors
        inv_t, real, rows, with_entropy, keep_exp, inplace = ctx.cfg
        v_local = logits.shape[-1]
        flat = logits.reshape(-1, v_local)
        n = flat.shape[0]
        # the gradient goes into the logits' storage (training path) or a fresh tensor
        grad = flat if inplace and flat.is_contiguous() else torch.empty_like(flat)
        if real < v_local:
            grad[:, real:] = 0  # padded vocabulary columns get no gradient
        g_lp = (
            g_logp.reshape(-1).float()
            if g_logp is not None
            else torch.zeros(n, device=logits.device)
        )
        use_ent = with_entropy and g_ent is not None
        g_h = g_ent.reshape(-1).float() if use_ent else None
        # ∂lse/∂z = p: the log-partition's gradient joins the −p term of ∂ℓ/∂z
        g_p = g_lp if g_lse is None else g_lp - g_lse.reshape(-1).float()
        hit = torch.where(in_shard, g_lp, torch.zeros_like(g_lp)) * inv_t
        direct = grad.dtype == torch.float32
        scratch = (
            None
            if direct
            else torch.empty(rows, max(real, 1), dtype=torch.float32, device=logits.device)
        )
        lse = m_all + log_s
        for s in range(0, n, rows):
            e = min(n, s + rows)
            out = grad[s:e, :real] if direct else scratch[: e - s, :real]
            if keep_exp:
                # storage holds exp(z − m): p = e^{z−m} / S
                p = out
                p.mul_(torch.exp(-log_s[s:e])[:, None])
            else:
                out.copy_(flat[s:e, :real])
                if inv_t != 1.0:
                    out.mul_(inv_t)
                p = out.sub_(lse[s:e, None]).exp_()
            if use_ent:
                # ∂H/∂z = −p (log p + H); ∂ℓ/∂z = onehot − p
                logp_all = torch.log(p)
                p.mul_(logp_all.add_(ent[s:e, None]).mul_(-g_h[s:e, None]).sub_(g_p[s:e, None]))
            else:
                p.mul_(-g_p[s:e, None])
            if inv_t != 1.0:
                p.mul_(inv_t)
            if real > 0:
                r = torch.arange(e - s, device=p.device)
                p[r, local_t[s:e]] += hit[s:e]
            if not direct:
                grad[s:e, :real].copy_(p)
        return grad.reshape(logits.shape), None, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: Tensor,
    target_ids: Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    with_entropy: bool = False,
    vocab_size: Optional[int] = None,
    inplace_backward: bool = False,
    with_lse: bool = False,
):
    """Log-prob of each target token (and the entropy) under softmax(logits / temperature).

    Args:
        logits: ``[..., V/tp]`` this rank's contiguous vocabulary shard (any float dtype;
            accumulation is fp32, per-token results are combined in float64). Rank r of
            ``tp_group`` holds global ids ``[r·V/tp, (r+1)·V/tp)``.
        target_ids: ``[...]`` global token ids.
        tp_group: the tensor-parallel group the vocabulary is split over; None = whole vocab here.
        temperature: sampling temperature T; the distribution is softmax(logits / T).
        chunk_size: at most this many tokens per block (bounds the fp32 temporaries further);
            None = blocks of ≈32 MB.
        with_entropy: also return the entropy of softmax(logits / T) per token.
        vocab_size: true vocabulary size; padded columns (global id ≥ vocab_size) are excluded.
        inplace_backward: reuse the logits' storage for intermediate values and the gradient
            (saves a full-size tensor; the logits' values are destroyed). Only when nothing
            else reads the logits after this call, as in the training loss.

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
    lp, ent, lse = _VocabParallelLogprob.apply(
        logits,
        target_ids.long(),
        tp_group,
        float(temperature),
        vocab_size,
        chunk_size,
        with_entropy,
        inplace_backward,
        with_lse,
    )
    return (lp, ent, lse) if with_lse else (lp, ent)
