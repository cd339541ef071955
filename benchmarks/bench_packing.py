"""Packed (THD, token-budget) against padded micro-batches, and the P3O step against a plain
cross-entropy step, side by side on the same samples.

Samples: long-tailed completions (lognormal, median 0.15 × max, max 2048 tokens) after prompts
of 32–128 tokens. A full optimizer step each time: for P3O the exact-ESS pre-pass (one no-grad
forward) + forward/backward + optimizer; for SFT Megatron's ``vocab_parallel_cross_entropy`` on
the same packed micro-batches + optimizer. Padded micro-batches hold ``--mbs`` rows of
prompt+completion maximum; packed ones the same number of tokens (the same peak activation
memory). Rounds alternate the three so drift hits them alike; medians are reported.

    python benchmarks/bench_packing.py [--samples 32 --steps 2 --hidden 256 --layers 4]

Last line: ``RESULT packed_vs_padded_speedup=<x> pad_fraction_packed=<p>
pad_fraction_padded=<q> rl_vs_sft_step=<r>``. Targets: ≥ 2.0, ≤ 0.10, ≤ 1.4.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def make_samples(n: int, max_new: int, seed: int, vocab: int):
    from megatron_p3o.types import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(32, 128)
        c = max(1, min(max_new, int(rng.lognormvariate(0.0, 1.0) * 0.15 * max_new)))
        ids = [rng.randrange(1, vocab) for _ in range(p + c)]
        lb = [-6.0 + 0.3 * rng.gauss(0, 1) for _ in range(c)]
        out.append(Sample(ids[:p], ids[p:], lb, "stop", 0, group_id=i // 8))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2, help="measured rounds (after one warm-up)")
    ap.add_argument("--max-new", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=2, help="rows per padded micro-batch")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    a = ap.parse_args()

    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from rich.console import Console
    from rich.table import Table

    from megatron_p3o.loss import build_objective
    from megatron_p3o.model.builder import BuildOptions, build_model
    from megatron_p3o.model.description import ModelDescription
    from megatron_p3o.model.forward import forward_backward
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

    groups = initialize(Layout())
    seq_length = 128 + a.max_new
    desc = ModelDescription(
        architecture="LlamaForCausalLM",
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=int(2.75 * a.hidden),
        num_layers=a.layers,
        num_heads=a.hidden // 64,
        num_kv_heads=max(1, a.hidden // 128),
        head_dim=64,
    )
    chunks = build_model(desc, groups, BuildOptions(seq_length=seq_length))
    ocfg = OptimConfig(lr=1e-6)
    ddp = wrap_ddp(chunks, groups, ocfg)
    opt = build_optimizer(ddp, groups, ocfg)
    sched = build_scheduler(opt, ocfg)
    samples = make_samples(a.samples, a.max_new, 0, a.vocab)
    adv = torch.randn(a.samples, generator=torch.Generator().manual_seed(1))
    budget = a.mbs * seq_length
    batchers = {
        "padded": MicroBatcher(BatchConfig(micro_batch_size=a.mbs), groups, seq_length, 0),
        "packed": MicroBatcher(BatchConfig(max_tokens_per_gpu=budget), groups, seq_length, 0),
    }
    built = {k: b.build(samples, adv) for k, b in batchers.items()}
    p3o = PolicyUpdate(build_objective("p3o"), groups, a.vocab)

    def sft_loss(n_tokens):
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        def loss_fn(batch, logits):
            r = batch["response"]
            mask = torch.zeros(batch["targets"].numel(), device=logits.device)
            mask[r["index"][r["mask"] > 0]] = 1.0
            ce = vocab_parallel_cross_entropy(logits.float(), batch["targets"]).reshape(-1)
            return (ce * mask).sum() / n_tokens, int(mask.sum()), {}

        return loss_fn

    def step(kind):
        mbs = built["padded" if kind == "padded" else "packed"][0][0]
        t0 = time.perf_counter()
        zero_grads(ddp, opt)
        if kind == "sft":
            n = sum(float(mb["response"]["mask"].sum()) for mb in mbs)
            forward_backward(ddp, groups, mbs, sft_loss(n))
        else:
            p3o.run(ddp, mbs)
        opt.step()
        sched.step(1)
        return time.perf_counter() - t0

    kinds = ("padded", "packed", "sft")
    times = {k: [] for k in kinds}
    for i in range(a.steps + 1):
        for k in kinds:
            t = step(k)
            if i:  # the first round is warm-up
                times[k].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    stats = {k: built[k][1] for k in ("padded", "packed")}
    lens = sorted(len(s.completion_ids) for s in samples)
    table = Table(
        title=f"{a.samples} samples, completions median {lens[len(lens) // 2]} / max "
        f"{lens[-1]} tokens; hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}; "
        f"budget {budget} tokens per micro-batch; median of {a.steps}"
    )
    for c in ("step", "micro-batches", "tokens computed", "pad fraction", "step s", "ratio"):
        table.add_column(c)
    rows = (
        ("P3O padded", "padded", med["padded"] / med["packed"], "× packed"),
        ("P3O packed", "packed", 1.0, "× packed"),
        ("SFT packed (Megatron CE)", "packed", med["sft"] / med["packed"], "× packed"),
    )
    for name, layout, ratio, unit in rows:
        st = stats[layout]
        key = "sft" if name.startswith("SFT") else layout
        table.add_row(
            name,
            f"{st['microbatches_per_rank']:.0f}",
            f"{st['tokens_per_microbatch_mean'] * st['microbatches_per_rank']:.0f}",
            f"{st['pad_fraction']:.3f}",
            f"{med[key]:.2f}",
            f"{ratio:.2f}{unit}",
        )
    Console().print(table)
    print(
        f"RESULT packed_vs_padded_speedup={med['padded'] / med['packed']:.2f} "
        f"pad_fraction_packed={stats['packed']['pad_fraction']:.3f} "
        f"pad_fraction_padded={stats['padded']['pad_fraction']:.3f} "
        f"rl_vs_sft_step={med['packed'] / med['sft']:.2f}"
    )


if __name__ == "__main__":
    main()
