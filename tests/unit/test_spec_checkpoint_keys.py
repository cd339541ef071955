"""One converted checkpoint fits both layer specs, dense and MoE (issue 24, item 5).

The converter (``checkpoints_convert.hf_to_megatron``) writes one dist-checkpoint key per
canonical name of :func:`megatron_p3o.model.hf.mapping.tensor_maps` (``split_layer``: the layer, and
for a routed expert the expert, become axes). For each spec (Transformer Engine's and the local
one) and each model kind (dense, MoE) the GPT model the project builds must ask for exactly
those keys with the same global shapes, its live parameter names must canonicalise onto
exactly those names (live export), and a converted checkpoint must load into it bit for bit.
Before the fix an MoE checkpoint held ``decoder.layers.mlp.linear_fc1.layer_norm_weight`` while
TE's MoE spec asks for ``decoder.layers.pre_mlp_layernorm.weight`` (CheckpointError on load).

How the TE model is obtained without Transformer Engine (not importable here): the layer spec is
Megatron's own ``get_gpt_layer_with_transformer_engine_spec`` (through
``mcore_compat.layer_spec(use_te=True)``, as ``build_model`` calls it), so its module structure
and ``sharded_state_dict_keys_map`` are Megatron's. To let it run, only for the duration of the
body: ``gpt_layer_specs.TESpecProvider`` (imported there only when TE is) is set to Megatron's
real ``TESpecProvider`` and that provider's ``is_te_min_version`` answers True (a recent TE:
TENorm for q/k norms, TE linears in the experts). In the spec it returns, every TE class
(``TELayerNormColumnParallelLinear``, ``TEColumnParallelLinear``, ``TERowParallelLinear``,
``TENorm``, ``TEDotProductAttention``) is then replaced by a small torch module below that
registers the parameters the TE module registers (TE linear: ``weight`` [and ``bias``], the
fused norm linear also ``layer_norm_weight``; TENorm: ``weight``; attention: none) with a
``sharded_state_dict`` copied from ``megatron.core.extensions.transformer_engine`` (norms: none,
as TE's, so the parent's default applies); no TE class may remain. ``build_model(use_te=True)``
then builds the model (``resolve_use_te`` patched to accept it on CPU). TE's ``_extra_state``
entries (ShardedObjects) are not modelled: ``checkpoint.load_sharded`` tolerates their absence.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_p3o.runtime.parallel import Layout

DENSE = dict(
    architecture="Qwen3ForCausalLM",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    tie_word_embeddings=False,
)
DESCS = {
    "dense": DENSE,
    "moe": dict(
        DENSE,
        architecture="Qwen3MoeForCausalLM",
        vocab_size=290,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
}
SEQ = 32
DIVISIBLE_BY = 128


# -- stand-ins for the TE modules --------------------------------------------------------------


def _sharded(module, prefix, axes, sharded_offsets, metadata):
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
    )

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    return make_sharded_tensors_for_checkpoint(
        module.state_dict(prefix="", keep_vars=True),
        prefix,
        axes,
        sharded_offsets,
        tp_group=module._tp_group,
        dp_cp_group=metadata["dp_cp_group"],
    )


class _TELinearStub(torch.nn.Module):
    """A TE linear's parameters (TP-local shapes) and its ``sharded_state_dict``."""

    column = True
    fused_norm = False
    axes = {"weight": 0, "bias": 0}  # TEColumnParallelLinear / TELayerNormColumnParallelLinear

    def __init__(
        self, input_size, output_size, *, config, bias=True, is_expert=False, tp_group=None, **_
    ):
        super().__init__()
        from megatron.core.utils import get_tensor_model_parallel_group_if_none

        self._tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        tp = self._tp_group.size()
        dt = config.params_dtype
        if self.fused_norm:  # TE LayerNormLinear: the norm's parameters, then the linear's
            self.layer_norm_weight = torch.nn.Parameter(torch.empty(input_size, dtype=dt))
            if config.normalization == "LayerNorm":
                self.layer_norm_bias = torch.nn.Parameter(torch.empty(input_size, dtype=dt))
        shape = (output_size // tp, input_size) if self.column else (output_size, input_size // tp)
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dt))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(shape[0], dtype=dt))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return _sharded(self, prefix, self.axes, sharded_offsets, metadata)


class _TELayerNormColumnStub(_TELinearStub):
    fused_norm = True


class _TERowStub(_TELinearStub):
    column = False
    axes = {"weight": 1}  # TERowParallelLinear: bias replicated


class _TENormStub(torch.nn.Module):
    """TENorm (te.pytorch.RMSNorm / LayerNorm): ``weight`` [and ``bias``]; no
    ``sharded_state_dict`` of its own, as TE's."""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__()
        dt = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dt))
        if config.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=dt))


class _TEAttentionStub(torch.nn.Module):
    """TEDotProductAttention: no parameters (softmax_type "vanilla"), empty sharded state."""

    def __init__(self, *_, **__):
        super().__init__()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}


def _is_te(obj) -> bool:
    from unittest import mock

    return isinstance(obj, mock.Mock) or (
        getattr(obj, "__module__", None) == "megatron.core.extensions.transformer_engine"
    )


def _swap(obj, stubs: dict, left: list):
    """Replace, in place, every TE class in a ModuleSpec tree by its stand-in (by identity: without
    TE the TE wrappers are MagicMock objects); TE classes without a stand-in go to ``left``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, _swap(getattr(obj, f.name), stubs, left))
        return obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap(x, stubs, left) for x in obj)
    if id(obj) in stubs:
        return stubs[id(obj)]
    if _is_te(obj):
        left.append(obj)
    return obj


@contextlib.contextmanager
def te_spec_without_te():
    """``build_model(use_te=True)`` builds Megatron's TE spec with the stand-ins (see the module
    docstring); everything is restored on exit (the rank pool is shared)."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from megatron_p3o.model import builder
    from megatron_p3o.runtime import mcore_compat

    stubs = {
        id(te.TELayerNormColumnParallelLinear): _TELayerNormColumnStub,
        id(te.TEColumnParallelLinear): _TELinearStub,
        id(te.TERowParallelLinear): _TERowStub,
        id(te.TENorm): _TENormStub,
        id(te.TEDotProductAttention): _TEAttentionStub,
    }
    real = mcore_compat.layer_spec

    def layer_spec(*, use_te, **kw):
        spec = real(use_te=use_te, **kw)
        if use_te:
            left: list = []
            _swap(spec, stubs, left)
            assert not left, f"TE modules without a stand-in in the TE spec: {left}"
        return spec

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(specs, "TESpecProvider", provider.TESpecProvider, raising=False)
        mp.setattr(provider, "is_te_min_version", lambda *a, **k: True)
        mp.setattr(mcore_compat, "layer_spec", layer_spec)
        mp.setattr(builder, "resolve_use_te", lambda opts: bool(opts.use_te))
        # the TE spec asks for TE's fused RoPE (a config check; no forward runs here)
        from megatron.core.models.common.embeddings import rope_utils

        mp.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None, raising=False)
        yield


# -- the body (one gloo rank) ------------------------------------------------------------------


def _converter_keys(desc, padded: int) -> dict:
    """Dist-checkpoint key → global shape of every tensor the converter writes / reads."""
    from megatron_p3o.model.hf.mapping import mcore_shape, split_layer, tensor_maps

    out = {}
    for tm in tensor_maps(desc):
        key, layer = split_layer(tm.mcore)
        shape = tuple(mcore_shape(tm, desc, padded))
        if layer is None:
            out[key] = shape
        elif tm.expert is not None:  # axes: layer, expert
            out[key] = (desc.num_layers, desc.num_experts) + shape
        else:
            out[key] = (desc.num_layers,) + shape
    return out


def _model_keys(model) -> dict:
    """Dist-checkpoint key → global shape of every tensor the model's sharded state asks for."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    out: dict = {}
    for st in nested_values(sd):
        if isinstance(st, ShardedTensor):  # TE _extra_state would be a ShardedObject
            shape = tuple(st.global_shape)
            assert out.setdefault(st.key, shape) == shape, (st.key, out[st.key], shape)
    return out


def spec_checkpoint_keys(groups, kind: str, use_te: bool, ckpt: str) -> dict:
    from megatron_p3o.checkpoint.state import load_model_state
    from megatron_p3o.model.builder import BuildOptions, build_model
    from megatron_p3o.model.description import ModelDescription
    from megatron_p3o.model.hf.dist_stream import build_meta_model, write_checkpoint
    from megatron_p3o.model.hf.mapping import canonical_name, tensor_maps

    desc = ModelDescription(**DESCS[kind])
    maps = tensor_maps(desc)
    index = {tm.mcore: i for i, tm in enumerate(maps)}
    opts = BuildOptions(seq_length=SEQ, make_vocab_size_divisible_by=DIVISIBLE_BY, use_te=use_te)
    ctx = te_spec_without_te() if use_te else contextlib.nullcontext()
    with ctx:
        with torch.device("meta"):
            (meta,) = build_model(desc, groups, opts)
        (model,) = build_model(desc, groups, opts)
    padded = meta.padded_vocab_size

    def source(tm):  # a distinct, reproducible full TP=1 tensor per canonical name
        from megatron_p3o.model.hf.mapping import mcore_shape

        g = torch.Generator().manual_seed(index[tm.mcore])
        return torch.randn(mcore_shape(tm, desc, padded), generator=g)

    # the converter's own writer (local-spec meta model) and a load into the model under test
    Path(ckpt).mkdir(parents=True)
    write_checkpoint(desc, groups, source, Path(ckpt), torch.float32, DIVISIBLE_BY)
    writer = build_meta_model(desc, groups, torch.float32, DIVISIBLE_BY)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    load_error = None
    try:
        load_model_state([model], ckpt)
    except Exception as e:  # the assertion below names it
        load_error = f"{type(e).__name__}: {e}"
    wrong = []
    live = {}
    for name, p in model.named_parameters():
        c = canonical_name(name, moe=desc.is_moe)
        live[name] = c
        if load_error is None and (c not in index or not torch.equal(p, source(maps[index[c]]))):
            wrong.append(name)
    return {
        "converter": _converter_keys(desc, padded),
        "writer": _model_keys(writer),
        "model": _model_keys(meta),
        "canonical": sorted(index),
        "live": live,
        "load_error": load_error,
        "wrong_values": wrong,
    }


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("use_te", [True, False], ids=["te_spec", "local_spec"])
@pytest.mark.parametrize("kind", list(DESCS))
def test_converted_checkpoint_fits_the_layer_spec(pools, tmp_path, kind, use_te):
    (r,) = pools(1).run(
        spec_checkpoint_keys, Layout(), kind=kind, use_te=use_te, ckpt=str(tmp_path / "ckpt")
    )
    conv = r["converter"]
    # the converter writes exactly what tensor_maps names (its meta model is the local spec)
    assert r["writer"] == conv
    # the model under this spec asks for exactly those keys, with the same global shapes
    missing = sorted(set(r["model"]) - set(conv))
    extra = sorted(set(conv) - set(r["model"]))
    assert not missing and not extra, f"asked for, not written: {missing}; unused: {extra}"
    assert r["model"] == conv
    if kind == "moe":
        assert "decoder.layers.pre_mlp_layernorm.weight" in conv
        assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" not in conv
    else:
        assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in conv
    # live export: every parameter canonicalises onto a distinct tensor_maps name, all covered
    assert sorted(set(r["live"].values())) == r["canonical"], r["live"]
    assert len(set(r["live"].values())) == len(r["live"])
    # and the converted checkpoint loads into this model, every value in place
    assert r["load_error"] is None, r["load_error"]
    assert not r["wrong_values"], r["wrong_values"]
