"""Log-prob benchmarks at TP = 1 or 2 (two gloo ranks, one thread each, rank 0's numbers).

**Last stage** (the default): the trainer's whole last-stage cost per micro-batch — the output
layer's matmul, ℓθ, the metric entropy (no gradient) and the backward into h and W — for

- ``fused``: :func:`~megatron_p3o.logprob.fused.fused_vocab_parallel_logprobs` (the logits
  never exist whole: chunks of ≈ 16 MB, recomputed in the backward; the trainer's default);
- ``unfused``: the logits materialised by the matmul, then
  :func:`~megatron_p3o.logprob.kernels.vocab_parallel_logprobs` with its in-place backward;
- ``slime``: the same materialised logits into slime's own ``calculate_log_probs_and_entropy``
  (``slime/utils/ppo_utils.py``, loaded at run time from a slime checkout given by ``--slime``
  or ``$SLIME_REPO``: a work tree or a bare git directory; its code is not part of this project).

at T ∈ ``--tokens-list`` (2048, 8192), V = 32768, h = 512, fp32. ``*_nograd`` rows are the
step's no-grad forwards alone (ESS pre-pass, ℓold, reference); ``*_step`` rows are the trainer's
whole last-stage cost per micro-batch of a P3O step through the ESS pre-pass (no grad, ℓθ + the
metric entropy), then the gradient pass (ℓθ, no entropy) and its backward; ``fused_kept`` is the
trainer's path where the step fits (``batch.keep_graphs`` and ``batch.keep_logits``): one
forward (ℓθ with the metric entropy) that keeps its chunks' logits, e_B's float64 statistics
from its ℓθ, the backward from the kept logits — no pre-pass, no recomputed matmul. Each
(variant, T) runs in fresh processes; peak memory is the kernel's resident high-water mark
(VmHWM, reset just before the call) above the inputs. Targets: at the largest T, fused peak
≤ 0.25× unfused, fused time ≤ 1.1× unfused (the trainer's step), the trainer's path where the
step fits (``fused_kept``) ≤ 0.9× slime's single pass. Last line: ``RESULT
fused_vs_unfused_time=… fused_vs_unfused_peak=… trainer_vs_slime_time=…
prepass_trainer_vs_slime_time=… fused_vs_unfused_one_pass_time=…`` (the step's time ratio
through the pre-pass; the trainer's path against slime with kept graphs and through the
pre-pass; the one-pass ratio, matmul + ℓθ + entropy + backward: the fused path's recomputed
logits are a fourth matmul of the output layer's size). ``--rounds R`` runs every (variant, T)
R times, round after round, so a slow spell of a shared machine hits each alike: each row is
its median round, and the trainer's ratio to slime is the median of the per-round ratios (slime
and the trainer's path run one after the other in each round), printed round by round at every T
(three decimals: the target's line is 0.9). ``--variants slime,fused_kept`` runs only those (the
ratios that need a left-out variant print ``nan``): many paired rounds in the time of a few.

    python benchmarks/bench_logprob.py --slime /path/to/slime [--tokens-list 2048,8192 --tp 2
                                                               --rounds 3 --variants ...]

**Kernel only** (``--kernel``): vocab_parallel_logprobs (forward + backward) on given logits
against Megatron-Core's ``vocab_parallel_cross_entropy``, a slime-style log-prob + entropy
written here from its description and a naive ``log_softmax(...).gather``.
Variants:

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

    python benchmarks/bench_logprob.py --kernel [--tokens 4096 --vocab 32768 --reps 3 --tp 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
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

    from megatron_p3o.runtime.parallel import Layout, initialize

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


# *_nograd: the no-grad forwards of a step (ESS pre-pass with the metric entropy, ℓold, the
# reference model): the same matmul + ℓθ + entropy without the backward.
# *_step: what the trainer's last stage does per micro-batch of a P3O step: the ESS pre-pass
# (no grad, ℓθ + the metric entropy), then the gradient pass (ℓθ without entropy) + backward.
LAST_STAGE = (  # slime and the trainer's path run next to each other in every round
    "fused", "unfused", "slime", "fused_kept", "fused_nograd", "unfused_nograd", "fused_step",
    "unfused_step",
)  # fmt: skip
SLIME_FILE = "slime/utils/ppo_utils.py"


def load_slime(repo: str):
    """slime's ``ppo_utils`` module, read from a slime work tree or bare git directory into a
    temporary file and imported (slime itself is not installed: only this file is needed)."""
    import importlib.util
    import tempfile

    path = os.path.join(repo, SLIME_FILE)
    if os.path.isfile(path):
        src = open(path).read()
    else:
        src = subprocess.run(
            ["git", "--git-dir", repo, "show", f"HEAD:{SLIME_FILE}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    tmp = os.path.join(tempfile.mkdtemp(), "slime_ppo_utils.py")
    with open(tmp, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("slime_ppo_utils", tmp)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def last_stage_worker(variant, tokens, vocab, hidden, reps, chunk, slime_repo) -> dict:
    """One (variant, T) on rank 0: time and peak of matmul + ℓθ + metric entropy + backward
    (``*_nograd``: the forward alone, under no_grad)."""
    import torch
    import torch.distributed as dist

    from megatron_p3o.logprob.fused import fused_vocab_parallel_logprobs
    from megatron_p3o.logprob.kernels import vocab_parallel_logprobs
    from megatron_p3o.loss.ess import ess_stats
    from megatron_p3o.model.output_layer import output_layer_input
    from megatron_p3o.runtime.parallel import Layout, initialize
    from megatron_p3o.update.step_memory import StepNeed, room_for_graphs

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    groups = initialize(Layout(tp=tp))
    tp_group = groups.tp if tp > 1 else None
    rank, v = groups.tp_rank, vocab // tp
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(tokens, hidden, generator=g)  # the output layer's input, same on all ranks
    w0 = (0.05 * torch.randn(vocab, hidden, generator=g))[rank * v : (rank + 1) * v].clone()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    coef = torch.randn(tokens, generator=g)  # the objective's ∂L/∂ℓ per token
    lb = -math.log(vocab) + 0.3 * torch.randn(tokens, generator=g)  # the engine's ℓb
    ones = torch.ones(tokens)
    slime = load_slime(slime_repo) if variant == "slime" else None
    # where the step fits the trainer keeps the fused kernel's logits for the backward
    # (batch.keep_logits: auto): the plan's rule for this T × V/tp fp32 (no model: no graphs)
    kept_bytes = 4.0 * tokens * v
    need = StepNeed(0.0, 0.0, kept_bytes, kept_bytes, room_for_graphs(torch.device("cpu")))
    keep_logits = variant.endswith("_kept") and need.logits_fit(True)

    def run(h, w):
        if variant.endswith("_nograd"):
            with torch.no_grad():
                return forward(h, w)[1].mean()
        if variant.endswith("_kept"):  # e_B from the gradient pass's own forward
            lp, ent = forward(h, w)
            metric = float(ent.detach().mean())
            float(ess_stats(lp, lb, ones)[0])  # Σρ, Σρ², N in float64, read once
            (-(lp * coef).sum()).backward()
            return metric
        if variant.endswith("_step"):
            with torch.no_grad():  # the ESS pre-pass: ℓθ for e_B, the entropy as a metric
                metric = float(forward(h, w)[1].mean())
            lp, _ = forward(h, w, entropy=False)  # the gradient pass
            (-(lp * coef).sum()).backward()
            return metric
        lp, ent = forward(h, w)
        metric = float(ent.detach().mean())  # the entropy: a metric, no gradient
        (-(lp * coef).sum()).backward()
        return metric

    def forward(h, w, entropy=True):
        x = output_layer_input(h, tp_group)  # as ColumnParallelLinear: dh summed over TP
        if variant.startswith("fused"):
            lp, ent = fused_vocab_parallel_logprobs(
                x, w, targets, tp_group, chunk_size=chunk, with_entropy=entropy,
                keep_logits=keep_logits,
            )  # fmt: skip
        else:
            logits = x @ w.t()  # the output layer's materialised [T, V/tp] logits
            if variant.startswith("unfused"):
                lp, ent = vocab_parallel_logprobs(
                    logits, targets, tp_group, chunk_size=chunk, with_entropy=entropy,
                    inplace_backward=True,
                )  # fmt: skip
            else:
                lp, ent = slime.calculate_log_probs_and_entropy(
                    logits, targets, tp_group, with_entropy=True, with_entropy_grad=False
                )
                lp = lp.reshape(-1)
        return lp, ent

    times, peaks = [], []
    for _ in range(reps + 1):
        grad = not variant.endswith("_nograd")
        h = h0.clone().requires_grad_(grad)
        w = w0.clone().requires_grad_(grad)
        if tp > 1:
            dist.barrier()  # world (= the TP group): both ranks start each timed call together
        before = rss_mb()
        reset_peak()
        t0 = time.perf_counter()
        run(h, w)
        times.append(time.perf_counter() - t0)
        peaks.append(max(peak_mb() - before, 0.0))
        del h, w
    times = sorted(times[1:])  # the first call warms the allocator and the BLAS
    if tp > 1:
        dist.barrier()  # world: no rank exits while the other is still in a collective
    return {"variant": variant, "tokens": tokens, "time_s": times[len(times) // 2],
            "peak_extra_mb": peaks[0], "kept_logits": keep_logits}  # fmt: skip


def _launch(args: list, tp: int, port: int) -> dict:
    launcher = [sys.executable]
    if tp > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(tp)]
        launcher += ["--master-port", str(port)]
    out = subprocess.run(
        launcher + [__file__] + args, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def last_stage_main(a) -> None:
    from rich.console import Console
    from rich.table import Table

    from megatron_p3o.runtime.ports import free_port

    slime = a.slime or os.environ.get("SLIME_REPO", "")
    wanted = a.variants.split(",") if a.variants else list(LAST_STAGE)
    unknown = sorted(set(wanted) - set(LAST_STAGE))
    if unknown:
        print(f"bench_logprob: --variants: unknown {', '.join(unknown)} "
              f"(known: {', '.join(LAST_STAGE)})", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    variants = [v for v in LAST_STAGE if v in wanted and (v != "slime" or slime)]
    if not slime:
        print("no slime checkout (--slime or $SLIME_REPO): slime's column is skipped")
    runs: dict = {}  # (variant, T) -> one result per round
    for rnd in range(a.rounds):
        for tokens in [int(x) for x in a.tokens_list.split(",")]:
            for v in variants:
                if a.rounds > 1:
                    print(f"round {rnd + 1}/{a.rounds}: {v} at T={tokens}", flush=True)
                args = ["--last-stage-worker", v, "--tokens", str(tokens), "--vocab",
                        str(a.vocab), "--hidden", str(a.hidden), "--reps", str(a.reps)]  # fmt: skip
                args += ["--chunk", str(a.chunk)] if a.chunk else []
                args += ["--slime", slime] if v == "slime" else []
                runs.setdefault((v, tokens), []).append(_launch(args, a.tp, free_port()))
    # each (variant, T): its median round; ratios: per round (runs next to each other), median
    rows = {k: sorted(rs, key=lambda r: r["time_s"])[(len(rs) - 1) // 2] for k, rs in runs.items()}
    t = Table(
        title=f"last stage: matmul + ℓθ + metric entropy + backward, V={a.vocab}, "
        f"h={a.hidden}, TP={a.tp}, fp32, median of {a.reps} calls"
        + (f", median of {a.rounds} interleaved rounds" if a.rounds > 1 else "")
    )
    cols = ("T", "variant", "time s", "peak extra MB", "time / unfused*", "peak / unfused*")
    for col in cols:
        t.add_column(col)
    for (v, tokens), r in rows.items():
        kind = next((k for k in ("_nograd", "_step") if v.endswith(k)), "")  # _kept: one pass
        u = rows.get(("unfused" + kind, tokens))
        t.add_row(
            str(tokens), v, f"{r['time_s']:.3f}", f"{r['peak_extra_mb']:.0f}",
            f"{r['time_s'] / u['time_s']:.2f}×" if u else "—",
            f"{r['peak_extra_mb'] / max(u['peak_extra_mb'], 1e-9):.3f}×" if u else "—",
        )  # fmt: skip
    Console().print(t)
    print("* against the unfused row of the same kind (one pass with backward, no-grad, step)")
    big = max(int(x) for x in a.tokens_list.split(","))

    def ratio(num: str, den: str, key: str = "time_s", fmt: str = ".2f") -> str:
        """rows[num] / rows[den] at the largest T, or nan where --variants left one out."""
        x, y = rows.get((num, big)), rows.get((den, big))
        return format(x[key] / max(y[key], 1e-9), fmt) if x and y else "nan"

    kept = rows.get(("fused_kept", big))
    if kept:
        print(
            f"fused_kept at T={big}: logits kept for the backward: {kept['kept_logits']} "
            "(batch.keep_logits: auto, where T × V/tp fp32 fits the memory plan's room)"
        )
    vs_slime = "nan"
    for tokens in sorted({k[1] for k in runs}):
        if ("slime", tokens) not in runs or ("fused_kept", tokens) not in runs:
            continue
        per_round = [
            k["time_s"] / x["time_s"]
            for k, x in zip(runs[("fused_kept", tokens)], runs[("slime", tokens)])
        ]
        print(
            f"trainer's path / slime at T={tokens}, round by round: "
            + ", ".join(f"{x:.3f}" for x in per_round)
            + f"; median {statistics.median(per_round):.3f}"
        )
        if tokens == big:
            vs_slime = f"{statistics.median(per_round):.3f}"
    print(
        f"one pass (matmul + ℓθ + entropy + backward) at T={big}: fused / unfused "
        f"{ratio('fused', 'unfused')}× (the recomputed logits: a 4th matmul of the output "
        "layer's size); RESULT's fused_vs_unfused_time is the trainer's step through the ESS "
        "pre-pass, trainer_vs_slime_time its path with kept graphs (one pass + e_B)"
    )
    print(
        f"RESULT fused_vs_unfused_time={ratio('fused_step', 'unfused_step')} "
        f"fused_vs_unfused_peak={ratio('fused', 'unfused', 'peak_extra_mb', '.3f')} "
        f"trainer_vs_slime_time={vs_slime} "
        f"prepass_trainer_vs_slime_time={ratio('fused_step', 'slime')} "
        f"fused_vs_unfused_one_pass_time={ratio('fused', 'unfused')}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", action="store_true", help="the kernel-only comparison")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--tokens-list", default="2048,8192", help="last stage: token counts")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=512, help="last stage: hidden size")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="last stage: every (variant, T) this many times, round after round",
    )
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument(
        "--variants",
        default="",
        help="last stage: only these, comma-separated (default all; e.g. slime,fused_kept for "
        "many paired rounds of the trainer's path against slime)",
    )
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (gloo)")
    ap.add_argument("--slime", default="", help="slime work tree or git dir (last stage)")
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "DTYPE"))
    ap.add_argument("--last-stage-worker", metavar="VARIANT")
    a = ap.parse_args()
    if a.last_stage_worker:
        res = last_stage_worker(
            a.last_stage_worker, a.tokens, a.vocab, a.hidden, a.reps, a.chunk, a.slime
        )
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(res))
        return
    if not a.kernel and not a.worker:
        a.tp = 2 if a.tp is None else a.tp
        return last_stage_main(a)
    a.tp = 1 if a.tp is None else a.tp
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
