"""Per-token log-probs of each sequence's completion, the same for the policy (ℓθ, ℓold) and
the reference model (ℓref, V_ref): the kernel (logits or the fused output layer) → CP gather →
the completion tokens of the padded or packed grid. ``score_responses`` is the no-grad forward
that writes them into the micro-batches."""

from __future__ import annotations

from typing import List, Optional

import torch

from megatron_p3o.logprob.fused import fused_vocab_parallel_logprobs
from megatron_p3o.logprob.kernels import vocab_parallel_logprobs
from megatron_p3o.model.forward import MicroBatch, forward_backward, nest_response
from megatron_p3o.model.output_layer import OutputLayerInput
from megatron_p3o.model.packed import gather_response, gather_tokens
from megatron_p3o.runtime.parallel import ParallelGroups


def response_logprobs(
    batch: MicroBatch,
    logits,
    groups: ParallelGroups,
    temperature: float,
    vocab_size: int,
    chunk: Optional[int] = None,
    *,
    with_entropy: bool = False,
    with_value: bool = False,
    inplace: bool = False,
    keep_logits: bool = False,
):
    """``(ℓ [n, L], entropy [n, L] or None, value [n] or None)`` of each sequence's completion
    tokens at temperature T, for the policy and the reference model alike.

    The kernel scores this rank's tokens (its TP vocabulary shard, its CP chunks); under CP the
    per-token values are gathered so that every CP rank holds whole sequences, then the
    completion tokens are picked out of the padded or packed grid (``response.index``).
    ``with_value``: V(s₁) = log Σ_v exp(z_v / T) at the position that predicts each sequence's
    first completion token (ReVal's soft value; the kernel's own log-partition).

    ``logits``: ``[b, s/cp, V/tp]``, or on the fused path (``model.fused_logprob``) the
    :class:`~megatron_p3o.model.output_layer.OutputLayerInput` the last stage handed over: the
    same values from the hidden states and the output weight, chunk by chunk (``inplace`` is
    then moot: no logits exist; ``keep_logits``: the kernel keeps its chunks' logits for the
    backward, where the caller's memory plan says they fit)."""
    common = dict(
        temperature=temperature, chunk_size=chunk, vocab_size=vocab_size,
        with_entropy=with_entropy, with_lse=with_value,
    )  # fmt: skip
    if isinstance(logits, OutputLayerInput):
        out = fused_vocab_parallel_logprobs(
            logits.hidden, logits.weight, batch["targets"], groups.tp, extra=logits.extra,
            keep_logits=keep_logits, **common,
        )  # fmt: skip
    else:
        out = vocab_parallel_logprobs(
            logits, batch["targets"], groups.tp, inplace_backward=inplace, **common
        )
    lp, ent = out[0], out[1]
    resp = batch["response"]
    index = batch.get("cp_token_index")
    cp = groups.cp if index is not None else None
    numel = index.numel() if index is not None else lp.numel()

    def whole(x):
        return gather_response(gather_tokens(x, index, numel, cp), resp["index"], resp["mask"])

    value = whole(out[2])[:, 0] if with_value else None
    return whole(lp), (whole(ent) if ent is not None else None), value


def score_responses(
    chunks,
    groups: ParallelGroups,
    microbatches: List[MicroBatch],
    key: str,
    temperature: float,
    vocab_size: int,
    chunk: Optional[int] = None,
    value_key: Optional[str] = None,
) -> None:
    """A no-grad forward of ``chunks`` over every micro-batch; ``response[key]`` = ℓ ``[n, L]``
    (zero off the mask) and, with ``value_key``, ``response[value_key]`` = V(s₁) ``[n]``,
    written on the last pipeline stage (ℓold of the policy, ℓref / V_ref of the reference)."""
    for mb in microbatches:
        nest_response(mb)
    out: List[tuple] = []

    def loss_fn(batch, logits):
        lp, _, value = response_logprobs(
            batch, logits, groups, temperature, vocab_size, chunk, with_value=bool(value_key)
        )
        out.append((lp.float() * batch["response"]["mask"].to(torch.float32), value))
        return torch.zeros((), device=logits.device), 0, {}

    with torch.no_grad():
        forward_backward(chunks, groups, microbatches, loss_fn, forward_only=True)
    if groups.is_last_stage():
        for mb, (lp, value) in zip(microbatches, out):
            dev = mb["response"]["mask"].device
            mb["response"][key] = lp.to(dev)
            if value_key:
                mb["response"][value_key] = value.float().to(dev)
