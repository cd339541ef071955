"""HuggingFace ↔ Megatron-Core tensor mapping for the Llama family (Llama 2/3/3.1, Qwen2/2.5,
Qwen3, Mistral): names, shapes, fused QKV and gate/up, vocabulary padding, TP split dims.

Why one table: checkpoint conversion (both directions) and live weight sync to the rollout
engine must agree exactly, so both are driven by :func:`tensor_maps` and the two pure functions
:func:`to_mcore` / :func:`to_hf`.

Megatron names here are *canonical*: the TP=1 name with a global layer index and Transformer
Engine's norm names (``linear_qkv.layer_norm_weight``), which is also what Megatron's
dist-checkpoint keys use for the local layer spec. The pre-MLP norm is fused into ``linear_fc1``
only in a dense layer (``mlp.linear_fc1.layer_norm_weight``); an MoE layer keeps it standalone
(``pre_mlp_layernorm.weight``), as Transformer Engine's MoE spec does and as
:func:`megatron_p3o.runtime.mcore_compat.layer_spec` makes the local MoE spec do, so one checkpoint
loads
under either spec. Fused layouts (TP=1):
    linear_qkv  [g·(q/g + 2)·d, h]: per query group g: its q heads, then k_g, then v_g
    linear_fc1  [2·i, h]: gate rows, then up rows
    embedding / output_layer [V_pad, h]: HF rows then zero padding rows
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron_p3o.model.description import ModelDescription
from megatron_p3o.runtime.errors import UserError


class MappingError(UserError, ValueError):
    """A tensor is missing or has the wrong shape; the message names it and both shapes."""


@dataclass(frozen=True)
class TensorMap:
    """One Megatron tensor and the HF tensors it is made of.

    Attributes:
        mcore: canonical Megatron name (TP=1, global layer index).
        hf: HF names, in fusion order.
        kind: "copy", "vocab" (row padding), "qkv" or "fc1" (fusions).
        tp_dim: dimension split over TP ranks (None: replicated).
        layer: global layer index, or None for embedding / final norm / output layer.
        expert: global expert index of a routed expert's tensor (MoE), else None.
    """

    mcore: str
    hf: Tuple[str, ...]
    kind: str
    tp_dim: Optional[int]
    layer: Optional[int] = None
    expert: Optional[int] = None


# a layer's pre-MLP norm: fused into linear_fc1 in a dense layer (TE's dense spec), a module of
# its own in an MoE layer (TE's MoE spec, and the local MoE spec: mcore_compat.layer_spec)
PRE_MLP_NORM_DENSE = "mlp.linear_fc1.layer_norm_weight"
PRE_MLP_NORM_MOE = "pre_mlp_layernorm.weight"
# local (non-TE) layer-spec module names → canonical (TE) names; the second table only for a
# dense layer (an MoE layer's live pre-MLP norm name is canonical in both specs)
_LOCAL_TO_CANONICAL = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}
_LOCAL_TO_CANONICAL_DENSE = {PRE_MLP_NORM_MOE: PRE_MLP_NORM_DENSE}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# a routed expert's tensor: canonical ``mlp.experts.{e}.x``, live
# ``mlp.experts.local_experts.{e}.x`` (SequentialMLP) or ``mlp.experts.linear_fc1.weight{e}``
# (TEGroupedMLP: TE's GroupedLinear names its GEMMs' weights ``weight{i}``), dist-checkpoint key
# ``decoder.layers.mlp.experts.experts.x`` for both (layer and expert are axes)
_EXPERT_RE = re.compile(r"^mlp\.experts\.(?:local_experts\.)?(\d+)\.(.+)$")
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
EXPERT_KEY = "mlp.experts.experts."


# per-expert checkpoint names of each MoE family: (block, gate, up, down) in
# ``model.layers.{i}.{block}.experts.{e}.{gate|up|down}.weight``; the router is ``{block}.gate``
MOE_HF_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}
_MOE_HF_RE = re.compile(r"^model\.layers\.(\d+)\.(\w+)\.(?:experts\.(\d+)\.(\w+)|gate)\.weight$")


def moe_hf_names(desc: ModelDescription, layer: int) -> dict:
    """HF names of one MoE layer: ``router`` and, per expert e, ``gate(e)``/``up(e)``/``down(e)``
    (the per-expert names of the checkpoint files; transformers >= 5 fuses them in memory)."""
    block, gate, up, down = MOE_HF_NAMES[desc.family]
    b = f"model.layers.{layer}.{block}."
    return {
        "router": b + "gate.weight",
        "gate": lambda e: f"{b}experts.{e}.{gate}.weight",
        "up": lambda e: f"{b}experts.{e}.{up}.weight",
        "down": lambda e: f"{b}experts.{e}.{down}.weight",
    }


def parse_moe_hf_name(name: str):
    """``(layer, expert, role)`` of a routed expert's checkpoint tensor (role: gate, up or
    down), ``(layer, None, "router")`` of a router's, or None for any other name."""
    m = _MOE_HF_RE.match(name)
    if m is None:
        return None
    layer, block, expert, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    for b, *kinds in MOE_HF_NAMES.values():
        if b != block:
            continue
        if expert is None:
            return layer, None, "router"
        if kind in kinds:
            return layer, int(expert), ("gate", "up", "down")[kinds.index(kind)]
    return None


def _mlp_maps(desc: ModelDescription, i: int) -> List[TensorMap]:
    """The MLP tensors of layer ``i``: dense SwiGLU, or the router and every routed expert."""
    p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    if not desc.is_moe:
        return [
            TensorMap(
                p + "mlp.linear_fc1.weight",
                (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                "fc1",
                0,
                i,
            ),
            TensorMap(p + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "copy", 1, i),
        ]
    n = moe_hf_names(desc, i)
    maps = [TensorMap(p + "mlp.router.weight", (n["router"],), "copy", None, i)]
    for e in range(desc.num_experts):
        q = f"{p}mlp.experts.{e}."
        maps += [
            TensorMap(q + "linear_fc1.weight", (n["gate"](e), n["up"](e)), "fc1", 0, i, e),
            TensorMap(q + "linear_fc2.weight", (n["down"](e),), "copy", 1, i, e),
        ]
    return maps


def tensor_maps(desc: ModelDescription) -> List[TensorMap]:
    """Every Megatron tensor of the model, in checkpoint order."""
    maps = [
        TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0)
    ]
    for i in range(desc.num_layers):
        p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = [f"{h}self_attn.{x}_proj.weight" for x in "qkv"]
        maps += [
            TensorMap(
                p + "self_attention.linear_qkv.layer_norm_weight",
                (h + "input_layernorm.weight",),
                "copy",
                None,
                i,
            ),
            TensorMap(p + "self_attention.linear_qkv.weight", tuple(attn), "qkv", 0, i),
        ]
        if desc.qkv_bias:
            maps.append(
                TensorMap(
                    p + "self_attention.linear_qkv.bias",
                    tuple(f"{h}self_attn.{x}_proj.bias" for x in "qkv"),
                    "qkv",
                    0,
                    i,
                )
            )
        if desc.qk_norm:
            maps += [
                TensorMap(
                    p + "self_attention.q_layernorm.weight",
                    (h + "self_attn.q_norm.weight",),
                    "copy",
                    None,
                    i,
                ),
                TensorMap(
                    p + "self_attention.k_layernorm.weight",
                    (h + "self_attn.k_norm.weight",),
                    "copy",
                    None,
                    i,
                ),
            ]
        maps += [
            TensorMap(
                p + "self_attention.linear_proj.weight",
                (h + "self_attn.o_proj.weight",),
                "copy",
                1,
                i,
            ),
            TensorMap(
                p + (PRE_MLP_NORM_MOE if desc.is_moe else PRE_MLP_NORM_DENSE),
                (h + "post_attention_layernorm.weight",),
                "copy",
                None,
                i,
            ),
        ]
        maps += _mlp_maps(desc, i)
    maps.append(TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None))
    if not desc.tie_word_embeddings:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), "vocab", 0))
    return maps


def hf_shapes(desc: ModelDescription) -> Dict[str, Tuple[int, ...]]:
    """The shape of every HF tensor the model must have."""
    H, I, V, d = desc.hidden_size, desc.intermediate_size, desc.vocab_size, desc.head_dim  # noqa: E741
    q, kv = desc.num_heads * d, desc.num_kv_heads * d
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not desc.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    for i in range(desc.num_layers):
        h = f"model.layers.{i}."
        out.update(
            {
                h + "input_layernorm.weight": (H,),
                h + "post_attention_layernorm.weight": (H,),
                h + "self_attn.q_proj.weight": (q, H),
                h + "self_attn.k_proj.weight": (kv, H),
                h + "self_attn.v_proj.weight": (kv, H),
                h + "self_attn.o_proj.weight": (H, q),
            }
        )
        if desc.is_moe:
            n, f = moe_hf_names(desc, i), desc.moe_intermediate_size
            out[n["router"]] = (desc.num_experts, H)
            for e in range(desc.num_experts):
                out.update({n["gate"](e): (f, H), n["up"](e): (f, H), n["down"](e): (H, f)})
        else:
            out.update(
                {
                    h + "mlp.gate_proj.weight": (I, H),
                    h + "mlp.up_proj.weight": (I, H),
                    h + "mlp.down_proj.weight": (H, I),
                }
            )
        if desc.qkv_bias:
            out.update(
                {
                    h + "self_attn.q_proj.bias": (q,),
                    h + "self_attn.k_proj.bias": (kv,),
                    h + "self_attn.v_proj.bias": (kv,),
                }
            )
        if desc.qk_norm:
            out.update({h + "self_attn.q_norm.weight": (d,), h + "self_attn.k_norm.weight": (d,)})
    return out


def mcore_shape(tm: TensorMap, desc: ModelDescription, padded_vocab: int) -> Tuple[int, ...]:
    """Global (TP=1) shape of a Megatron tensor."""
    shapes = hf_shapes(desc)
    if tm.kind == "vocab":
        return (padded_vocab, desc.hidden_size)
    if tm.kind in ("qkv", "fc1"):
        parts = [shapes[n] for n in tm.hf]
        return (sum(p[0] for p in parts),) + tuple(parts[0][1:])
    return shapes[tm.hf[0]]


def _qkv_groups(desc: ModelDescription) -> Tuple[int, int, int]:
    return desc.num_kv_heads, desc.num_heads // desc.num_kv_heads, desc.head_dim


def to_mcore(
    tm: TensorMap, hf: Sequence[Tensor], desc: ModelDescription, padded_vocab: int
) -> Tensor:
    """Build the TP=1 Megatron tensor from its HF tensors (in ``tm.hf`` order)."""
    if tm.kind == "copy":
        return hf[0]
    if tm.kind == "vocab":
        (w,) = hf
        if padded_vocab == w.shape[0]:
            return w
        out = w.new_zeros((padded_vocab,) + tuple(w.shape[1:]))
        out[: w.shape[0]] = w
        return out
    if tm.kind == "fc1":
        return torch.cat(list(hf), 0)
    g, qpg, d = _qkv_groups(desc)
    q, k, v = hf
    rest = tuple(q.shape[1:])
    fused = torch.cat(
        [q.reshape((g, qpg * d) + rest), k.reshape((g, d) + rest), v.reshape((g, d) + rest)], 1
    )
    return fused.reshape((g * (qpg + 2) * d,) + rest)


def to_hf(tm: TensorMap, t: Tensor, desc: ModelDescription) -> Dict[str, Tensor]:
    """Split a TP=1 Megatron tensor into its HF tensors (padding rows dropped)."""
    if tm.kind == "copy":
        return {tm.hf[0]: t}
    if tm.kind == "vocab":
        return {tm.hf[0]: t[: desc.vocab_size]}
    if tm.kind == "fc1":
        gate, up = t.chunk(2, 0)
        return {tm.hf[0]: gate, tm.hf[1]: up}
    g, qpg, d = _qkv_groups(desc)
    rest = tuple(t.shape[1:])
    grouped = t.reshape((g, (qpg + 2) * d) + rest)
    q, k, v = grouped.split([qpg * d, d, d], 1)
    return {
        tm.hf[0]: q.reshape((g * qpg * d,) + rest),
        tm.hf[1]: k.reshape((g * d,) + rest),
        tm.hf[2]: v.reshape((g * d,) + rest),
    }


def canonical_name(
    module_name: str, layer_offset: int = 0, expert_offset: int = 0, *, moe: bool = False
) -> str:
    """A live model's parameter name (either layer spec, stage-local layer index, EP-rank-local
    expert index) → canonical. ``moe``: the model's layers are MoE layers (their pre-MLP norm
    keeps its live name; a dense layer's local ``pre_mlp_layernorm`` is TE's fused norm)."""
    name = module_name[len("module.") :] if module_name.startswith("module.") else module_name
    m = _LAYER_RE.match(name)
    if not m:
        return name
    rest = m.group(2)
    rest = _LOCAL_TO_CANONICAL.get(rest, rest)
    if not moe:
        rest = _LOCAL_TO_CANONICAL_DENSE.get(rest, rest)
    x = _EXPERT_RE.match(rest)
    if x:
        rest = f"mlp.experts.{int(x.group(1)) + expert_offset}.{x.group(2)}"
    g = _GROUPED_EXPERT_RE.match(rest)
    if g:
        rest = f"mlp.experts.{int(g.group(3)) + expert_offset}.{g.group(1)}.{g.group(2)}"
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{rest}"


def split_layer(canonical: str) -> Tuple[str, Optional[int]]:
    """``decoder.layers.3.x`` → (``decoder.layers.x``, 3): the dist-checkpoint key and layer
    (a routed expert's key is ``decoder.layers.mlp.experts.experts.x``: see
    :func:`split_expert`)."""
    m = _LAYER_RE.match(canonical)
    if not m:
        return canonical, None
    x = _EXPERT_RE.match(m.group(2))
    rest = EXPERT_KEY + x.group(2) if x else m.group(2)
    return f"decoder.layers.{rest}", int(m.group(1))


def expert_canonical(key: str, layer: int, expert: int) -> str:
    """The canonical name of a dist-checkpoint expert chunk (key without layer and expert)."""
    rest = key[len("decoder.layers.") + len(EXPERT_KEY) :]
    return f"decoder.layers.{layer}.mlp.experts.{expert}.{rest}"
