"""Conversion throughput and peak memory against plain safetensors read speed, side by side.

Makes a Llama-style model of a few hundred MB locally (bf16, sharded safetensors), then in
fresh subprocesses: (1) reads every shard file once, (2) copies every shard durably (read,
write, fsync: the disk floor of any converter), (3) HF → Megatron dist checkpoint, (4) Megatron →
HF. Prints GB/s, the ratio to the read speed (target ≤ 2× slower)
and the peak RSS above the process's baseline against the budget 2 × largest tensor + one
shard (target within it).

    python benchmarks/bench_convert.py [--hidden 1024 --layers 8 --vocab 32000 --shard-mb 100]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pathlib import Path

from memory import peak_mb, reset_peak, rss_mb  # noqa: E402


def worker(task: str, root: Path) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch  # noqa: F401

    if task != "read":
        from megatron_p3o.runtime.parallel import Layout, initialize

        groups = initialize(Layout())
        # import everything the conversion uses before the baseline is read
        import megatron.core.models.gpt  # noqa: F401
        from megatron.core.dist_checkpointing.strategies import torch as _  # noqa: F401
        from torch.distributed import checkpoint as _dcp  # noqa: F401

        import checkpoints_convert.hf_to_megatron  # noqa: F401
        import checkpoints_convert.megatron_to_hf  # noqa: F401
    base = rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    if task in ("read", "copy"):  # the plain read (and copy): every shard's bytes, one at a time
        (root / "copy").mkdir(exist_ok=True)
        for f in sorted((root / "hf").glob("*.safetensors")):
            with open(f, "rb") as fh:
                data = fh.read()
            if task == "copy":  # the disk floor of any converter: write it back, durably
                with open(root / "copy" / f.name, "wb") as fo:
                    fo.write(data)
                    fo.flush()
                    os.fsync(fo.fileno())
            del data
    elif task == "import":
        from checkpoints_convert.hf_to_megatron import convert

        convert(str(root / "hf"), str(root / "ckpt"), groups=groups, progress=False)
    else:
        from checkpoints_convert.megatron_to_hf import convert

        convert(
            str(root / "ckpt"),
            str(root / "hf-out"),
            groups=groups,
            progress=False,
            max_shard_bytes=int(os.environ["SHARD_BYTES"]),
        )
    dt = time.perf_counter() - t0
    return {"task": task, "seconds": dt, "peak_extra_mb": max(0.0, peak_mb() - base)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=100)
    ap.add_argument("--worker", nargs=2, metavar=("TASK", "ROOT"))
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], Path(a.worker[1]))))
        return
    import torch
    from rich.console import Console
    from rich.table import Table
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        cfg = LlamaConfig(
            hidden_size=a.hidden,
            intermediate_size=int(a.hidden * 2.75),
            num_hidden_layers=a.layers,
            num_attention_heads=16,
            num_key_value_heads=4,
            vocab_size=a.vocab,
            tie_word_embeddings=False,
        )
        with torch.device("cpu"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(root / "hf", max_shard_size=f"{a.shard_mb}MB")
        largest = max(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        total = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        del model
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "SHARD_BYTES": str(a.shard_mb * 2**20)}
        rows = {}
        for task in ("read", "copy", "import", "export"):
            out = subprocess.run(
                [sys.executable, __file__, "--worker", task, str(root)],
                capture_output=True,
                text=True,
                env=env,
            )
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            rows[task] = json.loads(out.stdout.strip().splitlines()[-1])
        budget = 2 * largest + a.shard_mb
        t = Table(
            title=f"conversion of a {total:.2f} GB bf16 Llama ({a.layers} layers, hidden "
            f"{a.hidden}); largest tensor {largest:.0f} MB, shard {a.shard_mb} MB"
        )
        for c in (
            "task",
            "seconds",
            "GB/s",
            "time / read",
            "time / copy",
            "peak extra MB",
            "of budget",
        ):
            t.add_column(c)
        for task, r in rows.items():
            gbs = total / r["seconds"]
            t.add_row(
                task,
                f"{r['seconds']:.2f}",
                f"{gbs:.2f}",
                f"{r['seconds'] / rows['read']['seconds']:.2f}×",
                f"{r['seconds'] / rows['copy']['seconds']:.2f}×",
                f"{r['peak_extra_mb']:.0f}",
                f"{r['peak_extra_mb'] / budget:.2f}×",
            )
        Console().print(t)
        print(f"memory budget = 2 × largest tensor + one shard = {budget:.0f} MB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
