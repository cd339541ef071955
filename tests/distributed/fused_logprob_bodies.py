"""Rank bodies for the fused output layer + log-prob tests.

Kernel side: one seeded ``h [S, B, D]``, ``W [VPAD, D]`` on every rank; rank r takes its
vocabulary shard of W (and, with sequence parallelism, its slice of the sequence of h, gathered
by the kernel's own input mapping). Model side: the existing bodies (packed P3O/PPO steps, the
reference model, ReVal, R2PO) run with every model built ``fused_logprob=True``
(:func:`fused_builds`), against their float64 references or the same run unfused.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

import megatron_p3o.logprob.reference as reference_module
import megatron_p3o.logprob.scoring as pu  # where the trainer calls the fused kernel
from megatron_p3o.checkpoint.state import load_model_state
from megatron_p3o.logprob.fused import fused_vocab_parallel_logprobs
from megatron_p3o.loss import build_objective
from megatron_p3o.loss.config import LossConfig
from megatron_p3o.model.output_layer import output_layer_input
from megatron_p3o.update.batching import BatchConfig, MicroBatcher
from megatron_p3o.update.optim import (
    OptimConfig,
    build_optimizer,
    build_scheduler,
    wrap_ddp,
    zero_grads,
)
from megatron_p3o.update.policy_update import PolicyUpdate

from . import bodies
from . import packing_bodies as pb
from . import reval_r2po_bodies as rb

S, B, D, VPAD, VOCAB = 24, 2, 16, 320, 300


def kernel_inputs(seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(S, B, D, generator=g)
    w = 0.4 * torch.randn(VPAD, D, generator=g)
    w[vocab:] = 3.0  # padding rows: large, and must not count
    t = torch.randint(0, vocab, (B, S), generator=g)
    wts = torch.randn(3, B, S, generator=g)
    return h, w, t, wts


def kernel_case(groups, temperature, chunk, sp=False, vocab=VOCAB):
    """ℓ, H, lse and the gradients of Σ w₀ℓ + w₁H + w₂lse w.r.t. this rank's h (its sequence
    slice with ``sp``) and its W shard, through :func:`output_layer_input` as the trainer
    maps the output layer's input."""
    h, w, t, wts = kernel_inputs(vocab=vocab)
    tp, r = groups.layout.tp, groups.tp_rank
    v = VPAD // tp
    s_loc = S // tp if sp else S
    h_mine = h[r * s_loc : (r + 1) * s_loc] if sp else h
    h_mine = h_mine.clone().requires_grad_()
    w_mine = w[r * v : (r + 1) * v].clone().requires_grad_()
    hidden = output_layer_input(h_mine, groups.tp, sp).transpose(0, 1)  # [B, S, D]
    lp, ent, lse = fused_vocab_parallel_logprobs(
        hidden, w_mine, t, groups.tp, temperature, chunk, True, vocab, True
    )
    ((lp * wts[0]).sum() + (ent * wts[1]).sum() + (lse * wts[2]).sum()).backward()
    return {
        "lp": lp.detach(), "ent": ent.detach(), "lse": lse.detach(), "gh": h_mine.grad,
        "gw": w_mine.grad, "tp_rank": r,
    }  # fmt: skip


# -- model side ------------------------------------------------------------------------------
@contextmanager
def fused_builds(on: bool = True):
    """Every model the bodies build (policy and reference) built with ``fused_logprob=on``;
    counts the fused kernel's calls from the trainer's ``response_logprobs`` (and those with
    extra logit terms)."""
    orig_build = bodies.build_model
    orig_ref = reference_module.build_model
    orig_kernel = pu.fused_vocab_parallel_logprobs
    calls = [0, 0]  # fused kernel calls, of which with extra logit terms (R2PO's head)

    def build(desc, groups, opts):
        return orig_build(desc, groups, dataclasses.replace(opts, fused_logprob=on))

    def kernel(*a, **k):
        calls[0] += 1
        calls[1] += bool(k.get("extra"))
        return orig_kernel(*a, **k)

    bodies.build_model = reference_module.build_model = build
    pu.fused_vocab_parallel_logprobs = kernel
    try:
        yield calls
    finally:
        bodies.build_model, reference_module.build_model = orig_build, orig_ref
        pu.fused_vocab_parallel_logprobs = orig_kernel


def packed_step(groups, fused=True, **kw):
    """:func:`packing_bodies.packed_step` with fused (or unfused) models."""
    with fused_builds(fused) as calls:
        res = pb.packed_step(groups, **kw)
    return {**res, "fused_calls": calls[0], "last": groups.is_last_stage()}


def reference_scores(groups, fused=True, **kw):
    with fused_builds(fused) as calls:
        res = rb.reference_scores(groups, **kw)
    return {"scores": res, "fused_calls": calls[0], "last": groups.is_last_stage()}


def reval_step(groups, fused=True, **kw):
    with fused_builds(fused) as calls:
        res = rb.reval_step(groups, **kw)
    return {**res, "fused_calls": calls[0], "last": groups.is_last_stage()}


def r2po_phases(groups, fused=True, **kw):
    with fused_builds(fused) as calls:
        res = rb.r2po_phases(groups, **kw)
    return {**res, "fused_calls": calls[0], "head_term_calls": calls[1]}


def training_steps(groups, family, init, fused, objective="p3o", steps=3, dispatcher="allgather"):
    """``steps`` optimizer steps (AdamW, clipping) of ``objective`` on the packed samples, the
    trainer's order: ℓold recompute when the objective needs it, the ESS pre-pass with the metric
    entropy, the gradient pass. Returns the per-step metrics and this rank's weight updates
    (trained − initial)."""
    with fused_builds(fused) as calls:
        chunks = bodies._build(family, groups, seq=pb.BUDGET, dispatcher=dispatcher)
        load_model_state(chunks, init)
        start = {n: p.detach().clone() for n, p in chunks[-1].named_parameters()}
        cfg = OptimConfig(lr=3e-3, weight_decay=0.01, clip_grad=1.0)
        ddp = wrap_ddp(chunks, groups, cfg)
        opt = build_optimizer(ddp, groups, cfg)
        sched = build_scheduler(opt, cfg)
        samples = pb.make_samples(family)
        mine, adv = pb._my_share(samples, pb.advantages_for(objective, samples), groups)
        batch_cfg = BatchConfig(max_tokens_per_gpu=pb.BUDGET // 2)  # several micro-batches
        (mbs,), _ = MicroBatcher(batch_cfg, groups, pb.BUDGET, 0).build(mine, adv)
        step = PolicyUpdate(
            build_objective(objective), groups, bodies.FAMILIES[family]["vocab_size"],
            LossConfig(objective=objective, log_entropy=True, prepass_fuse=1),
        )  # fmt: skip
        out = []
        for _ in range(steps):
            if step.objective.needs_old_logprobs:
                step.recompute_old_logprobs(ddp, mbs)
            zero_grads(ddp, opt)
            metrics = step.run(ddp, mbs)
            ok, gnorm, _ = opt.step()
            sched.step(1)
            assert ok
            out.append({**metrics, "grad_norm": float(gnorm)})
    update = {n: p.detach() - start[n] for n, p in chunks[-1].named_parameters()}
    return {"metrics": out, "update": update, "fused_calls": calls[0]}


def padded_chunks_case(groups, elems: int, vocab: int):
    """:func:`kernel_case` with the chunk budget cut to ``elems`` logits (as a long sequence meets
    the real one), so a chunk holds a few tokens, over a padded vocabulary: the last TP rank's
    shard has fewer real rows than the others."""
    from megatron_p3o.logprob import fused
    from megatron_p3o.logprob.kernels import vocab_parallel_logprobs

    old = dict(fused._CHUNK_ELEMS)
    fused._CHUNK_ELEMS.update(cpu=elems, cuda=elems)
    try:
        out = kernel_case(groups, 0.7, None, vocab=vocab)
    finally:
        fused._CHUNK_ELEMS.clear()
        fused._CHUNK_ELEMS.update(old)
    # the unfused kernel on this rank's materialised logits, blocks of a few tokens too
    h, w, t, _ = kernel_inputs(vocab=vocab)
    v = VPAD // groups.layout.tp
    logits = h.transpose(0, 1) @ w[groups.tp_rank * v : (groups.tp_rank + 1) * v].t()
    lp, ent, lse = vocab_parallel_logprobs(logits, t, groups.tp, 0.7, 7, True, vocab,
                                           with_lse=True)  # fmt: skip
    out.update(unfused={"lp": lp, "ent": ent, "lse": lse})
    return out
