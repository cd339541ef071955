"""Issue 24, item 8 (the RoPE part): under Transformer Engine the model asks Megatron for TE's
fused RoPE — Megatron's unfused THD path loops over the packed sequences on the host (about
four device→host syncs per layer per forward). TE cannot be installed here: the config is
captured at Megatron's constructor, with ``use_te`` resolved as on a GPU node."""

import pytest

from megatron_p3o.model import builder
from megatron_p3o.model.builder import BuildOptions, transformer_config
from megatron_p3o.model.description import ModelDescription
from megatron_p3o.parallel import Layout, initialize


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
