"""Every Megatron-Core call whose signature differs between the versions we support.

Tested on CPU with megatron-core 0.16.1 (the newest for Python 3.11); clusters may run 0.17+ on
Python 3.12. When an upstream signature changes, this is the only file to touch.
"""

from __future__ import annotations

import contextlib
import inspect

# megatron.core is imported by the functions that call it, not here: loading and checking a
# recipe (config/, the one-line errors of ``--dry-run``) imports this module and must not pay
# megatron.core's ~4 s import


def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def have_transformer_engine() -> bool:
    """True when TE imports (lazily; TE is a GPU-only optional extra)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def have_grad_accum_fusion() -> bool:
    """apex's ``fused_weight_gradient_mlp_cuda``: Megatron's own linears (the output layer) need
    it for ``gradient_accumulation_fusion`` (``tensor_parallel/layers.py`` refuses without)."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def have_moe_permute_fusion() -> bool:
    """The fused permute kernels ``moe_permute_fusion`` needs (TE >= 2.1): megatron-core 0.16.1's
    ``TransformerConfig`` refuses the flag when ``moe_utils.fused_permute`` & co. are None."""
    try:
        from megatron.core.transformer.moe import moe_utils as mu
    except ImportError:
        return False
    names = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
             "fused_sort_chunks_by_index_with_probs", "fused_unpermute")  # fmt: skip
    return all(getattr(mu, n, None) is not None for n in names)


def have_te_grouped_gemm(fp8: bool = False) -> bool:
    """TE's grouped GEMM for the routed experts (``TEGroupedMLP``): megatron-core 0.16.1 defines
    ``TEColumnParallelGroupedLinear`` only for TE >= 1.9 (``extensions/transformer_engine.py``;
    older TE falls back to the legacy ``GroupedMLP``, whose weights are laid out differently and
    which we do not map), and ``TransformerConfig`` refuses FP8 grouped GEMM below TE 1.11."""
    try:
        from megatron.core.extensions import transformer_engine as te_ext
        from megatron.core.utils import is_te_min_version
    except Exception:
        return False
    if getattr(te_ext, "TEColumnParallelGroupedLinear", None) is None:
        return False
    return not fp8 or is_te_min_version("1.11.0")


def layer_spec(*, use_te: bool, qk_norm: bool, num_experts=None, grouped_gemm: bool = False):
    """The GPT decoder layer spec: Transformer Engine's or the local (pure PyTorch) one; with
    ``num_experts`` an MoE layer: TE's grouped GEMM (``TEGroupedMLP``, all local experts in one
    kernel) when ``grouped_gemm``, else sequential local experts (the local spec always).

    Both specs give the same dist-checkpoint keys, so one checkpoint loads under either. The
    local spec renames its norms to TE's fused ones (``pre_mlp_layernorm.`` →
    ``mlp.linear_fc1.layer_norm_``), yet TE's MoE spec keeps a standalone ``pre_mlp_layernorm``
    (an MoE layer has no ``linear_fc1`` to fuse it into): the local MoE spec keeps it too.
    ``TEGroupedMLP``'s sharded state dict is "interchangeable with SequentialMLP's"
    (``moe/experts.py``): one checkpoint serves both expert layouts."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=grouped_gemm, qk_layernorm=qk_norm
        )
    spec = specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_norm,
        normalization="RMSNorm",
    )  # fmt: skip
    if num_experts:
        keys = spec.submodules.sharded_state_dict_keys_map
        spec.submodules.sharded_state_dict_keys_map = {
            k: v for k, v in keys.items() if k != "pre_mlp_layernorm."
        }
    return spec


def forward_backward_func(pp: int, vpp: int | None):
    """Megatron's schedule for this pipeline layout (no pipelining, 1F1B or interleaved)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if _accepts(get_forward_backward_func, "pp_size"):
        return get_forward_backward_func(pp_size=pp, vp_size=vpp)
    return get_forward_backward_func()


def unwrap(model):
    """The model inside Megatron's wrappers (DDP, Float16Module: each holds it as ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def forwards_then_backwards(model, forward_step_func, microbatches, loss_of, pg_collection, cp):
    """0.16.1's ``forward_backward_no_pipelining`` with its forwards and backwards apart: every
    micro-batch's forward with its autograd graph kept, then, in micro-batch order,
    ``loss_of(k)`` (the k-th micro-batch's loss tensor, computed once every forward is done)
    and its backward; then ``finalize_model_grads_func``. One model chunk, no pipelining.

    What Megatron's schedule does around them is kept: its own ``forward_step`` (first /
    current micro-batch, input tensor, autocast, the loss function's call and token count) and
    ``backward_step`` (the loss scale of 16-bit training), the DDP ``no_sync`` context for every
    micro-batch but the last, and the token total handed to the finalizer. Gradients accumulate
    into ``main_grad`` in micro-batch order, each micro-batch's backward over the same graph as
    in Megatron's interleaved forward/backward: the same sums in the same order."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_config, get_model_type

    config = get_model_config(model)
    no_sync = config.no_sync_func or contextlib.nullcontext
    model_type = get_model_type(model)
    n, data, store = len(microbatches), iter(microbatches), []
    total = None

    def forward(i):
        nonlocal total
        _, num_tokens = schedules.forward_step(
            forward_step_func, data, model, n, None, store, config, cp,
            is_first_microbatch=i == 0, current_microbatch=i,
        )  # fmt: skip
        total = num_tokens if total is None else total + num_tokens

    def backward(i):
        schedules.backward_step(None, loss_of(i), None, model_type, config)

    with no_sync():
        for i in range(n - 1):
            forward(i)
    forward(n - 1)
    with no_sync():
        for i in range(n - 1):
            backward(i)
    backward(n - 1)  # outside no_sync: the last micro-batch lets the gradients synchronise
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(
            [model], total if config.calculate_per_token_loss else None,
            pg_collection=pg_collection, force_all_reduce=False,
        )  # fmt: skip


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


def packed_rope_in_one_gather() -> None:
    """Megatron's unfused RoPE for packed (THD) sequences builds the frequency rows with a Python
    loop over the sequences (``torch.split`` + one slice each, per call: q and k of every layer),
    which was a tenth of a CPU training step with ~40 short sequences per micro-batch. Without CP
    the rows it builds are ``freqs[position within the sequence]``, so one index gather gives the
    same tensor, bit for bit, without reading ``cu_seqlens`` on the host. The rotation is 0.16.1's
    ``_apply_rotary_pos_emb_bshd`` step for step — ``cos_ = (cos(rows) · mscale)`` in the input's
    dtype (likewise ``sin_``), ``x·cos_ + rotate_half(x)·sin_`` — with ``cos_`` and ``sin_``
    taken once per micro-batch: q and k of every layer pass the same ``cu_seqlens`` and
    ``freqs`` tensors, and Megatron recomputed both four times per layer (and kept each copy for
    the backward). Its closing ``cat`` with an empty pass-through part copies the result and is
    left out; with a pass-through part it runs. With CP (chunk-split positions), a row of
    ``freqs`` per packed token (its offset mapping) or multi-latent attention Megatron's function
    runs. ``tests/unit/test_mcore_compat_rope.py`` compares it with Megatron's function bitwise,
    values and gradients."""
    import weakref

    import torch
    from megatron.core.models.common.embeddings import rope_utils

    megatrons = rope_utils._apply_rotary_pos_emb_thd
    if getattr(megatrons, "p3o_megatrons", None) is not None:
        return

    def apply_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False,
                  mscale=1.0, cp_group=None):  # fmt: skip
        n = t.shape[0]
        if (cp_group is None or cp_group.size() != 1 or freqs.size(0) == n
                or multi_latent_attention):  # fmt: skip
            # CP, freqs with a row per packed token (Megatron's offset mapping), MLA: its code
            return megatrons(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention,
                             mscale, cp_group)  # fmt: skip
        cos_, sin_ = _trig(cu_seqlens, freqs, n, t.dtype, mscale)
        x = t.unsqueeze(1)
        rot_dim = freqs.shape[-1]
        x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        out = (x * cos_) + (rope_utils._rotate_half(x, rotary_interleaved) * sin_)
        if x_pass.shape[-1]:
            out = torch.cat((out, x_pass), dim=-1)
        return out.squeeze(1)

    last: list = [None, None]  # (weakref to the cu_seqlens tensor, its positions)
    trig: list = [None, None, None]  # (weakrefs to cu_seqlens and freqs, their key, cos_, sin_)

    def _trig(cu_seqlens, freqs, n, dtype, mscale):
        refs, key, pair = trig
        if refs is not None and refs[0]() is cu_seqlens and refs[1]() is freqs and \
                key == (n, dtype, mscale):  # fmt: skip
            return pair
        rows = freqs[_positions(cu_seqlens, n).to(freqs.device)]
        pair = ((torch.cos(rows) * mscale).to(dtype), (torch.sin(rows) * mscale).to(dtype))
        trig[:] = [(weakref.ref(cu_seqlens), weakref.ref(freqs)), (n, dtype, mscale), pair]
        return pair

    def _positions(cu_seqlens, n):
        """Each packed token's position within its sequence; q and k of every layer pass the
        same ``cu_seqlens`` tensor, so it is computed once per micro-batch."""
        ref, pos = last
        if ref is not None and ref() is cu_seqlens and pos.shape[0] == n:
            return pos
        cu = cu_seqlens.to(torch.long)
        starts = torch.repeat_interleave(cu[:-1] - cu[0], cu[1:] - cu[:-1], output_size=n)
        pos = torch.arange(n, device=cu.device) - starts
        last[:] = [weakref.ref(cu_seqlens), pos]
        return pos

    apply_thd.p3o_megatrons = megatrons
    rope_utils._apply_rotary_pos_emb_thd = apply_thd


# The distributed optimizer's checkpoint format: 0.16's default ("fully_sharded_model_space")
# builds ShardedTensors with a flattened range, which its own dist_checkpointing refuses
# ("ShardedTensor.flattened_range is not supported"); "fully_reshardable" saves and loads at any
# DP / TP / PP / EP.
OPTIMIZER_CKPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def optimizer_sharded_state(optimizer, model_sd, is_loading: bool = False):
    """The optimizer's sharded state dict in a format any layout can load.

    Loading into a distributed optimizer that has not stepped yet: 0.16 reads the Adam step
    from the inner optimizer's (empty) state first when neither Apex nor TE is installed and
    fails an assertion; the optimizer's own dummy-state initialisation runs first (the
    checkpoint then overwrites every value it wrote)."""
    if is_loading:
        _dist_opt_step_state()
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
            inner = getattr(opt, "optimizer", None)
            if init is not None and inner is not None and not inner.state:
                init()
    return optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata=dict(OPTIMIZER_CKPT_METADATA)
    )


def _dist_opt_step_state() -> None:
    """0.16 without Apex/TE (torch's AdamW keeps a per-parameter ``step`` tensor): loading a
    ``fully_reshardable`` distributed-optimizer checkpoint first sets every ``step`` from the
    common state, then copies the checkpoint's per-parameter tensors over *all* keys of the
    state, ``step`` included, which the checkpoint does not hold (KeyError). The ``step`` already
    set is kept: it is copied onto itself."""
    from megatron.core.optimizer import distrib_optimizer as d

    cls = d.DistributedOptimizer
    if d.HAVE_APEX_OR_TE or getattr(cls, "_p3o_keeps_step", False):
        return
    original = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            gi, go = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[gi]["params"][go]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = set_states
    cls._p3o_keeps_step = True


def after_optimizer_load(optimizer) -> None:
    """0.16 without Apex/TE gives every parameter's Adam state the *same* ``step`` tensor on load;
    torch's AdamW then advances that one tensor once per parameter, and the bias correction of
    the first step after a resume is wrong. Each parameter gets its own copy back."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for st in getattr(inner, "state", {}).values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()


def override_output_layer(layer, forward) -> None:
    """Route the last stage's ``output_layer`` calls through ``forward(original, input_, weight=…,
    runtime_gather_output=…)`` (the fused log-prob path, :mod:`megatron_p3o.model.forward`).

    0.16.1's ``GPTModel._postprocess`` calls ``self.output_layer(hidden_states,
    weight=output_weight, runtime_gather_output=…)`` once (``[s(/tp), b, d]``; ``weight`` is the
    embedding weight when the embeddings are tied), keeps the first output and, without labels,
    returns it as ``logits.transpose(0, 1).contiguous()`` (see :func:`as_model_output`). Forward
    hooks on the layer still run (``nn.Module.__call__``); its parameters and state-dict keys do
    not change."""
    original = type(layer).forward.__get__(layer)

    def patched(input_, weight=None, runtime_gather_output=None):
        return forward(original, input_, weight=weight, runtime_gather_output=runtime_gather_output)

    layer.forward = patched


def as_model_output(x):
    """What ``GPTModel`` makes of its output layer's first output, ``[s, b, …]`` → ``[b, s, …]``
    (0.16.1: ``logits.transpose(0, 1)``), for tensors that travel beside it (the fused path's
    extra logit terms)."""
    return x.transpose(0, 1)


def output_layer_unsupported(layer, runtime_gather_output) -> str | None:
    """Why the fused path cannot stand in for this ``output_layer`` call (None: it can): the
    features of 0.16.1's output layer that read or gather its logits beyond ``input·weightᵀ``."""
    cfg = layer.config
    if getattr(cfg, "mtp_num_layers", None):
        return "multi-token prediction computes its own loss from the output layer's logits"
    if getattr(cfg, "defer_embedding_wgrad_compute", False):
        return "defer_embedding_wgrad_compute keeps the output layer's own activation buffers"
    gather = layer.gather_output if runtime_gather_output is None else runtime_gather_output
    if gather:
        return "the output layer gathers its logits over TP (parallel_output=False)"
    if getattr(layer, "disable_grad_reduce", False):
        return "the output layer does not sum its input's gradient over TP (disable_grad_reduce)"
    if getattr(layer, "bias", None) is not None:
        return "the output layer has a bias"
    return None
