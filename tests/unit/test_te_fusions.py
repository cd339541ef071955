"""Issue 24, item 8 (the RoPE part): under Transformer Engine the model asks Megatron for TE's
fused RoPE — Megatron's unfused THD path loops over the packed sequences on the host (about
four device→host syncs per layer per forward). TE cannot be installed here: the config is
captured at Megatron's constructor, with ``use_te`` resolved as on a GPU node."""

import pytest

from megatron_p3o.model import builder
from megatron_p3o.model.builder import BuildOptions, transformer_config
from megatron_p3o.model.description import ModelDescription
from megatron_p3o.runtime.parallel import Layout, initialize


@pytest.mark.parametrize("use_te", [True, False])
def test_rope_fusion_follows_the_layer_spec(use_te, monkeypatch):
    import megatron.core.transformer.transformer_config as tc

    seen = {}
    monkeypatch.setattr(tc, "TransformerConfig", lambda **kw: seen.update(kw))
    monkeypatch.setattr(builder, "resolve_use_te", lambda opts: use_te)
    desc = ModelDescription.from_hf_config(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32,
         "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    )  # fmt: skip
    transformer_config(desc, initialize(Layout()), BuildOptions(seq_length=32))
    assert seen["apply_rope_fusion"] is use_te


MOE_HF = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32,
          "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "norm_topk_prob": True, "head_dim": 16}  # fmt: skip


@pytest.mark.parametrize("use_te", [True, False])
def test_fusions_follow_the_layer_spec(use_te, monkeypatch):
    """Issue 42, item 5: under TE the fusions megatron-core 0.16.1 offers are on (where the
    kernels they need exist); the local (CPU) spec keeps every one off, as before."""
    import megatron.core.transformer.transformer_config as tc

    from megatron_p3o.runtime import mcore_compat

    seen = {}
    monkeypatch.setattr(tc, "TransformerConfig", lambda **kw: seen.update(kw))
    monkeypatch.setattr(builder, "resolve_use_te", lambda opts: use_te)
    monkeypatch.setattr(mcore_compat, "have_grad_accum_fusion", lambda: True)
    monkeypatch.setattr(mcore_compat, "have_moe_permute_fusion", lambda: True)
    desc = ModelDescription.from_hf_config(MOE_HF)
    transformer_config(desc, initialize(Layout()), BuildOptions(seq_length=32))
    for flag in ("bias_activation_fusion", "masked_softmax_fusion",
                 "gradient_accumulation_fusion", "moe_permute_fusion"):  # fmt: skip
        assert seen[flag] is use_te, (flag, seen[flag])


def test_fusions_whose_kernels_are_missing_stay_off(monkeypatch):
    import megatron.core.transformer.transformer_config as tc

    from megatron_p3o.runtime import mcore_compat

    seen = {}
    monkeypatch.setattr(tc, "TransformerConfig", lambda **kw: seen.update(kw))
    monkeypatch.setattr(builder, "resolve_use_te", lambda opts: True)
    monkeypatch.setattr(mcore_compat, "have_grad_accum_fusion", lambda: False)
    monkeypatch.setattr(mcore_compat, "have_moe_permute_fusion", lambda: False)
    desc = ModelDescription.from_hf_config(MOE_HF)
    transformer_config(desc, initialize(Layout()), BuildOptions(seq_length=32))
    assert not seen["gradient_accumulation_fusion"] and not seen["moe_permute_fusion"]
    assert (
        not mcore_compat.have_moe_permute_fusion.__wrapped__()
        if hasattr(mcore_compat.have_moe_permute_fusion, "__wrapped__")
        else True
    )


def test_this_machine_has_neither_kernel():
    from megatron_p3o.runtime import mcore_compat

    assert not mcore_compat.have_moe_permute_fusion()  # no TE here
    assert not mcore_compat.have_grad_accum_fusion()  # no apex here


@pytest.mark.parametrize("use_te", [True, False])
def test_grouped_gemm_follows_the_layer_spec(use_te, monkeypatch):
    """Issue 42, item 5: under TE (with TEGroupedMLP) the routed experts run as one grouped GEMM,
    config and spec alike; the local spec keeps the sequential expert loop."""
    import megatron.core.transformer.transformer_config as tc

    from megatron_p3o.runtime import mcore_compat

    seen, spec_args = {}, {}
    monkeypatch.setattr(tc, "TransformerConfig", lambda **kw: seen.update(kw))
    monkeypatch.setattr(builder, "resolve_use_te", lambda opts: use_te)
    monkeypatch.setattr(mcore_compat, "have_te_grouped_gemm", lambda fp8=False: True)
    desc = ModelDescription.from_hf_config(MOE_HF)
    opts = BuildOptions(seq_length=32)
    transformer_config(desc, initialize(Layout()), opts)
    assert seen["moe_grouped_gemm"] is use_te
    assert builder.use_grouped_gemm(desc, opts) is use_te  # what build_model gives the spec
    from megatron.core.models.gpt import gpt_layer_specs as specs

    monkeypatch.setattr(
        specs, "get_gpt_layer_with_transformer_engine_spec", lambda **kw: spec_args.update(kw)
    )
    mcore_compat.layer_spec(use_te=True, qk_norm=True, num_experts=4, grouped_gemm=True)
    assert spec_args["moe_grouped_gemm"] is True


def test_grouped_expert_names_map_like_sequential_ones():
    """TEGroupedMLP's live parameters are ``mlp.experts.linear_fc{1,2}.weight{e}`` (TE's
    GroupedLinear names its GEMMs' weights ``weight{i}``; read from the pinned megatron-core), and
    they map to the same canonical expert tensors as SequentialMLP's, EP offset included."""
    import inspect
    from pathlib import Path

    import megatron.core.extensions.transformer_engine as te_ext
    from megatron.core.transformer.moe import experts

    from megatron_p3o.model.hf.mapping import canonical_name, split_layer, tensor_maps

    src = inspect.getsource(experts.TEGroupedMLP)
    assert "self.linear_fc1 = build_module" in src and "self.linear_fc2 = build_module" in src
    assert "f'{name}.weight{i}'" in src  # its sharded_state_dict reads these live names
    assert 'full_state_dict[f"weight{gemm_idx}"]' in Path(te_ext.__file__).read_text()
    assert "interchangable with SequentialMLP" in src  # one checkpoint key for both layouts

    desc = ModelDescription.from_hf_config(MOE_HF)
    known = {tm.mcore for tm in tensor_maps(desc)}
    for layer in (0, 1):
        for e in range(2):  # this rank's experts 0,1 are global experts 2,3 (ep rank 1 of 2)
            for fc in ("linear_fc1", "linear_fc2"):
                seq = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{fc}.weight"
                grp = f"decoder.layers.{layer}.mlp.experts.{fc}.weight{e}"
                a = canonical_name(seq, 0, 2, moe=True)
                b = canonical_name(grp, 0, 2, moe=True)
                assert a == b == f"decoder.layers.{layer}.mlp.experts.{e + 2}.{fc}.weight"
                assert b in known
                assert split_layer(b) == (f"decoder.layers.mlp.experts.experts.{fc}.weight", layer)


def test_no_grouped_gemm_without_te():
    from megatron_p3o.runtime import mcore_compat

    assert not mcore_compat.have_te_grouped_gemm()  # no TE here: the sequential loop
