"""Time and peak memory of vocab_parallel_logprobs (forward + backward) against Megatron-Core's
``vocab_parallel_cross_entropy``, a slime-style log-prob + entropy and a naive
``log_softmax(...).gather``, side by side, at TP = 1 or 2 (``--tp 2``: two gloo ranks, each
holding half the vocabulary, rank 0's numbers).

Each (variant, dtype) runs in fresh processes; peak RSS is the kernel's high-water mark
(VmHWM, reset just before the call); the logits and targets are allocated before the baseline
is read, so the number is the extra memory the operation needs. Variants:

- ``ours_inplace``: the trainer's gradient-pass kernel (gradient written into the logits'
  storage, as Megatron does), no entropy: the configuration the trainer runs, because the
  metric entropy comes from the no-grad ESS pre-pass.
- ``ours_inplace_ent``: the same with the entropy computed in the gradient pass (before).
- ``nograd`` / ``nograd_ent``: the pre-pass kernel without / with the entropy; their difference
  is what the metric entropy costs the trainer.
- ``slime``: log-probs from Megatron's ``vocab_parallel_cross_entropy`` on a copy of the logits
  plus a vocabulary-parallel entropy with its own autograd (softmax kept for backward), both in
  the gradient pass, as slime's training loss computes them (written here from that description).
- ``megatron``: Megatron's cross-entropy alone; ``naive``: ``log_softmax(...).gather``.

Targets: ≤ 1.0× Megatron's time, ≤ 0.5× the naive peak memory; the trainer's configuration
(``ours_inplace`` + the entropy's pre-pass increment) ≤ 0.9× slime's time.

    python benchmarks/bench_logprob.py [--tokens 4096 --vocab 32768 --reps 3 --tp 2]
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

VARIANTS = (
    "ours",
    "ours_inplace",
    "ours_inplace_ent",
    "nograd",
    "nograd_ent",
    "slime",
    "megatron",
    "naive",
)


def _entropy_fn():
    import torch
    import torch.distributed as dist

    class VocabParallelEntropy(torch.autograd.Function):
        """H = log S + m − Σ p·z over a vocabulary shard; keeps softmax and logits for backward
        (∂H/∂z = −p ⊙ (z − Σ p·z))."""

        @staticmethod
        def forward(ctx, z, group):
            z = z.float()
            m = z.max(-1, keepdim=True).values
            if group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            e = torch.exp(z - m)
            s = e.sum(-1, keepdim=True)
            if group is not None:
                dist.all_reduce(s, group=group)
            p = e / s
            pz = (p * z).sum(-1, keepdim=True)
            if group is not None:
                dist.all_reduce(pz, group=group)
            ctx.save_for_backward(p, z, pz)
            return (torch.log(s) + m - pz).squeeze(-1)

        @staticmethod
        def backward(ctx, g):
            p, z, pz = ctx.saved_tensors
            return -p * (z - pz) * g[..., None], None

    return VocabParallelEntropy


def worker(variant: str, dtype: str, tokens: int, vocab: int, reps: int, chunk: int) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_p3o.parallel import Layout, initialize

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    groups = initialize(Layout(tp=tp))
    tp_group = groups.tp if tp > 1 else None
    rank = groups.tp_rank
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_p3o.loss import vocab_parallel_logprobs

    base_logits = torch.randn(tokens, vocab, dtype=dt)[
        :, rank * vocab // tp : (rank + 1) * vocab // tp
    ]
    base_logits = base_logits.contiguous()
    targets = torch.randint(0, vocab, (tokens,))
    entropy = _entropy_fn()

    def run(logits):
        if variant.startswith("nograd"):
            with torch.no_grad():
                vocab_parallel_logprobs(
                    logits,
                    targets,
                    tp_group,
                    chunk_size=chunk,
                    with_entropy=variant.endswith("ent"),
                )
            return
        if variant.startswith("ours"):
            lp, _ = vocab_parallel_logprobs(
                logits, targets, tp_group, chunk_size=chunk,
                inplace_backward=variant.startswith("ours_inplace"),
                with_entropy=variant.endswith("_ent"),
            )  # fmt: skip
            loss = -lp.sum()
        elif variant in ("megatron", "slime"):
            # [s, b, v] layout; Megatron modifies fp32 logits in place (slime passes a copy)
            x = logits.clone() if variant == "slime" else logits
            loss = vocab_parallel_cross_entropy(x[:, None, :], targets[:, None]).sum()
            if variant == "slime":
                loss = loss - 0.0 * entropy.apply(logits, tp_group).sum()
        else:
            full = logits.float()
            if tp_group is not None:
                from torch.distributed.nn.functional import all_gather

                full = torch.cat(all_gather(full, group=tp_group), -1)
            loss = -torch.log_softmax(full, -1).gather(-1, targets[:, None]).sum()
        loss.backward()

    times = []
    for i in range(reps + 1):
        logits = base_logits.clone().requires_grad_(not variant.startswith("nograd"))
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
    if tp > 1:
        dist.barrier()
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
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gloo)")
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "DTYPE"))
    a = ap.parse_args()
    if a.worker:
        res = worker(a.worker[0], a.worker[1], a.tokens, a.vocab, a.reps, a.chunk)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(res))
        return
    from rich.console import Console
    from rich.table import Table

    rows = {}
    for dtype in a.dtypes.split(","):
        for v in VARIANTS:
            launcher = [sys.executable]
            if a.tp > 1:
                launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(a.tp)]
                launcher += ["--master-port", str(29700 + len(rows))]
            cmd = launcher + [
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
    t = Table(
        title=f"log-prob fwd+bwd, {a.tokens}×{a.vocab} at TP={a.tp} (chunk {a.chunk}), "
        f"median of {a.reps}"
    )
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
    for dtype in a.dtypes.split(","):
        r = {v: rows[(v, dtype)]["time_s"] for v in VARIANTS}
        trainer = r["ours_inplace"] + max(r["nograd_ent"] - r["nograd"], 0.0)
        print(
            f"{dtype}: trainer configuration (gradient pass without entropy + the entropy's "
            f"pre-pass increment) = {trainer:.3f} s = {trainer / r['slime']:.2f}× slime's "
            f"log-prob+entropy ({r['slime']:.3f} s); with the entropy in the gradient pass "
            f"{r['ours_inplace_ent'] / r['slime']:.2f}×; {r['ours_inplace'] / r['megatron']:.2f}× "
            "Megatron's cross-entropy"
        )


if __name__ == "__main__":
    main()
