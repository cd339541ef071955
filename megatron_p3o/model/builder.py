"""Build Megatron-Core ``GPTModel`` chunks from a :class:`ModelDescription` and a layout.

Why: one place decides the TransformerConfig (RMSNorm, SwiGLU, GQA, RoPE, QK-norm, QKV bias,
tied embeddings), the layer spec (Transformer Engine on GPUs, the local spec on CPU, with our
packed- and CP-capable attention on CPU), and the vocabulary padding. Padded vocabulary rows exist
only so the vocabulary splits evenly over TP; :func:`padded_vocab_size` is the one rule for them and
the log-prob code masks them out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Literal, Optional

import torch
import torch.nn.functional as F

from megatron_p3o.model.description import ModelDescription
from megatron_p3o.runtime import mcore_compat
from megatron_p3o.runtime.fields import check_ranges
from megatron_p3o.runtime.parallel import LayoutError, ParallelGroups


@dataclass(frozen=True)
class ModelConfig:
    """Attributes:
    checkpoint: Megatron dist checkpoint made by ``checkpoints_convert.hf_to_megatron``.
    params_dtype: training dtype ("float32", "bfloat16").
    seq_length: longest prompt + completion, in tokens.
    use_te: Transformer Engine layers (None = when available).
    fp8: TE FP8 recipe or None.
    hf_config: an HF config.json describing the model, for ``--dry-run`` before the
        checkpoint exists (the checkpoint's own description wins when it does).
    moe_dispatcher: MoE token dispatcher, "allgather" or "alltoall" (both tested on CPU).
    moe_aux_loss_coeff: MoE load-balancing loss weight (0 = off, the RL default: the router is
        already trained; Megatron's aux loss, not the HF config's ``router_aux_loss_coef``).
    fused_logprob: the last stage computes log-probs (entropy, log-partition) from the output
        layer's input and weight chunk by chunk, never materialising the logits
        (:mod:`megatron_p3o.logprob.fused`); calls where that is not exact run unfused,
        the reason logged once. On by default: at T = 8192 it keeps 0.13× the unfused path's
        peak memory for 1.01× its time over a trainer step on CPU (one forward+backward alone:
        1.07–1.13×, a matmul recomputed in the backward), and the end-to-end tier runs with it;
        ``false`` materialises the logits.
    """

    checkpoint: str = ""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seq_length: int = 512
    use_te: Optional[bool] = None
    fp8: Optional[str] = None
    hf_config: str = ""
    moe_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    moe_aux_loss_coeff: float = 0.0
    fused_logprob: bool = True

    RANGES: ClassVar[Dict[str, str]] = {"seq_length": ">= 2", "moe_aux_loss_coeff": ">= 0"}

    def __post_init__(self):
        check_ranges(self, self.RANGES, "model")


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Vocabulary rounded up to a multiple of ``lcm(divisible_by, tp)``.

    Megatron-LM pads to ``divisible_by × tp``, which changes the embedding shape with TP and so
    breaks resharding a checkpoint to another TP. With the lcm rule the padded size is the same
    for every power-of-two TP up to ``divisible_by`` (300 → 384 at TP 1, 2, 4 and 8).
    """
    multiple = math.lcm(divisible_by, tp)
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class BuildOptions:
    """How to build the model (not what model: that is the description).

    Attributes:
        params_dtype: parameter dtype (fp32 for CPU tests; bf16 on GPUs).
        make_vocab_size_divisible_by: vocab padding unit per TP rank.
        seq_length: longest training sequence (checked against CP and the description).
        use_te: Transformer Engine layer spec; None = auto (TE importable and CUDA present).
        fp8: TE FP8 recipe ("hybrid"/"e4m3") or None.
        init_method_std: std of the random initialization (when not loading weights).
        recompute: activation recomputation ("selective", "full") or None.
        moe_dispatcher: Megatron's MoE token dispatcher (both run on CPU under gloo).
        moe_aux_loss_coeff: load-balancing loss weight (0 = off; the router's HF coefficient is
            informational only).
        fused_logprob: the last stage's output layer hands :func:`~.forward.forward_backward`'s
            loss function an ``OutputLayerInput`` (hidden states + weight) instead of logits
            (:class:`~.forward.FusedOutputLayer`); off here by default, so code that builds a
            model for its own logits gets them; the trainer sets ``model.fused_logprob``.
    """

    params_dtype: torch.dtype = torch.float32
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 2048
    use_te: Optional[bool] = None
    fp8: Optional[str] = None
    init_method_std: float = 0.02
    recompute: Optional[str] = None
    moe_dispatcher: Literal["allgather", "alltoall"] = "allgather"
    moe_aux_loss_coeff: float = 0.0
    fused_logprob: bool = False


def transformer_config(desc: ModelDescription, groups: ParallelGroups, opts: BuildOptions):
    """The Megatron ``TransformerConfig`` for this model and layout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    lay = groups.layout
    lay.check_model(
        num_layers=desc.num_layers, num_heads=desc.num_heads, num_kv_heads=desc.num_kv_heads,
        num_experts=desc.num_experts, expert_ffn=desc.moe_intermediate_size,
    )  # fmt: skip
    lay.check_sequence(opts.seq_length)
    if desc.sliding_window is not None and opts.seq_length > desc.sliding_window:
        raise LayoutError(
            f"seq_length={opts.seq_length} exceeds the model's "
            f"sliding_window={desc.sliding_window}; "
            "sliding-window attention is not implemented, keep sequences within the window"
        )
    use_te = resolve_use_te(opts)
    if opts.fp8 and not use_te:
        raise ValueError("fp8 training needs Transformer Engine on a GPU (use_te)")
    on_gloo = groups.backend == "gloo"
    kw = dict(
        num_layers=desc.num_layers,
        hidden_size=desc.hidden_size,
        ffn_hidden_size=desc.intermediate_size,
        num_attention_heads=desc.num_heads,
        num_query_groups=desc.num_kv_heads,
        kv_channels=desc.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=desc.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=desc.qkv_bias,
        qk_layernorm=desc.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=opts.init_method_std,
        tensor_model_parallel_size=lay.tp,
        pipeline_model_parallel_size=lay.pp,
        virtual_pipeline_model_parallel_size=lay.vpp,
        context_parallel_size=lay.cp,
        sequence_parallel=lay.sequence_parallel,
        params_dtype=opts.params_dtype,
        pipeline_dtype=opts.params_dtype,
        bf16=opts.params_dtype == torch.bfloat16,
        fp16=opts.params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # TE spec: Megatron's fused bias-SwiGLU (no extension needed); the masked-softmax fusion
        # is read by the local attention only (TE's attention has its own kernels)
        bias_activation_fusion=use_te,
        bias_dropout_fusion=False,
        masked_softmax_fusion=use_te,
        persist_layer_norm=False,
        # TE's fused RoPE (THD included); Megatron's unfused THD path loops over sequences on
        # the host (≈ 4 device→host syncs per layer per forward). The local spec has no kernel.
        apply_rope_fusion=use_te,
        # TE linears accumulate weight gradients into main_grad; Megatron's own output layer
        # needs apex's fused_weight_gradient_mlp_cuda for it (else it refuses to build)
        gradient_accumulation_fusion=use_te and mcore_compat.have_grad_accum_fusion(),
        # We normalize by the global token count ourselves (see loss/); Megatron must only sum.
        calculate_per_token_loss=True,
        # gloo pairs a send and a recv to the same peer wrongly inside one batched p2p op: with
        # the default True, interleaved PP computes silently wrong gradients (measured at PP=2).
        batch_p2p_comm=not on_gloo,
        fp8=opts.fp8,
    )
    if desc.is_moe:
        kw.update(_moe_config(desc, lay, opts, grouped_gemm=use_grouped_gemm(desc, opts)))
        # TE >= 2.1's fused token permutation (megatron-core 0.16.1 checks the same kernels)
        kw.update(moe_permute_fusion=use_te and mcore_compat.have_moe_permute_fusion())
    if opts.recompute:
        kw.update(recompute_granularity=opts.recompute)
        if opts.recompute == "full":
            kw.update(recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(**kw)


def use_grouped_gemm(desc: ModelDescription, opts: BuildOptions) -> bool:
    """Routed experts in one grouped GEMM (TE's ``TEGroupedMLP``) on GPUs with a TE that has it;
    the sequential expert loop otherwise (the local spec, CPU). Config and spec must agree."""
    return desc.is_moe and resolve_use_te(opts) and mcore_compat.have_te_grouped_gemm(opts.fp8)


def _moe_config(desc: ModelDescription, lay, opts: BuildOptions, grouped_gemm: bool) -> dict:
    """Routed experts as Qwen3-MoE / Mixtral compute them: softmax router in fp32, top-k, the
    top-k probabilities renormalized when ``norm_topk_prob`` (Megatron: top-k of the logits,
    then softmax over them) or the plain softmax probabilities otherwise (``pre_softmax``)."""
    return dict(
        num_moe_experts=desc.num_experts,
        moe_router_topk=desc.num_experts_per_tok,
        moe_ffn_hidden_size=desc.moe_intermediate_size,
        moe_router_pre_softmax=not desc.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if opts.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=opts.moe_aux_loss_coeff,
        moe_token_dispatcher_type=opts.moe_dispatcher,
        moe_grouped_gemm=grouped_gemm,
        expert_model_parallel_size=lay.ep,
        expert_tensor_parallel_size=lay.etp,
    )


def resolve_use_te(opts: BuildOptions) -> bool:
    if opts.use_te is None:
        return torch.cuda.is_available() and mcore_compat.have_transformer_engine()
    if opts.use_te and not (torch.cuda.is_available() and mcore_compat.have_transformer_engine()):
        raise ValueError("use_te=True needs CUDA and transformer_engine (pip install .[gpu])")
    return opts.use_te


def build_model(
    desc: ModelDescription, groups: ParallelGroups, opts: BuildOptions = BuildOptions()
) -> List[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage).

    Returns plain ``GPTModel`` modules (not DDP-wrapped). Each chunk has ``vp_stage`` set and
    ``.description`` / ``.padded_vocab_size`` attributes for the loss and export code.
    """
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(desc, groups, opts)
    use_te = resolve_use_te(opts)
    if desc.is_moe and not use_te:
        mcore_compat.moe_without_te()
    mcore_compat.packed_rope_in_one_gather()
    spec = mcore_compat.layer_spec(
        use_te=use_te,
        qk_norm=desc.qk_norm,
        num_experts=desc.num_experts or None,
        grouped_gemm=use_grouped_gemm(desc, opts),
    )
    block = spec
    if not use_te:  # padded or packed, with or without CP (see local_attention)
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        from megatron_p3o.model.local_attention import LocalCoreAttention
        from megatron_p3o.model.local_norm import LocalQKNorm, LocalRMSNorm

        attn = spec.submodules.self_attention.submodules
        attn.core_attention = LocalCoreAttention
        if desc.qk_norm:
            attn.q_layernorm = attn.k_layernorm = LocalQKNorm
        # norms that allow sequence parallelism (MoE with TP needs it), the final one included
        spec.submodules.input_layernorm = LocalRMSNorm
        spec.submodules.pre_mlp_layernorm = LocalRMSNorm
        per_chunk = desc.num_layers // (groups.layout.pp * (groups.layout.vpp or 1))
        block = TransformerBlockSubmodules(layer_specs=[spec] * per_chunk, layer_norm=LocalRMSNorm)
    vocab = padded_vocab_size(desc.vocab_size, groups.layout.tp, opts.make_vocab_size_divisible_by)
    rope = desc.rope_scaling or {}
    kind = rope.get("rope_type", rope.get("type"))
    chunks = []
    n_chunks = groups.layout.vpp or 1
    for vp_stage in range(n_chunks):
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=vocab,
            max_sequence_length=max(opts.seq_length, desc.max_position_embeddings),
            pre_process=groups.is_first_stage(vp_stage),
            post_process=groups.is_last_stage(vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=desc.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(desc.rope_theta),
            seq_len_interpolation_factor=float(rope["factor"]) if kind == "linear" else None,
            pg_collection=groups.pg_collection,
            vp_stage=vp_stage if groups.layout.vpp else None,
        )
        if kind == "llama3":
            _apply_llama3_rope(model, desc)
        if desc.is_moe:  # the routers' replay hooks (R3; route agreement)
            from megatron_p3o.model.routing import attach

            model.route_hooks = attach([model])
            _experts_apart(model)
        if opts.fused_logprob and groups.is_last_stage(vp_stage):
            from megatron_p3o.model.forward import FusedOutputLayer

            model.fused_output = FusedOutputLayer(model, groups)
        model.description = desc
        model.padded_vocab_size = vocab
        model.vp_stage = vp_stage if groups.layout.vpp else None
        _params_to(model, opts.params_dtype)
        chunks.append(model)
    return chunks


def _experts_apart(model: torch.nn.Module) -> None:
    """Expert weights always form their own DDP buffers and optimizer (Megatron does so only when
    ep > 1: ``allreduce=False``), so a training checkpoint has one optimizer structure at every
    EP and a run resumes at another EP. At ep = 1 the expert-DP group is the DP group."""
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            p.allreduce = False


def _params_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter in ``dtype``. The local spec's torch norms are created in fp32
    whatever ``params_dtype`` says; Megatron's fp16/bf16 optimizer then keeps them in a group
    of their own whose checkpoint mapping fails ("Param id … does not match any model sharded
    param"). Megatron's own ``Float16Module`` casts the same way; TE norms need no cast."""
    if dtype == torch.float32:
        return
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def _apply_llama3_rope(model, desc: ModelDescription) -> None:
    """Llama 3.1 frequency scaling with the config's own factors (Megatron hard-codes 1/4/8192)."""
    rs = desc.rope_scaling
    rot = model.rotary_pos_emb
    dim = desc.head_dim
    base = torch.arange(0, dim, 2, dtype=torch.float32, device=rot.inv_freq.device) / dim
    inv = 1.0 / (desc.rope_theta**base)
    rot.inv_freq = rot._apply_scaling(
        inv,
        factor=float(rs["factor"]),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )
