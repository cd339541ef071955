"""Weight pushes into a real SGLang 0.5.23 server on CPU, side by side: a safetensors directory
(``/update_weights_from_disk``), a gloo process group (``/update_weights_from_distributed``) and
tensor payloads (``/update_weights_from_tensor``), at bucket sizes 16/64/256 MB; and rollout
tokens/s of that server against the embedded engine on the same prompts.

The model is a random Llama of ≈ 143 MB in fp32 (hidden 512, 8 layers, vocab 8192), big enough
that a push is bandwidth, not request latency. One server is launched through the trainer's own
path (``build_fleet``), in the SGLang environment (``$SGLANG_PYTHON``, ``tools/sglang_env.sh``).
Each configuration is pushed ``--repeats`` times, interleaved, and the best time kept; every push
is checked by the version the server then reports. The disk time includes writing the directory
(as the trainer does at every sync point).

    SGLANG_PYTHON=.venv-sglang/bin/python python benchmarks/bench_weight_sync.py [--repeats 3]

Last line: ``RESULT disk_s=… gloo_s=… tensor_s=… gloo_mb_per_s=… sglang_vs_embedded_tokens=…``
(push times at 64 MB buckets; tokens/s ratio of SGLang over the embedded engine, > 1 = faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import random_llama  # noqa: E402

BUCKETS_MB = (16, 64, 256)


SHAPE = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    from safetensors.torch import load_file
    from transformers.utils import logging as hf_logging

    from megatron_p3o.model.hf.safetensors_io import HFShardedWriter
    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from megatron_p3o.rollout.sglang import SGLangConfig, build_fleet
    from megatron_p3o.runtime.ports import free_port
    from megatron_p3o.types import SamplingParams
    from megatron_p3o.weight_sync import iter_hf_buckets

    hf_logging.set_verbosity_error()
    work = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    try:
        hf = work / "hf"
        cfg = random_llama.make_model(hf, **SHAPE)
        named = sorted(load_file(str(hf / "model.safetensors")).items())
        mb = sum(t.numel() * t.element_size() for _, t in named) / 2**20
        print(f"model: {mb:.1f} MB fp32, {len(named)} tensors")
        sg = SGLangConfig(model_path=str(hf), dtype="float32", port=free_port(),
                          startup_timeout_s=600, max_total_tokens=32768)  # fmt: skip
        fleet = build_fleet(sg, [], work / "logs", "distributed")
        t0 = time.perf_counter()
        fleet.start()
        print(f"server up in {time.perf_counter() - t0:.1f}s")
        try:
            fleet.init_weight_update_groups("127.0.0.1", free_port())
            server, version = fleet.workers[0], 0
            best: dict = {}

            def push(mode: str, bucket_mb: int) -> float:
                nonlocal version
                version += 1
                t = time.perf_counter()
                if mode == "disk":
                    out = work / f"sync_v{version}"
                    out.mkdir()
                    w = HFShardedWriter(out)
                    for name, x in named:
                        w.add(name, x)
                    w.close()
                    (out / "config.json").write_text(json.dumps(cfg))
                    fleet.update_weights_from_disk(str(out), version)
                else:
                    fleet.transport = mode
                    fleet.update_weights(iter_hf_buckets(iter(named), bucket_mb * 2**20), version)
                dt = time.perf_counter() - t
                assert server.served_version() == str(version), (mode, bucket_mb)
                if mode == "disk":
                    shutil.rmtree(work / f"sync_v{version}")
                return dt

            for _ in range(args.repeats):  # interleaved: drift hits every configuration alike
                for bucket_mb in BUCKETS_MB:
                    for mode in ("disk", "distributed", "tensor"):
                        dt = push(mode, bucket_mb)
                        key = (mode, bucket_mb)
                        best[key] = min(best.get(key, float("inf")), dt)

            print(f"\n{'bucket':>8} {'disk s':>8} {'gloo s':>8} {'tensor s':>9} {'gloo MB/s':>10}")
            for b in BUCKETS_MB:
                d, g, t = best[("disk", b)], best[("distributed", b)], best[("tensor", b)]
                print(f"{b:>6}MB {d:8.3f} {g:8.3f} {t:9.3f} {mb / g:10.1f}")

            # rollouts: the same prompts, the same weights, fp32 both, sampled
            g = torch.Generator().manual_seed(1)
            prompts = [[1, *torch.randint(3, 8192, (12,), generator=g).tolist()]
                       for _ in range(args.prompts)]  # fmt: skip
            sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=3)
            emb = EmbeddedEngine(cfg, "fp32", pad_token_id=0)
            emb.update_weights([named], version)
            rates = {"sglang": 0.0, "embedded": 0.0}
            for _ in range(args.repeats):
                for name, eng in (("sglang", fleet), ("embedded", emb)):
                    t = time.perf_counter()
                    out = eng.generate(prompts, 1, sp)
                    toks = sum(len(s.completion_ids) for s in out)
                    rates[name] = max(rates[name], toks / (time.perf_counter() - t))
            print(
                f"\nrollout tokens/s: sglang {rates['sglang']:.0f}, embedded "
                f"{rates['embedded']:.0f} ({args.prompts} prompts × ≤ {args.new_tokens})"
            )
        finally:
            fleet.stop()
        b = 64
        print(
            f"RESULT disk_s={best[('disk', b)]:.3f} gloo_s={best[('distributed', b)]:.3f} "
            f"tensor_s={best[('tensor', b)]:.3f} gloo_mb_per_s={mb / best[('distributed', b)]:.1f} "
            f"sglang_vs_embedded_tokens={rates['sglang'] / rates['embedded']:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
