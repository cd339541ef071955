"""Rank bodies for e_B without a second forward (``batch.keep_graphs``, issue 55): one optimizer
step through the ESS pre-pass and the same step with every forward's graph kept, on the same
weights and the same micro-batches, compared bit for bit on every rank."""

from __future__ import annotations

import torch

from megatron_p3o.checkpoint.state import load_model_state
from megatron_p3o.loss import build_objective
from megatron_p3o.loss.config import LossConfig
from megatron_p3o.model.builder import BuildOptions, build_model
from megatron_p3o.update import step_memory
from megatron_p3o.update.batching import BatchConfig, MicroBatcher
from megatron_p3o.update.optim import OptimConfig, wrap_ddp, zero_grads
from megatron_p3o.update.policy_update import PolicyUpdate

from .bodies import FAMILIES, desc_of
from .packing_bodies import BUDGET, _my_share, advantages_for, make_samples


def _step(groups, ddp, family, objective, mode, keep, prepass_fuse=1, keep_logits="never"):
    """One step's metrics, the path it took (where e_B came from, whether the fused kernel kept
    its logits) and every parameter's accumulated gradient."""
    samples = make_samples(family)
    mine, adv = _my_share(samples, advantages_for(objective, samples), groups)
    if mode == "packed":  # 2 to 5 micro-batches per rank, several sequences in some
        cfg = BatchConfig(max_tokens_per_gpu=BUDGET)
    else:
        cfg = BatchConfig(micro_batch_size=1)
    (mbs,), _ = MicroBatcher(cfg, groups, BUDGET, 0).build(mine, adv)
    loss_cfg = LossConfig(objective=objective, prepass_fuse=prepass_fuse)
    step = PolicyUpdate(
        build_objective(objective), groups, FAMILIES[family]["vocab_size"], loss_cfg,
        keep_graphs=keep, keep_logits=keep_logits,
    )  # fmt: skip
    paths = []
    plan = step.plan

    def recorded(*a, **k):
        p = plan(*a, **k)
        paths.append((p.ess_from, p.keep_logits))
        return p

    step.plan = recorded
    if step.objective.recomputes_old(loss_cfg.old_logprobs):
        step.recompute_old_logprobs(ddp, mbs)
    zero_grads(ddp)
    metrics = step.run(ddp, mbs)
    grads = [p.main_grad.detach().clone() for c in ddp for p in c.parameters()]
    return metrics, paths[-1], grads, len(mbs)


def kept_vs_prepass(groups, family, init, mode="packed", objective="p3o", fused=True, fuse=1):
    """The pre-pass step and the kept-graph step (``keep_graphs: always``) on the same weights
    and micro-batches: ``{paths, micro, same_grads, diffs}`` of this rank (metrics that differ,
    the histogram compared as a list)."""
    chunks = build_model(desc_of(family), groups,
                         BuildOptions(seq_length=BUDGET, fused_logprob=fused))  # fmt: skip
    load_model_state(chunks, init)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    m0, (path0, kept0), g0, n = _step(groups, ddp, family, objective, mode, "never", fuse)
    # the kept step also keeps the fused kernel's logits (batch.keep_logits: auto, room here)
    m1, (path1, kept1), g1, _ = _step(groups, ddp, family, objective, mode, "always", fuse,
                                      keep_logits="auto")  # fmt: skip
    prepass = (m0.pop("ess_prepass", None), m1.pop("ess_prepass", None))
    diffs = {k: (m0[k], m1.get(k)) for k in m0 if m0[k] != m1.get(k)}
    diffs.update({k: (None, m1[k]) for k in m1 if k not in m0})
    rel = {k: abs(a - b) / max(abs(a), 1e-30) for k, (a, b) in diffs.items()
           if isinstance(a, float) and isinstance(b, float)}  # fmt: skip
    same = len(g0) == len(g1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    worst = max(float((a - b).abs().max()) for a, b in zip(g0, g1))
    scale = max(float(a.abs().max()) for a in g0)
    return {"paths": (path0, path1), "micro": n, "same_grads": same, "worst": worst / scale,
            "diffs": diffs, "rel": rel, "ess": m1.get("ess"), "loss": m1.get("loss"),
            "prepass": prepass, "kept_logits": (kept0, kept1)}  # fmt: skip


def auto_with_one_rank_short(groups, family, init):
    """``keep_graphs: auto`` where DP rank 1 has no room for the graphs: every rank takes the
    pre-pass (the verdicts travel with the step's counts), and with room on both they keep."""
    chunks = build_model(desc_of(family), groups, BuildOptions(seq_length=BUDGET))
    load_model_state(chunks, init)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    room = step_memory.room_for_graphs
    out = {}
    try:
        step_memory.room_for_graphs = lambda dev: 0.0 if groups.rank == 1 else room(dev)
        _, (out["short"], _), _, _ = _step(groups, ddp, family, "p3o", "packed", "auto")
    finally:
        step_memory.room_for_graphs = room
    _, (out["room"], _), _, _ = _step(groups, ddp, family, "p3o", "packed", "auto")
    return out
