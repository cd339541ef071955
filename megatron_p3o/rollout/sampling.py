"""The distribution an engine samples from, and its log-probs (the behaviour log-probs P3O's
ratio is taken against): softmax(logits / T), truncated by top-k / top-p when enabled. One place
for the embedded engine's batched sampler and its multi-turn server."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_p3o.types import SamplingParams


def _truncate(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """Logits ``[B, V]`` with the tokens outside top-k / the top-p nucleus set to −inf."""
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, idx = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, -1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (torch.cumsum(probs, -1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def sampling_logprobs(logits: Tensor, sampling: SamplingParams) -> Tensor:
    """log of the distribution sampled from, ``[B, V]`` fp32."""
    z = logits.float() / sampling.temperature
    return torch.log_softmax(_truncate(z, sampling.top_k, sampling.top_p), -1)
