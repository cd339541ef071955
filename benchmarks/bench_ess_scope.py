"""Optimizer-step time of ESS scope ``step`` (exact: one extra no-grad forward) against scope
``microbatch`` (FeynRL: no extra pass), side by side on the tiny model. Target: ≤ 1.35×.

    python benchmarks/bench_ess_scope.py [--steps 8 --micro 4 --mbs 4 --seq 128]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--mbs", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=512)
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
    from megatron_p3o.model.forward import next_token_targets
    from megatron_p3o.runtime.parallel import Layout, initialize
    from megatron_p3o.update.optim import (
        OptimConfig,
        build_optimizer,
        build_scheduler,
        wrap_ddp,
        zero_grads,
    )
    from megatron_p3o.update.policy_update import PolicyUpdate

    groups = initialize(Layout())
    desc = ModelDescription(
        architecture="LlamaForCausalLM",
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=a.hidden // 4,
    )
    chunks = build_model(desc, groups, BuildOptions(seq_length=a.seq))
    ocfg = OptimConfig(lr=1e-5)
    ddp = wrap_ddp(chunks, groups, ocfg)
    opt = build_optimizer(ddp, groups, ocfg)
    sched = build_scheduler(opt, ocfg)
    g = torch.Generator().manual_seed(0)

    def batch():
        mbs = []
        for _ in range(a.micro):
            tok = torch.randint(0, a.vocab, (a.mbs, a.seq), generator=g)
            mask = torch.ones(a.mbs, a.seq)
            mask[:, : a.seq // 4] = 0
            mask[:, -1] = 0
            mbs.append(
                {
                    "tokens": tok,
                    "targets": next_token_targets(tok),
                    "loss_mask": mask,
                    "behavior_logprobs": -math.log(a.vocab)
                    + 0.3 * torch.randn(a.mbs, a.seq, generator=g),
                    "advantages": torch.randn(a.mbs, 1, generator=g).expand(a.mbs, a.seq).clone(),
                }
            )
        return mbs

    losses = {
        s: PolicyUpdate(build_objective("p3o"), groups, a.vocab, LossConfig(ess_scope=s))
        for s in ("step", "microbatch")
    }
    times = {s: [] for s in losses}
    for i in range(a.steps + 1):
        for scope, sl in losses.items():  # alternate, so drift hits both alike
            mbs = batch()
            t0 = time.perf_counter()
            zero_grads(ddp, opt)
            sl.run(ddp, mbs)
            opt.step()
            sched.step(1)
            if i:  # first round is warm-up
                times[scope].append(time.perf_counter() - t0)
    med = {s: statistics.median(t) for s, t in times.items()}
    t = Table(
        title=f"P3O step time, {a.micro}×{a.mbs}×{a.seq} tokens, hidden {a.hidden}, "
        f"vocab {a.vocab}, median of {a.steps}"
    )
    for c in ("ess scope", "step time s", "ratio to microbatch"):
        t.add_column(c)
    for s in ("microbatch", "step"):
        t.add_row(s, f"{med[s]:.4f}", f"{med[s] / med['microbatch']:.2f}×")
    Console().print(t)


if __name__ == "__main__":
    main()
