"""A random Llama saved as a Hugging Face directory, for the benchmarks that serve one."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_model(out: Path, **shape) -> dict:
    """Save a seeded random ``LlamaForCausalLM`` of ``shape`` (LlamaConfig fields) to ``out``;
    returns its config.json. Token ids: bos 1, eos 2, pad 0; untied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, **shape
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(out)
    return json.loads((Path(out) / "config.json").read_text())
