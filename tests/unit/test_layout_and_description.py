import pytest

from megatron_p3o.model.builder import padded_vocab_size
from megatron_p3o.model.description import ModelDescription, UnsupportedModelError
from megatron_p3o.runtime.parallel import Layout, LayoutError


def test_layout_resolves_dp():
    assert Layout(tp=2, pp=2).resolve(8).dp == 2
    assert Layout(cp=2).resolve(2).dp == 1


@pytest.mark.parametrize(
    "layout,world,needle",
    [
        (Layout(tp=3), 4, "world size 4 is not divisible by tp×pp×cp = 3×1×1 = 3"),
        (Layout(tp=2, dp=4), 4, "dp=4 but world size 4 / (tp×pp×cp = 2) = 2"),
        (Layout(tp=0), 4, "tp=0 must be >= 1"),
        (Layout(vpp=2), 2, "vpp=2 needs pp >= 2"),
        (Layout(sequence_parallel=True), 2, "sequence_parallel=True needs tp > 1"),
    ],
)
def test_impossible_layouts_name_the_numbers(layout, world, needle):
    with pytest.raises(LayoutError) as e:
        layout.resolve(world)
    assert needle in str(e.value)


def test_model_and_sequence_checks():
    lay = Layout(tp=4, pp=2, cp=2).resolve(16)
    with pytest.raises(LayoutError, match="num_attention_heads=6 is not divisible by tp=4"):
        lay.check_model(num_layers=4, num_heads=6, num_kv_heads=2)
    with pytest.raises(LayoutError, match="num_key_value_heads=2 is not divisible by tp=4"):
        lay.check_model(num_layers=4, num_heads=8, num_kv_heads=2)
    with pytest.raises(LayoutError, match="num_layers=3 is not divisible by pp×vpp = 2×1 = 2"):
        lay.check_model(num_layers=3, num_heads=8, num_kv_heads=4)
    with pytest.raises(LayoutError, match="sequence length 30 is not divisible by 2×cp = 4"):
        lay.check_sequence(30)
    lay.check_sequence(32)


def test_padded_vocab_is_tp_invariant_for_powers_of_two():
    assert {padded_vocab_size(300, tp) for tp in (1, 2, 4, 8)} == {384}
    assert padded_vocab_size(300, 3) % 3 == 0 and padded_vocab_size(300, 3) >= 300
    assert padded_vocab_size(256, 1, 128) == 256


def _hf(**kw):
    base = dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
    )
    base.update(kw)
    return base


def test_description_reads_hf_fields():
    d = ModelDescription.from_hf_config(_hf())
    assert (d.family, d.head_dim, d.qk_norm, d.qkv_bias, d.tie_word_embeddings) == (
        "qwen3",
        32,
        True,
        False,
        True,
    )
    q2 = ModelDescription.from_hf_config(_hf(architectures=["Qwen2ForCausalLM"], head_dim=None))
    assert q2.qkv_bias and not q2.qk_norm and q2.head_dim == 16
    assert ModelDescription.from_dict(d.to_dict()) == d


def test_description_refuses_unsupported():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelDescription.from_hf_config(_hf(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(UnsupportedModelError, match="rope_scaling type 'yarn'"):
        ModelDescription.from_hf_config(_hf(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        ModelDescription.from_hf_config(_hf(hidden_act="gelu"))


def _moe_cfg(**kw):
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32,
               intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
               num_experts_per_tok=2, norm_topk_prob=False, router_aux_loss_coef=0.001)  # fmt: skip
    cfg.update(kw)
    return cfg


def test_moe_descriptions_and_refusals():
    from megatron_p3o.model.description import (
        ModelDescription,
        UnsupportedModelError,
        description_to_hf_config,
    )

    d = ModelDescription.from_hf_config(_moe_cfg())
    assert (d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size) == (4, 2, 16)
    assert d.is_moe and d.qk_norm and not d.norm_topk_prob
    assert ModelDescription.from_hf_config(description_to_hf_config(d)) == d
    mix = dict(architectures=["MixtralForCausalLM"], vocab_size=64, hidden_size=32,
               intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)  # fmt: skip
    m = ModelDescription.from_hf_config(mix)
    assert (m.num_experts, m.moe_intermediate_size, m.norm_topk_prob, m.qk_norm) == (
        8, 48, True, False)  # fmt: skip
    for bad, what in (
        (dict(shared_expert_intermediate_size=64), "shared experts"),
        (dict(n_group=4, topk_group=2), "grouped"),
        (dict(mlp_only_layers=[0]), "dense layers between MoE layers"),
        (dict(decoder_sparse_step=2), "dense layers between MoE layers"),
    ):
        with pytest.raises(UnsupportedModelError, match=what):
            ModelDescription.from_hf_config(_moe_cfg(**bad))
