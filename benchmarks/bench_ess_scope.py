"""The training phase of a P3O step against GRPO's on the same tokens: what e_B costs.

GRPO with its ratio against the engine's log-probs (``loss.old_logprobs: behaviour``) needs no
forward beyond its gradient pass; P3O's e_B is a statistic of the whole step. Variants, side by
side on the same packed micro-batches of the tiny recipe's shape (``recipes/models/tiny-llama``:
hidden 64, 2 layers; 32 prompts × 8 samples of 7–10 prompt and 1–5 completion tokens, packed at
``--budget`` tokens: 6 micro-batches at 512), one optimizer step each, alternating round by
round so contention hits them alike:

- ``grpo``: GRPO, ``old_logprobs: behaviour`` (Megatron's schedule, nothing else);
- ``p3o``: P3O as the trainer runs it, ``batch.keep_graphs: auto`` (e_B from the gradient
  pass's own forwards, their graphs kept, when they fit);
- ``p3o_prepass``: P3O with ``keep_graphs: never`` (the ESS pre-pass: one no-grad forward of
  every micro-batch first);
- ``p3o_microbatch``: ESS scope ``microbatch`` (FeynRL: each micro-batch's own e_B, no extra
  pass; not the step's e_B).

The training phase is what the trainer's ``train_s`` times: packing the samples, the update
(counts, e_B, forward/backward, metrics), the optimizer and the LR schedule. Median of
``--steps`` after a warm-up round. Target: ``p3o`` ≤ 1.05× ``grpo``.

    python benchmarks/bench_ess_scope.py [--steps 30 --budget 512 --threads 2]

Last line: ``RESULT p3o_vs_grpo_train=… p3o_prepass_vs_grpo_train=…
p3o_microbatch_vs_grpo_train=…``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_samples(vocab: int, seed: int, prompts: int = 32, n: int = 8):
    """The tiny recipe's shapes: ``prompts`` × ``n`` samples, 7–10 prompt and 1–5 completion
    tokens, ℓb near uniform with engine-like noise (ρ ≠ 1: e_B matters)."""
    from megatron_p3o.types import Sample

    rng = random.Random(seed)
    out = []
    for i in range(prompts * n):
        p, c = rng.randint(7, 10), rng.randint(1, 5)
        ids = [rng.randrange(3, vocab) for _ in range(p + c)]
        lb = [-math.log(vocab) + 0.3 * rng.gauss(0, 1) for _ in range(c)]
        out.append(Sample(ids[:p], ids[p:], lb, "stop", 0, group_id=i // n))
    return out, [rng.gauss(0, 1) for _ in out]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--budget", type=int, default=512, help="tokens per packed micro-batch")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--variants", default="grpo,p3o,p3o_prepass,p3o_microbatch")
    a = ap.parse_args()

    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from rich.console import Console
    from rich.table import Table

    from megatron_p3o.loss import build_objective
    from megatron_p3o.loss.config import LossConfig
    from megatron_p3o.model.builder import BuildOptions, build_model
    from megatron_p3o.model.description import ModelDescription
    from megatron_p3o.runtime.parallel import Layout, initialize
    from megatron_p3o.update.batching import BatchConfig, MicroBatcher
    from megatron_p3o.update.optim import (
        OptimConfig,
        build_optimizer,
        build_scheduler,
        wrap_ddp,
        zero_grads,
    )
    from megatron_p3o.update.policy_update import PolicyUpdate

    torch.set_num_threads(a.threads)
    groups = initialize(Layout())
    raw = json.loads((ROOT / "recipes/models/tiny-llama/config.json").read_text())
    desc = ModelDescription.from_hf_config(raw)
    chunks = build_model(desc, groups, BuildOptions(seq_length=16, fused_logprob=True))
    ocfg = OptimConfig(lr=2e-4)
    ddp = wrap_ddp(chunks, groups, ocfg)
    opt = build_optimizer(ddp, groups, ocfg)
    sched = build_scheduler(opt, ocfg)
    batcher = MicroBatcher(BatchConfig(max_tokens_per_gpu=a.budget), groups, 16, 0)
    settings = {
        "grpo": ("grpo", LossConfig(objective="grpo", old_logprobs="behaviour"), "never"),
        "p3o": ("p3o", LossConfig(), "auto"),
        "p3o_prepass": ("p3o", LossConfig(), "never"),
        "p3o_microbatch": ("p3o", LossConfig(ess_scope="microbatch"), "never"),
    }
    variants = a.variants.split(",")
    updates = {
        v: PolicyUpdate(
            build_objective(settings[v][0]),
            groups,
            desc.vocab_size,
            settings[v][1],
            keep_graphs=settings[v][2],
        )  # fmt: skip
        for v in variants
    }
    times = {v: [] for v in variants}
    paths, micro = {}, 0
    for i in range(a.steps + 1):
        samples, adv = make_samples(desc.vocab_size, seed=i)
        for v, upd in updates.items():  # alternate, so drift hits every variant alike
            t0 = time.perf_counter()
            (mbs,), _ = batcher.build(samples, adv)
            zero_grads(ddp, opt)
            upd.run(ddp, mbs)
            opt.step()
            sched.step(1)
            if i:  # the first round is the warm-up
                times[v].append(time.perf_counter() - t0)
            else:
                paths[v] = upd.plan(mbs, ddp).ess_from
                micro = len(mbs)
    med = {v: statistics.median(t) for v, t in times.items()}
    base = med.get("grpo", next(iter(med.values())))
    t = Table(
        title=f"training phase per optimizer step, {micro} micro-batches of ≤ {a.budget} tokens, "
        f"tiny model, {a.threads} threads, median of {a.steps}"
    )
    for c in ("variant", "e_B from", "ms", "spread (q1–q3)", "/ grpo"):
        t.add_column(c, justify="right")
    for v in variants:
        q = statistics.quantiles(times[v], n=4)
        t.add_row(v, paths[v], f"{1e3 * med[v]:.1f}", f"{1e3 * q[0]:.1f}–{1e3 * q[2]:.1f}",
                  f"{med[v] / base:.3f}×")  # fmt: skip
    Console(width=120).print(t)
    if "grpo" in med:
        print("RESULT " + " ".join(f"{v}_vs_grpo_train={med[v] / base:.3f}" for v in variants
                                   if v != "grpo"))  # fmt: skip


if __name__ == "__main__":
    main()
