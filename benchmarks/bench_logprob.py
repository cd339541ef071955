"""Time and peak memory of vocab_parallel_logprobs (forward + backward) against Megatron-Core's
``vocab_parallel_cross_entropy`` and a naive ``log_softmax(...).gather``, side by side.

Each (variant, dtype) runs in a fresh subprocess; peak RSS is the kernel's high-water mark
(VmHWM, reset just before the call); the logits and targets are allocated before the baseline
is read, so the number is the extra memory the operation needs. Targets: ≤ 1.0× Megatron's
time, ≤ 0.5× the naive peak memory. ``ours_inplace`` is the training path (gradient written
into the logits' storage, as Megatron does).

    python benchmarks/bench_logprob.py [--tokens 4096 --vocab 32768 --reps 3 --chunk N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory import peak_mb, reset_peak, rss_mb  # noqa: E402

VARIANTS = ("ours", "ours_inplace", "megatron", "naive")


def worker(variant: str, dtype: str, tokens: int, vocab: int, reps: int, chunk: int) -> dict:
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    if variant == "megatron":
        from megatron_p3o.parallel import Layout, initialize

        initialize(Layout())
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron_p3o.loss import vocab_parallel_logprobs

    base_logits = torch.randn(tokens, vocab, dtype=dt)
    targets = torch.randint(0, vocab, (tokens,))

    def run(logits):
        if variant.startswith("ours"):
            lp, _ = vocab_parallel_logprobs(
                logits, targets, chunk_size=chunk, inplace_backward=variant == "ours_inplace"
            )
            loss = -lp.sum()
        elif variant == "megatron":
            # [s, b, v] layout; Megatron modifies fp32 logits in place (we pass a fresh leaf)
            loss = vocab_parallel_cross_entropy(logits[:, None, :], targets[:, None]).sum()
        else:
            loss = -torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).sum()
        loss.backward()

    times = []
    for i in range(reps + 1):
        logits = base_logits.clone().requires_grad_()
        before = rss_mb()
        reset_peak()
        t0 = time.perf_counter()
        run(logits)
        dt_s = time.perf_counter() - t0
        if i == 0:
            first_extra = max(peak_mb() - before, 0.0)
        else:
            times.append(dt_s)
        del logits
    times.sort()
    return {
        "variant": variant,
        "dtype": dtype,
        "time_s": times[len(times) // 2],
        "peak_extra_mb": first_extra,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "DTYPE"))
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.worker[1], a.tokens, a.vocab, a.reps, a.chunk)))
        return
    from rich.console import Console
    from rich.table import Table

    rows = {}
    for dtype in a.dtypes.split(","):
        for v in VARIANTS:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                v,
                dtype,
                "--tokens",
                str(a.tokens),
                "--vocab",
                str(a.vocab),
                "--reps",
                str(a.reps),
            ]
            if a.chunk:
                cmd += ["--chunk", str(a.chunk)]
            out = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            rows[(v, dtype)] = json.loads(out.stdout.strip().splitlines()[-1])
    t = Table(title=f"log-prob fwd+bwd, {a.tokens}×{a.vocab} (chunk {a.chunk}), median of {a.reps}")
    for col in ("dtype", "variant", "time s", "peak extra MB", "time / megatron", "mem / naive"):
        t.add_column(col)
    for (v, dtype), r in rows.items():
        meg, nav = rows[("megatron", dtype)], rows[("naive", dtype)]
        t.add_row(
            dtype,
            v,
            f"{r['time_s']:.3f}",
            f"{r['peak_extra_mb']:.0f}",
            f"{r['time_s'] / meg['time_s']:.2f}×",
            f"{r['peak_extra_mb'] / max(nav['peak_extra_mb'], 1e-9):.2f}×",
        )
    Console().print(t)


if __name__ == "__main__":
    main()
