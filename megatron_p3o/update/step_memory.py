"""What one optimizer step's kept autograd graphs hold, and whether they fit: the memory side of
:mod:`~megatron_p3o.update.kept_graphs`, shared by the trainer (a verdict per step, from the
step's own micro-batches) and the dry run (``--dry-run``: the figure for a step of the recipe's
largest micro-batches, :mod:`~megatron_p3o.config.plan`).

Why a model of saved tensors rather than Korthikanti's rule of thumb: the kept graphs are the
whole of a step's activations at once, and the decision to keep them has to be right on the
machine that runs it. Per token and transformer layer, the tensors autograd keeps for the
backward (elements of the activation dtype unless said; h hidden, d head size, n query heads,
g key/value heads, f the MLP width, TP-sharded where Megatron shards them), as measured with
``saved_tensors_hooks`` on the local layer spec (``tests/unit/test_kept_graphs_one_pass.py``):

- each RMSNorm + the linear after it: the norm's input, its normalised output, the linear's
  input (3h), and the norm's inverse RMS (1, fp32) — twice per layer;
- RoPE: on packed micro-batches cos and sin once per micro-batch for every layer (2d per
  token in all); padded rows keep one pair per row position (nothing per token);
- core attention: q (n·d); then on the local spec (CPU) the repeated k and v and the output of
  each window's SDPA (3n·d) and its log-sum-exp (n, fp32); with Transformer
  Engine (flash attention) k and v unrepeated (2g·d), the output (n·d), the softmax statistics
  (n, fp32), no mask;
- the attention's output projection input (n·d; on the local spec's padded rows it is a view
  of the attention's output);
- the MLP: fc1's output (2f gated), the SwiGLU's two halves (2f), fc2's input (f).

Once per micro-batch on the local spec, for windows of several packed sequences: the float
block-diagonal mask (w² fp32 per w-token window), which every layer's SDPA keeps a reference to
(:func:`~megatron_p3o.model.local_attention._window_plan` builds it once per layout).

Per token outside the layers: the final norm (2h + 1) and the loss side: the fused output layer
keeps its input (h) and five per-token values (target, shard flag, max, log-sum, entropy: 21
bytes), and its fp32 logits (V/tp) where it keeps them (``batch.keep_logits``); an unfused
output layer keeps its fp32 logits (V/tp). The peak of a kept-graph step is
this sum plus the backward's transient of one micro-batch, a few per cent on the tiny recipe
(``benchmarks/bench_step_profile.py --memory`` measures it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

import torch

from megatron_p3o.runtime.mcore_compat import unwrap

# The share of a device's remaining memory the kept graphs may take (the estimate is within
# ~10% of the measured peak; the rest covers the backward's transients, fragmentation and
# whatever else the process allocates meanwhile).
KEEP_FRACTION = 0.5
FLOAT32 = 4


@dataclass(frozen=True)
class GraphShape:
    """What a rank's share of a model keeps per token (see the module docstring).

    ``local_window``: the local attention's packing window (tokens), None for Transformer
    Engine's flash attention; ``vocab_rows``: this rank's output-layer rows; ``fused``: the
    fused log-prob path (no logits kept; chunk buffers and an fp32 dW while it runs)."""

    hidden: int
    ffn: int
    heads: int  # query heads on this rank (÷ TP)
    kv_heads: int  # key/value heads on this rank (÷ TP)
    head_dim: int
    layers: int  # layers of this pipeline stage
    act_bytes: int  # the activation dtype's element size
    vocab_rows: int
    gated: bool = True
    local_window: Optional[int] = 128
    fused: bool = True
    sequence_parallel_tp: int = 1  # TP under sequence parallelism (hidden-sized tensors ÷ it)

    @classmethod
    def of_model(cls, model, groups, local_window: Optional[int]) -> "GraphShape":
        """From a built model chunk (its ``TransformerConfig`` and output layer)."""
        model = unwrap(model)
        c = model.config
        tp = groups.layout.tp
        out = getattr(model, "output_layer", None)
        rows = int(out.weight.shape[0]) if out is not None and out.weight is not None else 0
        if not rows and hasattr(model, "embedding"):  # tied: the embedding's rows
            rows = int(model.embedding.word_embeddings.weight.shape[0])
        return cls(
            hidden=c.hidden_size, ffn=c.ffn_hidden_size // tp,
            heads=c.num_attention_heads // tp,
            kv_heads=(c.num_query_groups or c.num_attention_heads) // tp,
            head_dim=c.kv_channels, layers=len(model.decoder.layers),
            act_bytes=torch.finfo(c.params_dtype).bits // 8, vocab_rows=rows,
            gated=c.gated_linear_unit, local_window=local_window,
            fused=getattr(model, "fused_output", None) is not None,
            sequence_parallel_tp=tp if c.sequence_parallel else 1,
        )  # fmt: skip

    def per_token(self, packed: bool = True) -> float:
        """Bytes per token, every layer and the loss side, without the attention masks;
        ``packed``: THD micro-batches (RoPE's cos and sin per token, once per micro-batch for
        every layer: :func:`~megatron_p3o.runtime.mcore_compat.packed_rope_in_one_gather`), else
        padded rows (Megatron's RoPE keeps a pair per row position: no per-token cost)."""
        e, d, n, g = self.act_bytes, self.head_dim, self.heads, self.kv_heads
        h = self.hidden / self.sequence_parallel_tp
        norm_linear = 3 * h * e + FLOAT32
        if self.local_window is None:  # flash attention: q, k, v unrepeated, output, stats
            attn = (2 * n + 2 * g) * d * e
        elif n == g:  # q, k, v (a view: the fused QKV output stays) and the output
            attn = (3 * n + 3 * g) * d * e
        else:  # q, the repeated k and v, the output
            attn = 4 * n * d * e
        attn += n * FLOAT32  # log-sum-exp
        mlp = (5 if self.gated else 3) * self.ffn * e
        # RoPE's cos and sin: packed, one pair per micro-batch for every layer; padded, one per
        # row position (not per token); TE's fused RoPE keeps its frequency table only
        rope = 2 * d * e if packed and self.local_window is not None else 0
        # the output projection's input: its own copy, except for the local attention's padded
        # rows, whose output it views
        proj = 0 if not packed and self.local_window is not None else n * d * e
        layer = 2 * norm_linear + attn + proj + mlp
        ends = 8 + 2 * h * e + FLOAT32 + rope  # token ids (embedding), the final norm, RoPE
        loss = self.hidden * e + 21 if self.fused else self.vocab_rows * FLOAT32
        return self.layers * layer + ends + loss

    def mask_bytes(self, window_tokens: Iterable[int]) -> float:
        """The local attention's float block-diagonal masks: w² elements per window of w
        tokens (several sequences), one per micro-batch shared by every layer."""
        if self.local_window is None:
            return 0.0
        return FLOAT32 * sum(w * w for w in window_tokens)

    def transient(self, tokens: int, device: torch.device) -> float:
        """The most the loss side adds while one micro-batch of ``tokens`` runs: the fused
        kernel's two fp32 chunks of logits (forward, with the entropy) or one beside its fp32
        dW accumulator (backward); unfused, the logits' gradient shares their storage."""
        if not self.fused:
            return 0.0
        from megatron_p3o.logprob.fused import chunk_buffer_bytes

        chunk = chunk_buffer_bytes(tokens, self.vocab_rows, device)
        return max(2 * chunk, chunk + self.vocab_rows * self.hidden * FLOAT32)


def pack_windows(cu_seqlens: Sequence[int], window: int) -> List[int]:
    """Tokens of each multi-sequence window of the local attention's packed layout (a lone
    sequence has no mask): :func:`megatron_p3o.model.local_attention.window_bounds`."""
    from megatron_p3o.model.local_attention import window_bounds

    return [hi - lo for lo, hi, n in window_bounds(cu_seqlens, window) if n > 1]


def kept_graph_bytes(shape: GraphShape, microbatches, device: torch.device,
                     transient: bool = True) -> float:  # fmt: skip
    """Peak bytes of a kept-graph step over ``microbatches`` (this rank's, host tensors): every
    micro-batch's graph at once, plus the loss side's transient of the largest (unless
    ``transient`` is False)."""
    total, largest = 0.0, 0
    for mb in microbatches:
        tokens = int(mb["tokens"].numel())
        windows: List[int] = []
        if shape.local_window is not None and "cu_seqlens" in mb:
            windows = pack_windows(mb["cu_seqlens"].tolist(), shape.local_window)  # host
        total += tokens * shape.per_token("cu_seqlens" in mb) + shape.mask_bytes(windows)
        largest = max(largest, tokens)
    return total + (shape.transient(largest, device) if transient else 0.0)


def room_for_graphs(device: torch.device) -> float:
    """Bytes this rank may give the kept graphs: :data:`KEEP_FRACTION` of what its device has
    left (a GPU: free plus what the caching allocator holds unused; the host: the kernel's
    MemAvailable plus the fused kernel's pooled logits buffers, shared by the node's ranks)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return KEEP_FRACTION * (free + unused)
    from megatron_p3o.logprob.fused import kept_logits_pooled_bytes

    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    # the fused kernel's pooled logits buffers are this process's, free for its next step
    available = int(info["MemAvailable"].split()[0]) * 1024 + kept_logits_pooled_bytes()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return KEEP_FRACTION * available / max(local, 1)


def model_shape(model, groups) -> GraphShape:
    """The :class:`GraphShape` of a built model chunk: the local attention's window on the local
    spec, flash attention's figures with Transformer Engine's."""
    from megatron_p3o.model.local_attention import PACK_WINDOW, LocalCoreAttention

    inner = unwrap(model)
    attn = inner.decoder.layers[0].self_attention.core_attention
    window = PACK_WINDOW if isinstance(attn, LocalCoreAttention) else None
    return GraphShape.of_model(inner, groups, window)


def kept_logit_columns(shape: GraphShape, groups, vocab_size: int) -> int:
    """The fp32 logits per token the fused kernel keeps on this rank: its vocabulary shard's
    real (unpadded) rows."""
    rank = groups.tp_rank if groups.layout.tp > 1 else 0
    return max(0, min(shape.vocab_rows, vocab_size - rank * shape.vocab_rows))


@dataclass(frozen=True)
class StepNeed:
    """This rank's memory for one step's choices (bytes), computed once per step: ``graphs``
    every micro-batch's graph at once (the kept-graph path), ``largest`` the largest
    micro-batch's graph alone (the other paths), ``logits`` / ``largest_logits`` the fused
    kernel's kept logits of all of them / of the largest (0 unfused), and the ``room``."""

    graphs: float
    largest: float
    logits: float
    largest_logits: float
    room: float

    @property
    def graphs_fit(self) -> bool:
        """``batch.keep_graphs: auto``: the step's graphs fit."""
        return self.graphs <= self.room

    def logits_fit(self, kept_graphs: bool) -> bool:
        """``batch.keep_logits: auto``: the fused kernel's logits fit beside the graphs of the
        path the step takes. A rank's own choice: the numbers and collectives are the same."""
        if not self.logits:
            return False
        if kept_graphs:
            return self.graphs + self.logits <= self.room
        return self.largest + self.largest_logits <= self.room


def step_need(chunks, microbatches, groups, vocab_size: int) -> StepNeed:
    """:class:`StepNeed` of this rank's ``microbatches`` (host tensors) for the model chunk."""
    shape = model_shape(chunks[0], groups)
    cols = kept_logit_columns(shape, groups, vocab_size) if shape.fused else 0
    graphs, tokens, biggest = 0.0, 0, (0, 0.0)
    for mb in microbatches:
        n = int(mb["tokens"].numel())
        one = kept_graph_bytes(shape, [mb], groups.device, transient=False)
        graphs, tokens = graphs + one, tokens + n
        biggest = max(biggest, (n, one))
    transient = shape.transient(biggest[0], groups.device)
    return StepNeed(graphs + transient, biggest[1] + transient, FLOAT32 * cols * tokens,
                    FLOAT32 * cols * biggest[0], room_for_graphs(groups.device))  # fmt: skip


def profiled_tensor_peak(prof) -> int:
    """The peak of live tensor bytes over a ``torch.profiler.profile(profile_memory=True)`` run:
    every allocation and free of its memory timeline, in order (how the kept-graph estimate is
    checked: ``benchmarks/bench_step_profile.py --memory`` and its unit test)."""
    from torch.profiler._memory_profiler import Action, MemoryProfile

    cur = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if action == Action.CREATE:
            cur += size
        elif action == Action.DESTROY:
            cur -= size
        peak = max(peak, cur)
    return peak
