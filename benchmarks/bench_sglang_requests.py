"""One rollout step against a real SGLang 0.5.23 server on CPU, side by side: one ``/generate``
request per completion (``rollout.sglang.request_batch: 1``, the default) against batched
requests (SGLang's batch form, ``request_batch`` 16 and 128), and the embedded engine.

The step is the stress grids' (``recipes/stress_v3_engines_tiny_cpu.yaml``): 16 prompts × 8
samples, ≤ 5 new tokens, bf16, on a random Llama of the tiny recipe's shape (hidden 64, 2 layers),
so a request's HTTP and scheduling cost, not the model, decides the time. One server is launched
through the trainer's own path (``build_fleet``) in the SGLang environment (``$SGLANG_PYTHON``,
``tools/sglang_env.sh``). The configurations run interleaved, ``--repeats`` times each, best kept;
every batched answer is checked for its order (prompt groups as sent). The samples themselves
differ from run to run: SGLang honours ``sampling_seed`` only under deterministic inference,
which it refuses on CPU (``tests/sglang_server`` checks batched greedy decodes and ℓb instead).

    SGLANG_PYTHON=.venv-sglang/bin/python python benchmarks/bench_sglang_requests.py [--repeats 5]

Last line: ``RESULT batch16_vs_single=… batch128_vs_single=… single_s=… embedded_vs_single=…``
(step-time ratios, > 1 = faster than one request per completion).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import random_llama  # noqa: E402

# the tiny recipe's shape: a request's HTTP and scheduling cost, not the model, decides the time
SHAPE = dict(
    vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()

    from safetensors.torch import load_file
    from transformers.utils import logging as hf_logging

    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from megatron_p3o.rollout.sglang import SGLangConfig, build_fleet
    from megatron_p3o.runtime.ports import free_port
    from megatron_p3o.types import SamplingParams

    hf_logging.set_verbosity_error()
    work = Path(tempfile.mkdtemp(prefix="bench-sglang-requests-"))
    try:
        hf = work / "hf"
        cfg = random_llama.make_model(hf, **SHAPE)
        sg = SGLangConfig(model_path=str(hf), dtype=args.dtype, port=free_port(),
                          startup_timeout_s=600)  # fmt: skip
        fleet = build_fleet(sg, [], work / "logs", "distributed")
        t0 = time.perf_counter()
        fleet.start()
        print(f"server up in {time.perf_counter() - t0:.1f}s")
        fleet.update_weights_from_disk(str(hf), 1)  # a version the trainer pushed (not "default")
        g = torch.Generator().manual_seed(1)
        prompts = [[1, *torch.randint(3, 32, (6,), generator=g).tolist()]
                   for _ in range(args.prompts)]  # fmt: skip
        sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=3)
        emb = EmbeddedEngine(
            cfg, {"bfloat16": "bf16", "float32": "fp32"}[args.dtype], pad_token_id=0
        )
        emb.update_weights([sorted(load_file(str(hf / "model.safetensors")).items())], 1)
        best = {}
        groups = [g for g in range(args.prompts) for _ in range(args.samples)]
        try:
            for _ in range(args.repeats):  # interleaved: drift hits every configuration alike
                for per in (1, 16, 128, "embedded"):
                    t = time.perf_counter()
                    if per == "embedded":
                        out = emb.generate(prompts, args.samples, sp)
                    else:
                        fleet.router.request_batch = per
                        out = fleet.generate(prompts, args.samples, sp)
                    dt = time.perf_counter() - t
                    best[per] = min(best.get(per, float("inf")), dt)
                    assert [s.group_id for s in out] == groups, per
        finally:
            fleet.stop()
        n = args.prompts * args.samples
        print(
            f"\none step: {args.prompts} prompts × {args.samples} samples, ≤ {args.new_tokens} "
            f"new tokens, {args.dtype} (best of {args.repeats})"
        )
        for per in (1, 16, 128, "embedded"):
            label = "embedded engine" if per == "embedded" else f"request_batch {per}"
            print(f"{label:>18}: {best[per]:.3f} s ({n / best[per]:.0f} completions/s)")
        print(
            f"RESULT batch16_vs_single={best[1] / best[16]:.2f} "
            f"batch128_vs_single={best[1] / best[128]:.2f} single_s={best[1]:.3f} "
            f"embedded_vs_single={best[1] / best['embedded']:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
