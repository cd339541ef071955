"""Log-probs (and entropy, log-partition) straight from the output layer's input: the logits are
never materialised whole.

Why: the last pipeline stage's logits ``[T, V/tp]`` are the largest tensor of a step (T = 8192,
V = 152k, TP = 2: 2.5 GB in fp32), yet every objective needs only per-token statistics of them.
This kernel takes the hidden states ``h [T, d]`` and the output layer's vocabulary shard
``W [V/tp, d]`` and works through the tokens in chunks: at most ``chunk × V/tp`` logits exist at
a time, in one fp32 buffer (two when the entropy is asked for); the backward recomputes each
chunk's logits and accumulates dW and dh, so nothing of size T × V is kept between the passes.
Where the memory plan says they fit (``keep_logits``), the forward keeps each chunk's logits
instead and the backward starts from them: one output-layer matmul fewer (the forward, dh and dW
remain, as in an unfused pass), bit for bit the same numbers.

Maths (per token, shard of rank r, temperature T, padded vocabulary rows of W left out), the same
as :mod:`~megatron_p3o.logprob.kernels`'s, in the same floating-point steps:
    z = h·Wᵀ (+ Σ_i r_i·W_iᵀ, extra terms)     per chunk, fp32 (computed in W's dtype, then cast)
    m = max_v z/T (all-reduce MAX over TP, per chunk);   S = Σ_v exp(z/T − m) (all-reduce SUM)
    lse = m + log S;   ℓ(y) = z_y/T − lse;   H = log S − Σ_v e^{z/T−m}(z/T − m) / S   (float64)
    G = ∂L/∂z = [g_ℓ·(onehot(y) − p) − g_H·p⊙(log p + H) + g_lse·p] / T,   p = exp(z/T − lse)
    dh = G·W (this shard's partial sum);   dW = Σ_chunks Gᵀ·h_chunk        (fp32 accumulator)

Collectives: a MAX all-reduce of ``m [chunk]`` per chunk (the exponentials need the global max
before they are taken; with kept logits it runs while the chunk before is summed, so the other
ranks' lag hides behind the next matmul) and one SUM all-reduce of the per-token sums
``[2 or 3, T]`` (float64) after the last chunk, both over the TP group; none in the backward.
The TP sum of dh (each rank only saw its vocabulary shard) belongs to the input mapping, as in
Megatron's ``ColumnParallelLinear``: :func:`~megatron_p3o.model.output_layer.output_layer_input`
(all-reduce, or with sequence parallelism the all-gather of the input whose backward
reduce-scatters dh), which the model's output layer applies before it hands the loss an
:class:`~megatron_p3o.model.output_layer.OutputLayerInput`.

Rounding and chunking: the same chunk size on the same machine and thread count gives
bitwise-identical results run to run (no atomics, no data-dependent order). Across chunk sizes,
every per-token value is a reduction along its own row, in the same order whatever the chunk,
so ℓ, H and lse move only if the matmul kernel blocks another row count differently (measured on
this CPU: bitwise equal for chunks of 5, 16 and all 111 tokens); dh = G·W can (1 fp32 ulp
here, a kernel picked by the row count); dW is a sum over chunks in chunk order, so another chunk
size groups the tokens' contributions differently (a few ulp). The chunk size is
``loss.logprob_chunk`` (default: ≈ 16 MB of fp32 logits on CPUs, 256 MB on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_p3o.logprob.kernels import _BLOCK_ELEMS, _row_blocks, _shard_bounds
from megatron_p3o.runtime.collectives import all_max, all_max_start, all_sum


# -- the kernel ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Cfg:
    tp_group: Optional[dist.ProcessGroup]
    inv_t: float
    vocab_size: Optional[int]
    chunk_size: Optional[int]
    with_entropy: bool
    with_lse: bool
    keep_logits: bool = False


# logits per chunk: on CPUs a chunk that stays in the cache (16 MB of fp32: its elementwise
# passes run at cache speed; wider chunks measured slower although fewer, larger matmuls are
# faster: the kept-logits pass at T 8192, TP 2, took 1.01×, 1.03×, 1.03× the 256-row time with
# 512, 1024, 2048 rows, six paired runs each); on GPUs one large enough for efficient matmuls
# (256 MB: ≈ 900 tokens at V/tp = 76k)
_CHUNK_ELEMS = {"cpu": 2**22, "cuda": 2**26}


def _chunk_rows(n: int, width: int, chunk_size: Optional[int], device: torch.device) -> int:
    """Tokens per chunk: ``chunk_size`` if given, capped so a chunk's fp32 logits over
    ``width`` columns stay within ``_CHUNK_ELEMS`` (CPU: 16 MB; the unfused kernel's 32 MB
    blocks otherwise). The forward passes the shard's width *with* its padding, the same on
    every TP rank: each chunk ends in a MAX all-reduce over TP, so every rank must cut the same
    chunks (a padded vocabulary leaves the last rank fewer real rows; sized by those, its chunks
    paired other tokens in the all-reduce — gloo refuses that, NCCL would not)."""
    elems = _CHUNK_ELEMS.get(device.type, _BLOCK_ELEMS)
    rows = max(1, elems // max(width, 1))
    if chunk_size is not None:
        rows = min(rows, chunk_size)
    return max(1, min(rows, n))


def chunk_buffer_bytes(n: int, real: int, device: torch.device, chunk_size=None) -> int:
    """Bytes of one fp32 chunk of logits for ``n`` tokens over ``real`` vocabulary rows: the
    forward holds one (two with the entropy), the backward one beside its fp32 dW. Rows sized
    by ``real`` are at least the forward's (sized by the padded width): an upper bound."""
    return _chunk_rows(n, real, chunk_size, device) * real * 4


def _chunk_logits(hs, ws, s: int, e: int, real: int, out: Tensor, inv_t: float) -> Tensor:
    """``out [e−s, real]`` (fp32) = (h[s:e]·W[:real]ᵀ + Σ extra) / T.

    Each term's product is taken in its own dtype (bf16 weights give bf16 logits, then fp32, as
    the unfused output layer does) and added in fp32; 1/T is applied elementwise afterwards, as
    the unfused kernel does to materialised logits."""
    for i, (h, w) in enumerate(zip(hs, ws)):
        hc, wt = h[s:e], w[:real].t()
        if i == 0 and h.dtype == torch.float32 and w.dtype == torch.float32:
            torch.mm(hc, wt, out=out)
        elif i == 0:
            out.copy_(torch.mm(hc, wt))
        else:
            out.add_(torch.mm(hc, wt).float())
    if inv_t != 1.0:
        out.mul_(inv_t)
    return out


def _chunk_probs(hs, ws, s: int, e: int, real: int, out: Tensor, inv_t: float, lse) -> Tensor:
    """``out`` = p = exp(z / T − lse) of the chunk, recomputed for the backward in the forward's
    own steps (the unfused kernel's, too). Folding 1/T and −lse into one ``addmm`` saves a pass
    but measured ≈ 2× the gradient's rounding error against float64 (1.1e-6 relative)."""
    return _chunk_logits(hs, ws, s, e, real, out, inv_t).sub_(lse[:, None]).exp_()


class _KeptLogits:
    """Memory for kept logits (``keep_logits``), handed back by each backward and reused by the
    next forward, on the host only: a fresh host buffer is zeroed and mapped page by page as it
    is first written (0.2 s for 512 MB on the 2-core VM, a tenth of the matmul the keep saves;
    CUDA's caching allocator already reuses device memory). Free buffers stay resident: at most
    ``limit`` of them, the largest; :meth:`pooled_bytes` counts them for the memory plan."""

    def __init__(self, limit: int = 8):
        self.free: List[Tensor] = []
        self.limit = limit

    def take(self, numel: int, device: torch.device) -> Tensor:
        if device.type == "cpu":
            fits = [i for i, b in enumerate(self.free) if b.numel() >= numel]
            if fits:
                best = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
                return best[:numel]
        return torch.empty(numel, dtype=torch.float32, device=device)

    def give(self, buf: Tensor) -> None:
        if buf.device.type != "cpu":
            return
        base = buf._base if buf._base is not None else buf
        self.free.append(base)
        self.free.sort(key=Tensor.numel, reverse=True)
        del self.free[self.limit :]

    def pooled_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.free)


_KEPT = _KeptLogits()


def kept_logits_pooled_bytes() -> int:
    """Host bytes held free for kept logits (the memory plan counts them as available)."""
    return _KEPT.pooled_bytes()


def _chunk_sums(
    s: int,
    e: int,
    z: Tensor,
    handle,
    *,
    m_all: Tensor,
    stats: Tensor,
    buf: Tensor,
    ebuf: Optional[Tensor],
    any_real: bool,
    kept: bool,
) -> None:
    """Chunk ``[s, e)``'s Σ_v e^{z/T−m} into ``stats[0]`` (and Σ e^{z/T−m}(z/T − m) into
    ``stats[2]`` when ``ebuf`` is given), once its max ``m_all[s:e]`` is global (``handle``: the
    all-reduce in flight, waited for here). ``z`` is the chunk's z / T: in ``buf`` (taken in
    place) or, ``kept``, in the kept logits (left as they are; z − m goes to ``buf``)."""
    if handle is not None:
        handle.wait()
    if not any_real:  # a shard of padding columns only: it adds nothing to the sums
        return
    m = m_all[s:e]
    if kept:  # z / T stays; z − m goes to the scratch buffer (the same values)
        z = torch.sub(z, m[:, None], out=buf[: e - s])
    else:
        z.sub_(m[:, None])
    if ebuf is not None:
        p = torch.exp(z, out=ebuf[: e - s])
        stats[0, s:e] = p.sum(-1).double()
        stats[2, s:e] = p.mul_(z).sum(-1).double()
    else:
        stats[0, s:e] = z.exp_().sum(-1).double()


class _FusedLogprob(torch.autograd.Function):
    """ℓ(y), H and lse of softmax((h·Wᵀ + Σ r_i·W_iᵀ) / T) over a vocabulary shard, chunked.

    ``tensors`` = ``h₀ [n, d₀], W₀ [V/tp, d₀], h₁, W₁, …`` (term 0 is the output layer itself).
    Returns ``(ℓ [n], H [n] or None, lse [n] or None)``, fp32.
    """

    @staticmethod
    def forward(ctx, cfg: _Cfg, target: Tensor, *tensors: Tensor):
        hs, ws = list(tensors[0::2]), list(tensors[1::2])
        n, v_local, dev = hs[0].shape[0], ws[0].shape[0], hs[0].device
        start, real = _shard_bounds(v_local, cfg.tp_group, cfg.vocab_size)
        local_t = target - start
        in_shard = (local_t >= 0) & (local_t < real)
        local_t = torch.where(in_shard, local_t, torch.zeros_like(local_t))
        rows = _chunk_rows(n, v_local, cfg.chunk_size, dev)  # alike on every TP rank
        buf = torch.empty(rows, real, dtype=torch.float32, device=dev)
        ebuf = torch.empty_like(buf) if cfg.with_entropy else None
        # rows: Σexp (local), z_y / T, and Σ e^{z−m}(z−m) for the entropy
        stats = torch.zeros(3 if cfg.with_entropy else 2, n, dtype=torch.float64, device=dev)
        m_all = torch.full((n,), -float("inf"), dtype=torch.float32, device=dev)
        # keep_logits: every chunk's z / T, for the backward instead of a recompute
        kept = _KEPT.take(n * real, dev) if cfg.keep_logits and real > 0 else None
        # with kept logits over TP, a chunk's max travels while the chunk before it is summed
        # (its logits stay in the kept buffer): the same operations on the same values, the
        # wait for the other ranks hidden behind a matmul
        overlap = kept is not None and cfg.tp_group is not None
        pending = None  # (s, e, z, handle) of the chunk whose max is in flight
        finish = partial(_chunk_sums, m_all=m_all, stats=stats, buf=buf, ebuf=ebuf,
                         any_real=real > 0, kept=kept is not None)  # fmt: skip
        why = "the chunk's max over the whole vocabulary (stable lse)"

        for s, e in _row_blocks(n, rows):
            out = buf[: e - s] if kept is None else kept[s * real : e * real].view(e - s, real)
            z = _chunk_logits(hs, ws, s, e, real, out, 1.0)
            if real > 0:
                # z_y / T from the unscaled logit, in float64 (as the unfused kernel takes it)
                hit = z.gather(1, local_t[s:e, None]).squeeze(1).double()
                stats[1, s:e] = torch.where(in_shard[s:e], hit, torch.zeros_like(hit)) * cfg.inv_t
                if cfg.inv_t != 1.0:
                    z.mul_(cfg.inv_t)
                m_all[s:e] = z.amax(-1)
            if overlap:
                handle = all_max_start(m_all[s:e], cfg.tp_group, why)
                if pending is not None:
                    finish(*pending)
                pending = (s, e, z, handle)
                continue
            if cfg.tp_group is not None:
                all_max(m_all[s:e], cfg.tp_group, why)
            finish(s, e, z, None)
        if pending is not None:
            finish(*pending)
        del buf, ebuf, finish
        if cfg.tp_group is not None:
            all_sum(stats, cfg.tp_group, "Σexp, the target logit (one TP rank holds it) and "
                    "Σexp·(z−m) over the shards, once for all chunks")  # fmt: skip
        # per-token combination in float64: z_y − lse is where fp32 would lose digits
        log_s = torch.log(stats[0])
        lse = m_all.double() + log_s
        logp = (stats[1] - lse).float()
        ent = (log_s - stats[2] / stats[0]).float() if cfg.with_entropy else None
        ctx.save_for_backward(local_t, in_shard, m_all, log_s.float(), ent, *tensors)
        # an output the loss does not use (the metric entropy) gets None, not a zero tensor
        # that would cost the backward a log pass over every chunk
        ctx.set_materialize_grads(False)
        # the kept logits ride on ctx, not as saved tensors: the backward hands their memory
        # back for the next forward (a second backward of a retained graph recomputes them)
        ctx.cfg, ctx.real, ctx.rows, ctx.kept = cfg, real, rows, kept
        return logp, ent, lse.float() if cfg.with_lse else None

    @staticmethod
    def backward(ctx, g_logp: Optional[Tensor], g_ent: Optional[Tensor], g_lse: Optional[Tensor]):
        local_t, in_shard, m_all, log_s, ent, *tensors = ctx.saved_tensors
        cfg, real, rows, kept = ctx.cfg, ctx.real, ctx.rows, ctx.kept
        ctx.kept = None
        hs, ws = tensors[0::2], tensors[1::2]
        n, dev = hs[0].shape[0], hs[0].device
        need_h = ctx.needs_input_grad[2::2]
        need_w = ctx.needs_input_grad[3::2]
        g_lp = g_logp.float() if g_logp is not None else torch.zeros(n, device=dev)
        use_ent = cfg.with_entropy and g_ent is not None
        # ∂lse/∂z = p: the log-partition's gradient joins the −p term of ∂ℓ/∂z; 1/T folded in
        g_p = g_lp if g_lse is None else g_lp - g_lse.float()
        neg_gp = -g_p * cfg.inv_t
        neg_gh = -g_ent.float() * cfg.inv_t if use_ent else None
        hit = torch.where(in_shard, g_lp, torch.zeros_like(g_lp)) * cfg.inv_t
        lse = m_all + log_s
        dh = [torch.empty_like(h) if need else None for h, need in zip(hs, need_h)]
        # fp32 accumulators over the chunks; padded vocabulary rows keep a zero gradient
        dw = [
            torch.zeros(w.shape, dtype=torch.float32, device=dev) if need else None
            for w, need in zip(ws, need_w)
        ]
        buf = torch.empty(rows, real, dtype=torch.float32, device=dev)
        for s, e in _row_blocks(n, rows):
            if real == 0:
                for d in dh:
                    if d is not None:
                        d[s:e] = 0
                continue
            if kept is not None:  # the forward's z / T: p in the forward's own steps
                z = kept[s * real : e * real].view(e - s, real)
                p = torch.sub(z, lse[s:e, None], out=buf[: e - s]).exp_()
            else:  # the chunk's logits again (the forward kept none), then G in their storage
                p = _chunk_probs(hs, ws, s, e, real, buf[: e - s], cfg.inv_t, lse[s:e])
            if use_ent:
                # ∂H/∂z = −p (log p + H); ∂ℓ/∂z = onehot − p
                term = torch.log(p).add_(ent[s:e, None]).mul_(neg_gh[s:e, None])
                p.mul_(term.add_(neg_gp[s:e, None]))
            else:
                p.mul_(neg_gp[s:e, None])
            r = torch.arange(e - s, device=dev)
            p[r, local_t[s:e]] += hit[s:e]
            for h, w, d_h, d_w in zip(hs, ws, dh, dw):
                g = p if w.dtype == torch.float32 else p.to(w.dtype)
                if d_h is not None and d_h.dtype == g.dtype:
                    torch.mm(g, w[:real], out=d_h[s:e])
                elif d_h is not None:
                    d_h[s:e] = torch.mm(g, w[:real])
                if d_w is None:
                    continue
                if g.dtype == torch.float32 and h.dtype == torch.float32:
                    d_w[:real].addmm_(g.t(), h[s:e])
                else:  # the chunk's product in the weight's dtype, accumulated in fp32
                    d_w[:real].add_(torch.mm(g.t(), h[s:e].to(g.dtype)).float())
        if kept is not None:
            _KEPT.give(kept)
        grads = []
        for w, d_h, d_w in zip(ws, dh, dw):
            grads += [d_h, d_w.to(w.dtype) if d_w is not None else None]
        return (None, None, *grads)


def fused_vocab_parallel_logprobs(
    hidden: Tensor,
    weight: Tensor,
    target_ids: Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    with_entropy: bool = False,
    vocab_size: Optional[int] = None,
    with_lse: bool = False,
    extra: Sequence[Tuple[Tensor, Tensor]] = (),
    keep_logits: bool = False,
):
    """Log-prob of each target token (and the entropy, the log-partition) under
    softmax((hidden·weightᵀ + Σ r_i·W_iᵀ) / temperature), without materialising the logits.

    Args:
        hidden: ``[..., d]`` the output layer's input, the same on every TP rank; its gradient is
            this rank's partial sum over its vocabulary shard (put
            :func:`~megatron_p3o.model.output_layer.output_layer_input` in front of the kernel
            to sum it over TP, as the trainer does).
        weight: ``[V/tp, d]`` this rank's contiguous vocabulary shard of the output layer (rank r
            of ``tp_group`` holds global ids ``[r·V/tp, (r+1)·V/tp)``); any float dtype.
        target_ids: ``[...]`` global token ids.
        tp_group: the tensor-parallel group the vocabulary is split over; None = whole vocab here.
        temperature: the distribution is softmax(logits / T).
        chunk_size: at most this many tokens per chunk; None = ≈ 16 MB of fp32 logits (CPU).
        with_entropy: also return the entropy per token.
        vocab_size: true vocabulary size; rows of ``weight`` with global id ≥ vocab_size (padding)
            are excluded (and get a zero gradient).
        with_lse: also return the log-partition log Σ_v exp(z_v / T).
        extra: ``((r [..., d_i], W_i [V/tp, d_i]), …)`` terms added to the logits.
        keep_logits: keep each chunk's logits for the backward (``T × V/tp`` fp32 held between
            the passes) instead of recomputing them there: one output-layer matmul fewer, the
            same numbers bit for bit; for where they fit (the trainer decides from its memory
            plan, :meth:`~megatron_p3o.update.step_memory.StepNeed.logits_fit`). Moot without a
            gradient.

    Returns:
        ``(logprobs [...], entropy [...] or None)``, plus ``lse [...]`` with ``with_lse``; fp32,
        differentiable w.r.t. ``hidden``, ``weight`` and the extra terms.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != target_ids.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and target_ids {tuple(target_ids.shape)} disagree"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    lead = target_ids.shape
    tensors = []
    for h, w in ((hidden, weight), *extra):
        if h.shape[:-1] != lead or w.shape[-1] != h.shape[-1] or w.shape[0] != weight.shape[0]:
            raise ValueError(
                f"output-layer term {tuple(h.shape)} · {tuple(w.shape)}ᵀ does not fit "
                f"targets {tuple(lead)} and weight {tuple(weight.shape)}"
            )
        tensors += [h.reshape(-1, h.shape[-1]).contiguous(), w.contiguous()]
    keep_logits = keep_logits and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    cfg = _Cfg(tp_group, 1.0 / float(temperature), vocab_size, chunk_size, with_entropy, with_lse,
               keep_logits)  # fmt: skip
    lp, ent, lse = _FusedLogprob.apply(cfg, target_ids.reshape(-1).long(), *tensors)
    lp = lp.reshape(lead)
    ent = ent.reshape(lead) if ent is not None else None
    if with_lse:
        return lp, ent, lse.reshape(lead)
    return lp, ent
