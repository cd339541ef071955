"""The model description: what we need from a HuggingFace ``config.json`` to build a GPTModel.

Why: one small frozen record decouples the Megatron builder, the HF conversion and the rollout
engine from HF config classes. It is saved next to every Megatron checkpoint we write, so training
and export need no extra flags.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_p3o.runtime.errors import InputFileError, UserError

# architectures we can map, and the family that decides the layout details
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")


class UnsupportedModelError(UserError, ValueError):
    """The HF config describes a model this project cannot build or convert."""


@dataclass(frozen=True)
class ModelDescription:
    """A decoder-only Llama-family transformer, described in HF terms.

    Attributes:
        architecture: HF architecture class name, e.g. ``"Qwen3ForCausalLM"``.
        vocab_size: true vocabulary size (before padding to a multiple of TP).
        hidden_size: model width.
        intermediate_size: SwiGLU MLP width.
        num_layers: transformer layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA groups).
        head_dim: per-head width (Qwen3 sets it independently of hidden/heads).
        rope_theta: RoPE base.
        rope_scaling: HF ``rope_scaling`` dict (``llama3`` and ``linear`` supported) or None.
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: output layer shares the input embedding.
        qkv_bias: biases on q/k/v projections (Qwen2).
        qk_norm: RMSNorm on q and k per head (Qwen3).
        max_position_embeddings: longest sequence the config allows.
        sliding_window: attention window (Mistral v0.1); None when full attention.
        torch_dtype: dtype named in the HF config (informational).
        bos_token_id / eos_token_id / pad_token_id: special tokens, as in the HF config.
        num_experts: routed experts per MoE layer (0 = a dense model).
        num_experts_per_tok: top-k of the router.
        moe_intermediate_size: SwiGLU width of one expert.
        norm_topk_prob: renormalize the top-k router probabilities to sum to 1 (Qwen3-MoE's
            flag; Mixtral always does).
        router_aux_loss_coef: the load-balancing loss weight of the HF config (informational:
            training uses ``model.moe_aux_loss_coeff``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    sliding_window: Optional[int] = None
    torch_dtype: str = "float32"
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None
    pad_token_id: Optional[int] = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "ModelDescription":
        """Read an HF ``config.json`` dict; refuse architectures and features we cannot map."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:  # configs made in code carry only model_type
            arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}.get(cfg.get("model_type"))
        if arch is None:
            raise UnsupportedModelError(
                f"{source}: architectures={archs} (model_type={cfg.get('model_type')!r}) is not "
                f"supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act={act!r}; only 'silu' (SwiGLU) is supported"
            )
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
        heads = int(cfg["num_attention_heads"])
        # transformers < 5 writes rope_scaling + rope_theta; >= 5 writes rope_parameters
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or {
            k: v for k, v in rope_params.items() if k != "rope_theta"
        }
        if rope_scaling:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind == "default":
                rope_scaling = None
            elif kind not in ("llama3", "linear"):
                raise UnsupportedModelError(
                    f"{source}: rope_scaling type {kind!r} is not supported (llama3, linear are)"
                )
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        window = (
            cfg.get("sliding_window")
            if cfg.get("use_sliding_window", family == "mistral")
            else None
        )
        if family == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(cfg.get("attention_bias", False))
        moe = _moe_fields(cfg, family, source)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            sliding_window=int(window) if window else None,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            **moe,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelDescription":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise InputFileError(f"no config.json in HF model directory {path}")
        return cls.from_hf_config(json.loads(cfg_path.read_text()), source=str(cfg_path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelDescription":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model description: unknown keys {unknown}")
        return cls(**d)


def _moe_fields(cfg: dict, family: str, source: str) -> dict:
    """The MoE part of a Qwen3-MoE / Mixtral config; refuses MoE variants not implemented
    (shared experts, DeepSeek's grouped routing, dense layers between MoE layers)."""
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(key):
            raise UnsupportedModelError(
                f"{source}: {key}={cfg[key]}: shared experts are not supported "
                "(Qwen3-MoE and Mixtral routed experts only)"
            )
    for key in ("n_group", "topk_group"):
        if cfg.get(key) not in (None, 0, 1):
            raise UnsupportedModelError(
                f"{source}: {key}={cfg[key]}: grouped (DeepSeek-style) routing is not supported"
            )
    if family not in MOE_FAMILIES:
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            raise UnsupportedModelError(
                f"{source}: experts in a {family} config; MoE is supported for Qwen3-MoE and "
                "Mixtral"
            )
        return {}
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError(
            f"{source}: mlp_only_layers={cfg.get('mlp_only_layers')}, decoder_sparse_step="
            f"{cfg.get('decoder_sparse_step')}: dense layers between MoE layers are not supported"
        )
    if family == "qwen3_moe":
        # transformers >= 5 writes Qwen3-MoE's num_experts as num_local_experts
        experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
        ffn = int(cfg["moe_intermediate_size"])
        norm = bool(cfg.get("norm_topk_prob", False))
    else:  # Mixtral: softmax over the selected experts' logits, i.e. normalized top-k
        experts, ffn, norm = int(cfg["num_local_experts"]), int(cfg["intermediate_size"]), True
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=ffn,
        norm_topk_prob=norm,
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
    )


_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}


def description_to_hf_config(desc: ModelDescription, dtype: str = "float32") -> dict:
    """A ``config.json`` for ``desc`` (used on export when the source config is not at hand)."""
    cfg = {
        "architectures": [desc.architecture],
        "model_type": _MODEL_TYPES[desc.family],
        "vocab_size": desc.vocab_size,
        "hidden_size": desc.hidden_size,
        "intermediate_size": desc.intermediate_size,
        "num_hidden_layers": desc.num_layers,
        "num_attention_heads": desc.num_heads,
        "num_key_value_heads": desc.num_kv_heads,
        "head_dim": desc.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": desc.rms_norm_eps,
        "rope_theta": desc.rope_theta,
        "rope_scaling": desc.rope_scaling,
        "tie_word_embeddings": desc.tie_word_embeddings,
        "max_position_embeddings": desc.max_position_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": desc.bos_token_id,
        "eos_token_id": desc.eos_token_id,
        "pad_token_id": desc.pad_token_id,
    }
    if desc.family == "qwen2":
        cfg["use_sliding_window"] = False
    elif desc.family == "llama":
        cfg["attention_bias"] = desc.qkv_bias
        cfg["mlp_bias"] = False
    elif desc.family == "mistral":
        cfg["sliding_window"] = desc.sliding_window
    elif desc.family in ("qwen3", "qwen3_moe"):
        cfg["attention_bias"] = desc.qkv_bias
    if desc.family == "qwen3_moe":
        cfg.update(
            num_experts=desc.num_experts,
            num_experts_per_tok=desc.num_experts_per_tok,
            moe_intermediate_size=desc.moe_intermediate_size,
            norm_topk_prob=desc.norm_topk_prob,
            router_aux_loss_coef=desc.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif desc.family == "mixtral":
        cfg.update(
            num_local_experts=desc.num_experts,
            num_experts_per_tok=desc.num_experts_per_tok,
            intermediate_size=desc.moe_intermediate_size,
            router_aux_loss_coef=desc.router_aux_loss_coef,
        )
    return cfg
