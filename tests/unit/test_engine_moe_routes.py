"""The embedded engine on a Qwen3-MoE model: it loads per-expert checkpoint names into
transformers' fused expert parameters, and records, for every token it feeds through the model,
each layer's top-k experts — checked against a teacher-forced transformers forward of the whole
sequence (its own routers' choices), position by position."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_p3o.rollout.embedded import EmbeddedEngine
from megatron_p3o.types import SamplingParams

PROMPTS = [[1, 2, 3, 4], [7, 8], [9, 10, 11, 12, 13, 14]]


def _model(tmp_path):
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         norm_topk_prob=True, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    m.save_pretrained(tmp_path / "hf")
    return m, load_file(tmp_path / "hf" / "model.safetensors")


# with a third of the vocabulary as stop tokens rows finish at different steps and leave the
# later forwards: the routes recorded must still be each row's own
@pytest.mark.parametrize("stop", [(), tuple(range(0, 64, 3))])
def test_moe_engine_loads_per_expert_names_and_records_routes(tmp_path, stop):
    model, sd = _model(tmp_path)
    assert any(".experts.3.down_proj." in k for k in sd)  # checkpoint names, not fused ones
    eng = EmbeddedEngine(model.config.to_dict(), "fp32")
    eng.update_weights([list(sd.items())], 1)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(eng.model(input_ids=ids).logits, model(input_ids=ids).logits)
    samples = eng.generate(
        PROMPTS, 2, SamplingParams(max_new_tokens=6, seed=3, stop_token_ids=stop)
    )
    if stop:
        assert len({len(s.completion_ids) for s in samples}) > 1
    seen = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[2]))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        for s in samples:
            seq = s.prompt_ids + s.completion_ids
            r = s.routed_experts
            assert r is not None and tuple(r.shape) == (len(seq) - 1, 2, 2), r.shape
            with torch.no_grad():
                model(input_ids=torch.tensor([seq]))
            for layer in range(2):
                want = seen[layer][: len(seq) - 1].sort(-1).values
                got = r[:, layer].long().sort(-1).values
                assert torch.equal(got, want), (layer, got, want)
    finally:
        for h in hooks:
            h.remove()


def test_moe_engine_refuses_a_missing_expert(tmp_path):
    model, sd = _model(tmp_path)
    eng = EmbeddedEngine(model.config.to_dict(), "fp32")
    partial = [(k, v) for k, v in sd.items() if ".experts.2.up_proj." not in k]
    try:
        eng.update_weights([partial], 1)
    except ValueError as e:
        assert "gate_up_proj" in str(e)
    else:
        raise AssertionError("a missing expert slice was accepted")
