"""Megatron-Core distributed checkpoint (written at any TP/PP/EP) → HF directory, streaming.

    python -m checkpoints_convert.megatron_to_hf --ckpt CKPT_OR_RUN_DIR --out HF_DIR
        [--max-shard-size-gb 2] [--dtype bfloat16] [--hf-config DIR] [--quantize fp8]

``--ckpt``: a training run directory (its newest checkpoint that verifies against its
manifest), one of its ``checkpoints/step_N``, or a converted checkpoint
(:mod:`checkpoints_convert.source`).

Writes config.json, the tokenizer files kept in the checkpoint (or from ``--hf-config``), sharded
safetensors and the index, which ``transformers`` and SGLang load as is. Atomic (temp dir + rename).
``--quantize fp8``: the linears as 128×128 block FP8 (e4m3 ``weight`` + fp32 ``weight_scale_inv``,
``quantization_config`` in config.json), the checkpoint FP8 rollout servers load; quantized by
:func:`megatron_p3o.weight_sync.fp8.quantize_block`, the same function as every push to them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

from megatron_p3o.runtime.errors import OutputExistsError


def convert(
    ckpt_dir: str,
    out_dir: str,
    *,
    max_shard_bytes: int = 2 * 2**30,
    dtype: Optional[str] = None,
    hf_config_dir: Optional[str] = None,
    groups=None,
    progress: bool = True,
    quantize: Optional[str] = None,
) -> dict:
    from rich.progress import Progress

    from checkpoints_convert.source import resolve
    from megatron_p3o.model.description import description_to_hf_config
    from megatron_p3o.model.hf.dist_stream import read_checkpoint
    from megatron_p3o.model.hf.mapping import tensor_maps, to_hf
    from megatron_p3o.model.hf.safetensors_io import HFShardedWriter, atomic_dir, copy_aux_files
    from megatron_p3o.runtime.parallel import Layout, initialize
    from megatron_p3o.weight_sync.fp8 import quantization_config, quantize_named

    if Path(out_dir).exists():
        raise OutputExistsError(f"output directory {out_dir} already exists; refusing to overwrite")
    src = resolve(ckpt_dir)
    for note in src.notes if progress else []:
        print(note)
    meta, desc = src.meta, src.meta["description"]
    out_dtype = getattr(torch, dtype) if dtype else getattr(torch, meta["params_dtype"])
    if groups is None:
        groups = initialize(Layout())
    src_cfg = Path(hf_config_dir) if hf_config_dir else src.hf_dir
    n = 0
    with atomic_dir(out_dir) as tmp, Progress(disable=not progress) as bar:
        task = bar.add_task(f"Megatron → HF {src.ckpt.name}", total=len(tensor_maps(desc)))
        writer = HFShardedWriter(tmp, max_shard_bytes)
        for tm, t in read_checkpoint(src.ckpt, meta):
            named = ((name, x.to(out_dtype)) for name, x in to_hf(tm, t, desc).items())
            if quantize == "fp8":
                named = quantize_named(named)
            for name, tensor in named:
                writer.add(name, tensor)
                n += 1
            bar.advance(task)
        writer.close()
        if (src_cfg / "config.json").is_file():
            cfg = json.loads((src_cfg / "config.json").read_text())
            cfg["torch_dtype"] = str(out_dtype).replace("torch.", "")
        else:
            cfg = description_to_hf_config(desc, str(out_dtype).replace("torch.", ""))
        if quantize == "fp8":
            cfg["quantization_config"] = quantization_config()
        else:
            cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        copied = copy_aux_files(src_cfg, tmp)
    return {
        "checkpoint": str(src.ckpt),
        "tensors": n,
        "bytes": writer.total,
        "shards": len(writer.files),
        "aux_files": copied,
        "out": str(out_dir),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--ckpt",
        required=True,
        help="a training run directory (its newest verified checkpoint), a checkpoint directory "
        "(checkpoints/step_N) or a converted checkpoint",
    )
    ap.add_argument("--out", required=True, help="output HF directory (must not exist)")
    ap.add_argument("--max-shard-size-gb", type=float, default=2.0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    ap.add_argument(
        "--hf-config",
        default=None,
        help="directory with config.json/tokenizer to use instead of the stored ones",
    )
    ap.add_argument(
        "--quantize",
        choices=["fp8"],
        default=None,
        help="fp8: 128x128 block-FP8 linears (the checkpoint FP8 SGLang servers load)",
    )
    ap.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    a = ap.parse_args(argv)
    report = convert(
        a.ckpt,
        a.out,
        max_shard_bytes=int(a.max_shard_size_gb * 2**30),
        dtype=a.dtype,
        hf_config_dir=a.hf_config,
        quantize=a.quantize,
    )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "checkpoints_convert.megatron_to_hf")
