"""Trainer-side block FP8 (issue 24, item 1): the quantizer against a float64 reference, the FP8
checkpoint as transformers and SGLang read it, and the pushes an FP8 server receives.

References, none of them this project's code: a float64 block computation; transformers'
FineGrainedFP8 loader (on CPU it dequantizes at load); SGLang 0.5.23's own ``Fp8Config``,
``Fp8LinearMethod.create_weights`` (the parameters an FP8 server's linears hold and its weight
loaders fill) and ``block_quant_dequant``, run in the SGLang environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_p3o.weight_sync.fp8 import (
    dequantize_block,
    is_fp8_linear,
    quant_dequant_block,
    quantization_config,
    quantize_block,
    quantize_named,
    scale_name,
)
from tests.sglang_env import sglang_python

ROOT = Path(__file__).resolve().parents[2]


def _reference_blocks(w: torch.Tensor, b: int = 128):
    """float64: per-tile amax / 448 on the unpadded tiles."""
    w = w.double()
    n, k = w.shape
    rows, cols = -(-n // b), -(-k // b)
    scale = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = w[i * b : (i + 1) * b, j * b : (j + 1) * b].abs().max() / 448.0
    return scale


@pytest.mark.parametrize("shape", [(64, 32), (300, 200), (256, 384), (129, 1)])
def test_block_quantizer_against_float64(shape):
    torch.manual_seed(0)
    w = torch.randn(*shape) * torch.logspace(-3, 1, shape[1])  # columns over 4 decades
    q, s = quantize_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    ref = _reference_blocks(w)
    torch.testing.assert_close(s.double(), ref, rtol=1e-6, atol=0)
    deq = dequantize_block(q, s).double()
    # one e4m3 rounding: relative 2^-4 for normals, half the subnormal step (2^-10·scale) near 0
    tile_scale = ref.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    bound = w.double().abs() * 2**-4 + tile_scale * 2**-10 + 1e-30
    assert ((deq - w.double()).abs() <= bound).all()
    assert (deq - w.double()).abs().max() > 0  # it did round
    # every tile's largest element maps to ±448 (the scale uses the whole e4m3 range)
    assert q.float().abs().max() == 448.0


def test_named_quantization_covers_linears_only():
    named = [
        ("model.embed_tokens.weight", torch.randn(10, 8)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8)),
        ("model.layers.0.mlp.gate.weight", torch.randn(4, 8)),  # MoE router: kept
        ("model.layers.0.mlp.experts.3.down_proj.weight", torch.randn(8, 6)),
        ("model.layers.0.block_sparse_moe.experts.1.w2.weight", torch.randn(8, 6)),
        ("model.norm.weight", torch.randn(8)),
        ("lm_head.weight", torch.randn(10, 8)),
    ]
    out = dict(quantize_named(iter(named), dtype=torch.bfloat16))
    fp8 = {n for n, t in out.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8 == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.0.block_sparse_moe.experts.1.w2.weight",
    }
    for n in fp8:
        assert out[scale_name(n)].dtype == torch.float32
    assert out["lm_head.weight"].dtype == torch.bfloat16 and len(out) == len(named) + 3
    assert not is_fp8_linear("model.layers.0.self_attn.q_proj.bias", (8,))


def test_embedded_simulation_rounds_like_the_push():
    """The embedded engine's fp8_block weights are exactly what an FP8 server dequantizes."""
    from megatron_p3o.rollout.embedded import fp8_quant_dequant

    w = torch.randn(300, 200, dtype=torch.bfloat16)
    q, s = quantize_block(w)
    assert torch.equal(fp8_quant_dequant(w, 128), dequantize_block(q, s, torch.bfloat16))


def _export(ckpt, out, quantize=None):
    cmd = [sys.executable, "-m", "checkpoints_convert.megatron_to_hf", "--ckpt", str(ckpt),
           "--out", str(out)] + (["--quantize", quantize] if quantize else [])  # fmt: skip
    from tests.e2e.cli import ENV

    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def _tensors(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("which", ["base", "moe_base", "trained_export"])
def test_fp8_checkpoint_loads_in_transformers(which, request, tmp_path):
    """``megatron_to_hf --quantize fp8``: transformers' FP8 loader (dequantizing on CPU) gives
    back exactly the block-rounded weights, the rest of the model untouched; the logits stay
    within FP8 rounding of the unquantized export's. ``trained_export``: a checkpoint the
    trainer wrote at TP=2 × PP=2, read through its run directory (issue 41)."""
    from transformers import AutoModelForCausalLM

    src = request.getfixturevalue(which)
    ckpt = src[0] if which == "trained_export" else src / "ckpt"
    _export(ckpt, tmp_path / "ref")
    _export(ckpt, tmp_path / "fp8", quantize="fp8")
    cfg = json.loads((tmp_path / "fp8/config.json").read_text())
    assert cfg["quantization_config"] == quantization_config()
    ref, fp8 = _tensors(tmp_path / "ref"), _tensors(tmp_path / "fp8")
    quantized = [n for n in ref if is_fp8_linear(n, tuple(ref[n].shape))]
    assert quantized and all(fp8[n].dtype == torch.float8_e4m3fn for n in quantized)
    assert set(fp8) == set(ref) | {scale_name(n) for n in quantized}
    m_ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    m_fp8 = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    p_ref, p_fp8 = m_ref.state_dict(), m_fp8.state_dict()
    checked = 0
    for n in quantized:
        if n not in p_fp8:  # MoE experts: transformers fuses them (compared via the logits)
            continue
        torch.testing.assert_close(p_fp8[n], quant_dequant_block(ref[n]), rtol=0, atol=1e-7)
        assert (p_fp8[n] - p_ref[n]).abs().max() > 0
        checked += 1
    assert checked >= 2 * 7 if which == "base" else checked >= 2 * 4
    for n in ref:
        if n not in quantized and n in p_fp8:
            assert torch.equal(p_fp8[n], p_ref[n]), n
    ids = torch.arange(3, 15).remainder(cfg["vocab_size"])[None]
    with torch.no_grad():
        a = torch.log_softmax(m_ref(ids).logits, -1)
        b = torch.log_softmax(m_fp8(ids).logits, -1)
    diff = (a - b).abs().max().item()
    assert 0 < diff < 0.5, diff


_SGLANG_FP8 = r"""
import json, sys, torch
from safetensors.torch import load_file
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

spec = json.loads(sys.argv[1])
pushed = load_file(spec["pushed"])
cfg = Fp8Config.from_config(spec["quantization_config"])
out = {"block": cfg.weight_block_size, "serialized": cfg.is_checkpoint_fp8_serialized,
       "params": {}, "dequant_max_diff": 0.0, "merged": {}}
for name, (n, k) in spec["linears"].items():
    layer = torch.nn.Module()
    layer.tp_group = None
    Fp8LinearMethod(cfg).create_weights(layer, k, [n], k, n, torch.bfloat16, weight_loader=None)
    prefix = name[: -len("weight")]
    out["params"].update({prefix + p: [list(t.shape), str(t.dtype)]
                          for p, t in layer.named_parameters()})
    q, s = pushed[name], pushed[prefix + "weight_scale_inv"]
    deq = block_quant_dequant(q, s, cfg.weight_block_size, torch.float32)
    ref = pushed["ref." + name]
    out["dequant_max_diff"] = max(out["dequant_max_diff"], (deq - ref).abs().max().item())
for label, (sizes, k) in spec["merged"].items():  # SGLang's fused qkv / gate_up layers
    layer = torch.nn.Module()
    layer.tp_group = None
    try:
        Fp8LinearMethod(cfg).create_weights(layer, k, sizes, k, sum(sizes), torch.bfloat16,
                                            weight_loader=None)
        out["merged"][label] = list(layer.weight_scale_inv.shape)
    except ValueError as e:
        out["merged"][label] = str(e)
print(json.dumps(out))
"""


def test_pushed_fp8_buckets_match_sglangs_fp8_linear(tmp_path):
    """What an FP8 push sends (through the backend's real push path) has the names, shapes and
    dtypes SGLang 0.5.23's ``Fp8LinearMethod`` gives an FP8 checkpoint's linears, and SGLang's
    own dequantization of it equals the embedded simulation's rounding. The recipes' model sizes
    pass SGLang's fused-layer block check; a size off the 128 grid is refused there."""
    from megatron_p3o.rollout.backend import SGLangBackend
    from megatron_p3o.rollout.config import RolloutConfig
    from megatron_p3o.rollout.sglang import SGLangConfig
    from megatron_p3o.rollout.sglang.launch import cpu_stub_dir, server_env

    torch.manual_seed(0)
    hf = {
        "model.embed_tokens.weight": torch.randn(50, 256),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(256, 256),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(128, 256) * 0.01,
        "model.layers.0.mlp.down_proj.weight": torch.randn(256, 300),  # ragged last block
        "model.layers.0.mlp.experts.1.up_proj.weight": torch.randn(200, 256),
        "model.norm.weight": torch.randn(256),
        "lm_head.weight": torch.randn(50, 256),
    }

    class Weights:
        def to_rank0(self):
            return iter(list(hf.items()))

    class Engine:
        pushed = []

        def update_weights(self, buckets, version):
            for b in buckets:
                self.pushed += b

    backend = object.__new__(SGLangBackend)
    backend.cfg = RolloutConfig(engine="sglang", sglang=SGLangConfig(quantization="fp8"))
    backend.engine, backend.weights = Engine(), Weights()
    backend.evaluator = type("E", (), {})()
    backend._sync(3)
    pushed = dict(backend.engine.pushed)
    linears = {n: list(t.shape) for n, t in hf.items() if is_fp8_linear(n, tuple(t.shape))}
    assert len(linears) == 4
    blob = {n: t.contiguous() for n, t in pushed.items()}
    blob.update({"ref." + n: quant_dequant_block(hf[n]) for n in linears})
    save_file(blob, str(tmp_path / "pushed.safetensors"))
    spec = {
        "pushed": str(tmp_path / "pushed.safetensors"),
        "quantization_config": quantization_config(),
        "linears": linears,
        # Qwen3-8B: qkv [4096, 1024, 1024] x 4096, gate_up [12288, 12288] x 4096; a 64-wide model
        "merged": {"qwen3_8b_qkv": [[4096, 1024, 1024], 4096],
                   "qwen3_8b_gate_up": [[12288, 12288], 4096], "tiny_qkv": [[64, 32, 32], 64]},
    }  # fmt: skip
    py = sglang_python()
    env = server_env(cpu_libdir=cpu_stub_dir(py))
    r = subprocess.run([py, "-c", _SGLANG_FP8, json.dumps(spec)], capture_output=True, text=True,
                       env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["serialized"] and got["block"] == [128, 128]
    expected = {n: [list(t.shape), str(t.dtype)] for n, t in pushed.items() if n in got["params"]}
    assert got["params"] == expected and len(expected) == 2 * len(linears)
    assert got["dequant_max_diff"] == 0.0
    assert got["merged"]["qwen3_8b_qkv"] == [48, 32]
    assert got["merged"]["qwen3_8b_gate_up"] == [192, 32]
    assert "not divisible" in got["merged"]["tiny_qkv"]
    # everything else went as it was
    for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(pushed[n], hf[n])


def test_fp8_serving_refuses_a_bf16_checkpoint_and_gloo(tmp_path):
    from megatron_p3o.rollout.sglang import SGLangConfig
    from megatron_p3o.rollout.sglang.launch import launch_command
    from megatron_p3o.runtime.errors import UserError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cfg = SGLangConfig(model_path=str(tmp_path), quantization="fp8", device="cuda")
    with pytest.raises(UserError, match="--quantize fp8"):
        launch_command(cfg, python="/bin/true")
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": quantization_config()})
    )
    assert "--quantization" in launch_command(cfg, python="/bin/true")
    with pytest.raises(UserError, match="is a block-FP8 checkpoint"):  # and unquantized pushes
        launch_command(SGLangConfig(model_path=str(tmp_path), device="cuda"), python="/bin/true")
