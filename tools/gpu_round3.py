"""The GPU path round 3 checks that run without Transformer Engine or SGLang (tools/gpu_check.sh
step ``round3``; also runnable on a CPU with ``--device cpu``):

1. the block-FP8 quantizer of every push (``weight_sync/fp8.py``) on the device, bit for bit
   against the same function on the CPU (the CPU result is what the test suite checks against
   transformers' and SGLang's FP8 readers), and its time for a 4096×12288 bf16 weight;
2. the packed FP8 padding rule per shipped recipe (rows per rank divisible by 16);
3. host syncs in one training micro-batch on the device (``tests/unit/test_host_syncs.py``'s
   counter, when present), at most one.

Prints one ``RESULT`` line and writes ``round3.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fp8_on_device(device: str) -> dict:
    from megatron_p3o.weight_sync.fp8 import quantize_block

    torch.manual_seed(0)
    out = {}
    for shape in [(4096, 12288), (1000, 3000)]:  # one on the 128 grid, one ragged
        w = torch.randn(*shape, dtype=torch.bfloat16)
        q_cpu, s_cpu = quantize_block(w)
        wd = w.to(device)
        quantize_block(wd)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        q, s = quantize_block(wd)
        if device == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        same = torch.equal(q.cpu().view(torch.uint8), q_cpu.view(torch.uint8)) and torch.equal(
            s.cpu(), s_cpu
        )
        out[f"{shape[0]}x{shape[1]}"] = {"bitwise_equal_to_cpu": bool(same), "ms": round(ms, 3)}
    return out


def padding_rule() -> dict:
    import yaml

    from megatron_p3o.config.loading import load_config
    from megatron_p3o.update.batching import token_multiple

    out = {}
    for p in sorted((ROOT / "recipes").glob("*.yaml")):
        if "objectives" in yaml.safe_load(p.read_text()):
            continue
        cfg = load_config(str(p))
        lay = cfg.parallel.layout().resolve(cfg.parallel.world_size or 1)
        shard = lay.cp * (lay.tp if lay.sequence_parallel else 1)
        m = token_multiple(lay, fp8=True)
        out[p.name] = {"multiple": m, "ok": m % (16 * shard) == 0}
    return out


def host_syncs(device: str) -> dict:
    test = ROOT / "tests/unit/test_host_syncs.py"
    if not test.is_file():
        return {"skipped": "no tests/unit/test_host_syncs.py"}
    env = {"P3O_TEST_DEVICE": device, "PYTHONPATH": str(ROOT)}
    import os

    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=600, cwd=ROOT,
    )  # fmt: skip
    return {"rc": r.returncode, "tail": r.stdout.strip().splitlines()[-1:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    res = {"fp8": fp8_on_device(a.device), "padding": padding_rule(), "syncs": host_syncs(a.device)}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "round3.json").write_text(json.dumps(res, indent=2))
    ok = (
        all(v["bitwise_equal_to_cpu"] for v in res["fp8"].values())
        and all(v["ok"] for v in res["padding"].values())
        and res["syncs"].get("rc", 0) == 0
    )
    big = res["fp8"]["4096x12288"]["ms"]
    print(f"RESULT round3 ok={int(ok)} fp8_quant_4096x12288_ms={big} syncs={res['syncs']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
