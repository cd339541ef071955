"""Every Megatron-Core call whose signature differs between the versions we support.

Tested on CPU with megatron-core 0.16.1 (the newest for Python 3.11); clusters may run 0.17+ on
Python 3.12. When an upstream signature changes, this is the only file to touch.
"""

from __future__ import annotations

import inspect

import megatron.core
from packaging.version import Version

MCORE_VERSION = Version(megatron.core.__version__)


def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def have_transformer_engine() -> bool:
    """True when TE imports (lazily; TE is a GPU-only optional extra)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def layer_spec(*, use_te: bool, qk_norm: bool, num_experts=None):
    """The GPT decoder layer spec: Transformer Engine's or the local (pure PyTorch) one; with
    ``num_experts`` an MoE layer (sequential local experts: no grouped GEMM)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_norm
        )
    return specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_norm,
        normalization="RMSNorm",
    )  # fmt: skip


def forward_backward_func(pp: int, vpp: int | None):
    """Megatron's schedule for this pipeline layout (no pipelining, 1F1B or interleaved)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if _accepts(get_forward_backward_func, "pp_size"):
        return get_forward_backward_func(pp_size=pp, vp_size=vpp)
    return get_forward_backward_func()


def megatron_optimizer(config, model_chunks, pg_collection):
    from megatron.core.optimizer import get_megatron_optimizer

    kwargs = {}
    if _accepts(get_megatron_optimizer, "pg_collection"):
        # With explicit groups Megatron refuses its extra gloo groups (only legacy,
        # non-dist checkpoint formats of the distributed optimizer need them).
        kwargs.update(pg_collection=pg_collection, use_gloo_process_groups=False)
    return get_megatron_optimizer(config, model_chunks, **kwargs)


def moe_without_te() -> None:
    """Megatron-Core 0.16's ``moe_utils`` imports ``te_general_gemm`` only when Transformer
    Engine is installed, yet its fp32 router GEMM reads the name unconditionally (NameError
    without TE); defining it as None selects the plain-torch branch, as Megatron intends."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
