"""Compare an HF model (transformers) with its converted Megatron checkpoint on a few prompts.

    python -m checkpoints_convert.verify --hf HF_DIR --ckpt CKPT_DIR [--seq 64 --prompts 4]

Reports max |Δlogits| and the mean KL(HF ‖ Megatron) per token, in fp32, at TP=1.
"""

from __future__ import annotations

import argparse
import json

import torch


def megatron_logits(ckpt_dir: str, ids: torch.Tensor, groups=None) -> torch.Tensor:
    """Logits ``[b, s, V]`` (padding dropped) of the checkpoint at TP=1, fp32."""
    from checkpoints_convert.source import resolve
    from megatron_p3o.checkpoint.state import load_model_state
    from megatron_p3o.model.builder import BuildOptions, build_model
    from megatron_p3o.runtime.parallel import Layout, initialize

    src = resolve(ckpt_dir)  # a converted or trained checkpoint, or a run directory
    meta, ckpt_dir = src.meta, src.ckpt
    desc = meta["description"]
    groups = groups or initialize(Layout())
    (model,) = build_model(
        desc,
        groups,
        BuildOptions(
            seq_length=ids.shape[1],
            make_vocab_size_divisible_by=meta["make_vocab_size_divisible_by"],
        ),
    )
    load_model_state([model], ckpt_dir)
    model.eval()
    ids = ids.to(groups.device)  # the model lives on the training device (GPU when present)
    pos = torch.arange(ids.shape[1], device=groups.device)[None].expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, None)[..., : desc.vocab_size].float().cpu()


def verify(hf_dir: str, ckpt_dir: str, seq: int = 64, prompts: int = 4, seed: int = 0) -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_p3o.model.hf.safetensors_io import HFCheckpointReader

    # a missing or broken HF directory is one line naming it (transformers would take the path
    # for a hub repo id and raise an OSError traceback); no tensor is loaded here
    HFCheckpointReader(hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hf.config.vocab_size, (prompts, seq), generator=g)
    with torch.no_grad():
        ref = hf(ids).logits.float()
    out = megatron_logits(ckpt_dir, ids)
    lp_ref, lp_out = torch.log_softmax(ref.double(), -1), torch.log_softmax(out.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp_out)).sum(-1).mean()
    return {
        "max_abs_logit_diff": float((ref - out).abs().max()),
        "mean_kl": float(kl),
        "tokens": prompts * seq,
    }


def main(argv=None) -> int:
    from megatron_p3o.runtime.errors import count_arg

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--seq", type=count_arg, default=64)
    ap.add_argument("--prompts", type=count_arg, default=4)
    ap.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    a = ap.parse_args(argv)
    print(json.dumps(verify(a.hf, a.ckpt, a.seq, a.prompts), indent=2))
    return 0


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "checkpoints_convert.verify")
