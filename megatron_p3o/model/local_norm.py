"""RMSNorm for the local (non-Transformer-Engine) layer spec that allows sequence parallelism.

Why: Megatron-Core's local spec wraps torch's norm in ``WrappedTorchNorm``, which refuses
``sequence_parallel`` outright. With sequence parallelism each TP rank normalizes its own slice
of the sequence with a replicated weight, so the weight's gradient is partial per rank; Megatron's
``finalize_model_grads`` sums the gradients of parameters marked ``sequence_parallel`` over the
TP group. This norm is torch's RMSNorm with that mark, and the same module otherwise. MoE layers
need it: Megatron trains MoE with TP > 1 only under sequence parallelism (``MoELayer``).
"""

from __future__ import annotations

import torch


class LocalRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built from Megatron's norm arguments; the weight is marked
    ``sequence_parallel`` when the config is (its gradient is then summed over TP)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        if config.normalization != "RMSNorm":
            raise ValueError(f"LocalRMSNorm: normalization={config.normalization!r}")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


class LocalQKNorm(LocalRMSNorm):
    """The per-head q/k RMSNorm (Qwen3): it sees whole sequences of this rank's heads, so it is
    never marked sequence-parallel (Megatron sums the q/k-norm gradients over TP by name)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kw):
        super().__init__(config, hidden_size, eps, **kw)
        self.weight.sequence_parallel = False
