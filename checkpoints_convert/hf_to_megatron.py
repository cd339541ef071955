"""HF directory → Megatron-Core distributed checkpoint (loadable at any TP/PP), streaming.

    python -m checkpoints_convert.hf_to_megatron --hf HF_DIR --out CKPT_DIR [--tp 2 --pp 2]
        [--dtype bfloat16] [--make-vocab-size-divisible-by 128] [--verify]

Runs as one process (the checkpoint format is layout-independent); ``--tp/--pp`` check that the
model splits that way and pick the vocabulary padding that TP needs. The model description,
config.json and tokenizer files are stored in the checkpoint so training and export need nothing
else. The output appears only when complete (temp dir + rename).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Optional

import torch

from megatron_p3o.runtime.errors import OutputExistsError, count_arg

HF_SUBDIR = "hf"  # config.json + tokenizer files of the source model, inside the checkpoint


def convert(
    hf_dir: str,
    out_dir: str,
    *,
    tp: int = 1,
    pp: int = 1,
    dtype: Optional[str] = None,
    divisible_by: int = 128,
    groups=None,
    progress: bool = True,
) -> dict:
    from rich.progress import Progress

    from megatron_p3o.model.builder import padded_vocab_size
    from megatron_p3o.model.hf.dist_stream import write_checkpoint
    from megatron_p3o.model.hf.mapping import tensor_maps, to_mcore
    from megatron_p3o.model.hf.safetensors_io import HFCheckpointReader, atomic_dir, copy_aux_files
    from megatron_p3o.runtime.parallel import Layout, initialize

    if Path(out_dir).exists():
        raise OutputExistsError(f"output directory {out_dir} already exists; refusing to overwrite")
    reader = HFCheckpointReader(hf_dir)
    reader.validate()
    desc = reader.description
    Layout(tp=tp, pp=pp).check_model(
        num_layers=desc.num_layers, num_heads=desc.num_heads, num_kv_heads=desc.num_kv_heads
    )
    # padding must split over the target TP; lcm keeps it the same for every power-of-two TP
    divisible_by = math.lcm(divisible_by, tp)
    padded = padded_vocab_size(desc.vocab_size, tp, divisible_by)
    torch_dtype = getattr(torch, dtype) if dtype else reader.dtype()
    if groups is None:
        groups = initialize(Layout())
    maps = tensor_maps(desc)
    with atomic_dir(out_dir) as tmp, Progress(disable=not progress) as bar:
        task = bar.add_task(f"HF → Megatron {Path(hf_dir).name}", total=len(maps))

        def source(tm):
            bar.advance(task)
            return to_mcore(tm, [reader.get(n) for n in tm.hf], desc, padded)

        chunks = write_checkpoint(desc, groups, source, tmp, torch_dtype, divisible_by)
        (tmp / HF_SUBDIR).mkdir()
        shutil.copy2(Path(hf_dir) / "config.json", tmp / HF_SUBDIR / "config.json")
        copy_aux_files(Path(hf_dir), tmp / HF_SUBDIR)
    return {
        "tensors": len(maps),
        "chunks": chunks,
        "padded_vocab_size": padded,
        "dtype": str(torch_dtype),
        "out": str(out_dir),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
    ap.add_argument("--tp", type=count_arg, default=1, help="TP the checkpoint must support")
    ap.add_argument("--pp", type=count_arg, default=1, help="PP the checkpoint must support")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="stored dtype (default: the HF checkpoint's)",
    )
    ap.add_argument("--make-vocab-size-divisible-by", type=count_arg, default=128)
    ap.add_argument(
        "--verify",
        action="store_true",
        help="compare HF (transformers) and converted Megatron logits on a few prompts",
    )
    ap.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    a = ap.parse_args(argv)
    report = convert(
        a.hf, a.out, tp=a.tp, pp=a.pp, dtype=a.dtype, divisible_by=a.make_vocab_size_divisible_by
    )
    if a.verify:
        from checkpoints_convert.verify import verify

        report["verify"] = verify(a.hf, a.out)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "checkpoints_convert.hf_to_megatron")
