"""Block FP8 (e4m3, 128×128 scales): the one quantizer of the CPU simulation, the FP8 HF
checkpoint the servers load, and every weight push to an FP8 server.

Why trainer-side: SGLang's online FP8 quantization (``--quantization fp8`` on a bf16 checkpoint)
rebinds the quantized weights as new Parameters without ``weight_loader``, so every later
``update_weights_from_*`` fails in the model's ``load_weights``. A server that *loads* an FP8
block-quantized checkpoint keeps its parameters (``weight`` e4m3, ``weight_scale_inv`` fp32) and
their loaders; the trainer then pushes FP8 weights plus scales it quantized itself (as slime does).
Because the embedded engine's ``fp8_block``/``fp8_w8a8`` simulation rounds through
:func:`quantize_block` too, the simulated and the served weights cannot drift apart.

Format (DeepSeek-V3 / Qwen3-FP8 checkpoints, SGLang's ``Fp8LinearMethod`` with
``weight_block_size``): for each quantized linear ``W [n, k]``,
``X.weight`` = e4m3 ``[n, k]`` and ``X.weight_scale_inv`` = fp32 ``[⌈n/128⌉, ⌈k/128⌉]`` with
``W ≈ weight · scale_inv`` blockwise (the name is historical: it is the dequantization multiplier).
Embeddings, norms, lm_head and MoE routers stay in the checkpoint's dtype.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Tuple

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128
# HF leaf module names of the linears an FP8 checkpoint quantizes (dense and MoE experts);
# MoE routers (``mlp.gate``, ``block_sparse_moe.gate``) and lm_head are not among them.
FP8_LINEARS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
)  # fmt: skip
SCALE_SUFFIX = "weight_scale_inv"


def quantization_config(block: int = BLOCK) -> dict:
    """The ``quantization_config`` of an FP8 block checkpoint's config.json (read by SGLang's
    ``Fp8Config.from_config`` and transformers' FineGrainedFP8)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "modules_to_not_convert": ["lm_head"],
    }


def is_fp8_block_config(hf_config: dict) -> bool:
    q = hf_config.get("quantization_config") or {}
    return q.get("quant_method") == "fp8" and list(q.get("weight_block_size") or []) == [
        BLOCK,
        BLOCK,
    ]


def is_fp8_linear(hf_name: str, shape: Tuple[int, ...]) -> bool:
    """An HF tensor an FP8 checkpoint stores quantized: a 2-D ``….<linear>.weight``."""
    parts = hf_name.rsplit(".", 2)
    return len(shape) == 2 and len(parts) == 3 and parts[2] == "weight" and parts[1] in FP8_LINEARS


def quantize_block(w: Tensor, block: int = BLOCK) -> Tuple[Tensor, Tensor]:
    """``w [n, k]`` → ``(q [n, k] float8_e4m3fn, scale_inv [⌈n/b⌉, ⌈k/b⌉] fp32)``.

    Per ``b × b`` tile: ``scale = max|w_tile| / 448`` (ragged edge tiles padded with zeros),
    ``q = e4m3(w / scale)`` (round to nearest even, as torch's cast does), so ``q·scale`` is
    within one e4m3 rounding (relative 2⁻⁴, or ``scale·2⁻¹⁰`` near zero) of ``w``.
    """
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    w32 = w.float()
    padded = torch.nn.functional.pad(w32, (0, -cols % block, 0, -rows % block))
    r, c = padded.shape[0] // block, padded.shape[1] // block
    tiles = padded.reshape(r, block, c, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX  # [r, c]
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[:rows, :cols].contiguous(), scale.contiguous()


def dequantize_block(
    q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32, block: int = BLOCK
) -> Tensor:
    """Inverse of :func:`quantize_block`: ``q [n, k] · scale_inv`` expanded over its
    ``block × block`` tiles (the block is not inferred from the grid: with a ragged edge,
    ``n / ⌈n/128⌉`` is not 128)."""
    rows, cols = q.shape
    s = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (q.float() * s).to(dtype)


def quant_dequant_block(w: Tensor, block: int = BLOCK) -> Tensor:
    """``w`` as an FP8 block server holds it (the embedded engine's simulation), in ``w.dtype``."""
    return dequantize_block(*quantize_block(w, block), dtype=w.dtype, block=block)


def scale_name(hf_weight_name: str) -> str:
    return hf_weight_name[: -len("weight")] + SCALE_SUFFIX


def quantize_named(
    tensors: Iterable[Tuple[str, Tensor]], dtype: Optional[torch.dtype] = None
) -> Iterator[Tuple[str, Tensor]]:
    """HF (name, tensor) pairs as an FP8 block checkpoint holds them: each FP8 linear becomes
    its e4m3 weight followed by its ``weight_scale_inv``; everything else passes (cast to
    ``dtype`` when given)."""
    for name, t in tensors:
        if is_fp8_linear(name, tuple(t.shape)):
            q, s = quantize_block(t)
            yield name, q
            yield scale_name(name), s
        else:
            yield name, t if dtype is None else t.to(dtype)
