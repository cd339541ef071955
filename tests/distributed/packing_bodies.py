"""Rank bodies for the sequence-packing tests.

Reference: a TP=1 GPTModel run on *each sequence alone* (no padding, no packing, positions from
0), ℓθ taken with ``torch.log_softmax`` in float64, and the objective written from the formulas
doc in float64 (``tests/unit/test_objectives.ref_loss``) — none of the packing code is used.
"""

from __future__ import annotations

import math

import torch

from megatron_p3o.checkpoint.state import load_model_state
from megatron_p3o.loss import build_objective
from megatron_p3o.loss.config import LossConfig
from megatron_p3o.loss.oapl import oapl_advantages
from megatron_p3o.model.forward import forward_backward
from megatron_p3o.types import Sample
from megatron_p3o.update.batching import BatchConfig, MicroBatcher
from megatron_p3o.update.optim import OptimConfig, wrap_ddp, zero_grads
from megatron_p3o.update.policy_update import PolicyUpdate

from .bodies import FAMILIES, _build, grad_errors, save_grads

BUDGET = 32  # tokens per packed micro-batch; also model.seq_length (the longest sample)
N_SAMPLES = 8
# (prompt, completion) lengths: from 1 completion token up to a sample filling the budget
LENGTHS = [(3, 1), (5, 27), (2, 9), (4, 3), (6, 14), (3, 29), (2, 2), (4, 20)]


def env_span(c: int):
    """Positions of a multi-turn sample's environment tokens (an observation with its template
    pieces, mid-completion), or None for a single-turn sample: every completion of 9 tokens
    or more is a trajectory (issue 53) — 4 of the 8, next to 4 single-turn samples."""
    return range(c // 3, c // 3 + 4) if c >= 9 else None


def make_samples(family: str, seed: int = 5):
    """Samples with long-tailed lengths, random ℓb near uniform, rewards in 2 groups of 4; the
    longer ones are multi-turn trajectories (:func:`env_span`: ℓb 0, version −1, policy mask
    0 there), so every layout test also checks that no environment token reaches the loss."""
    g = torch.Generator().manual_seed(seed)
    vocab = FAMILIES[family]["vocab_size"]
    out = []
    for i, (p, c) in enumerate(LENGTHS):
        ids = torch.randint(1, vocab, (p + c,), generator=g).tolist()
        lb = (-math.log(vocab) + 0.5 * torch.randn(c, generator=g)).tolist()
        span, mask, versions = env_span(c), None, None
        if span is not None:
            mask = [0 if j in span else 1 for j in range(c)]
            lb = [x if m else 0.0 for x, m in zip(lb, mask)]
            versions = [0 if m else -1 for m in mask]
        s = Sample(ids[:p], ids[p:], lb, "stop", 0, group_id=i // 4, token_versions=versions,
                   policy_mask=mask)  # fmt: skip
        s.reward = float(torch.rand((), generator=g))
        out.append(s)
    return out


def advantages_for(objective: str, samples, per_token: bool = False):
    """Per sequence; with ``per_token`` the multi-turn samples get one value per turn on its
    tokens (``rollout.multi_turn.credit: turn``), as a list per completion token."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    if objective == "oapl":
        return oapl_advantages(rewards, torch.tensor([s.group_id for s in samples])).float()
    adv = (rewards - rewards.mean()).float()
    if not per_token:
        return adv
    out = []
    for i, s in enumerate(samples):
        span = env_span(len(s.completion_ids))
        if span is None:
            out.append(float(adv[i]))
            continue
        late = float(adv[i]) * 0.5 - 0.25  # the turn after the observation: another value
        out.append([float(adv[i]) if j < span.start else late for j in range(len(s.mask()))])
    return out


def advantage_grid(adv, samples, longest: int) -> torch.Tensor:
    """``[n, longest]`` float64 of :func:`advantages_for`'s per-token form."""
    grid = torch.zeros(len(samples), longest, dtype=torch.float64)
    for i, (a, s) in enumerate(zip(adv, samples)):
        c = len(s.completion_ids)
        grid[i, :c] = torch.tensor(a if isinstance(a, list) else [a] * c, dtype=torch.float64)
    return grid


def _my_share(samples, adv, groups):
    dp, r = groups.layout.dp, groups.dp_rank
    per = len(samples) // dp
    return samples[r * per : (r + 1) * per], adv[r * per : (r + 1) * per]


def packed_step(
    groups, family, init, out, mode="packed", objective="p3o", balance=True, scope="step",
    dispatcher="allgather", hyper=None, per_token=False,
):  # fmt: skip
    """One optimizer step's gradients (saved to ``out``) with packed or padded micro-batches."""
    chunks = _build(family, groups, seq=BUDGET, dispatcher=dispatcher)
    load_model_state(chunks, init)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    samples = make_samples(family)
    mine, adv = _my_share(samples, advantages_for(objective, samples, per_token), groups)
    if mode == "packed":
        cfg = BatchConfig(max_tokens_per_gpu=BUDGET, balance_dp=balance)
    else:
        cfg = BatchConfig(micro_batch_size=2)
    equal = scope == "microbatch"
    (mbs,), stats = MicroBatcher(cfg, groups, BUDGET, 0, equal_counts=equal).build(mine, adv)
    step = PolicyUpdate(
        build_objective(objective, **(hyper or {})),
        groups,
        FAMILIES[family]["vocab_size"],
        LossConfig(ess_scope=scope),
    )
    if step.objective.needs_old_logprobs:  # as the trainer does: ℓold at the step's weights
        step.recompute_old_logprobs(ddp, mbs)
    zero_grads(ddp)
    metrics = step.run(ddp, mbs)
    save_grads(chunks, out)
    shapes = [tuple(mb["tokens"].shape) for mb in mbs]
    return {"metrics": metrics, "stats": stats, "shapes": shapes}


def reference(groups, family, init, compare_dirs=(), objective="p3o", hyper=None,
              per_token=False):  # fmt: skip
    """float64 loss of the whole step from per-sequence forwards; grads vs ``compare_dirs``."""
    from tests.unit.test_objectives import ref_loss

    (model,) = _build(family, groups, seq=BUDGET)
    load_model_state([model], init)
    model.double()  # the whole reference forward in float64
    vocab = FAMILIES[family]["vocab_size"]
    samples = make_samples(family)
    n, longest = len(samples), max(len(s.completion_ids) for s in samples)
    lp = torch.zeros(n, longest, dtype=torch.float64)
    lb = torch.zeros(n, longest, dtype=torch.float64)
    mask = torch.zeros(n, longest, dtype=torch.float64)
    rows = []
    for i, s in enumerate(samples):
        ids = torch.tensor(s.prompt_ids + s.completion_ids)[None]
        logits = model(ids, torch.arange(ids.shape[1])[None], None)[0, :, :vocab]
        p, c = len(s.prompt_ids), len(s.completion_ids)
        logp = torch.log_softmax(logits.double(), -1)[p - 1 : p - 1 + c]
        rows.append(logp.gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0])
        lb[i, :c] = torch.tensor(s.logprobs, dtype=torch.float64)
        mask[i, :c] = torch.tensor(s.mask(), dtype=torch.float64)  # the policy's tokens
    lp = torch.stack([torch.nn.functional.pad(r, (0, longest - r.numel())) for r in rows])
    adv = advantages_for(objective, samples, per_token)
    adv = advantage_grid(adv, samples, longest) if per_token else adv.double()
    # ℓold: the recompute at the step's weights is ℓθ itself (objectives that need it)
    lold = lp.detach() if build_objective(objective).needs_old_logprobs else lb
    x = dict(
        lp=lp, lb=lb, lold=lold, lref=None, mask=mask, adv=adv, hyper=hyper or {},
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float64),
        groups=torch.tensor([s.group_id for s in samples]),
    )  # fmt: skip
    loss = ref_loss(objective, x)
    loss.backward()
    _, errors = grad_errors(groups, family, model, compare_dirs, dtype=torch.float64)
    d = torch.where(mask > 0, lp.detach() - lb, torch.zeros_like(lb))
    rho = torch.exp(d) * mask
    ess = float(rho.sum() ** 2 / (mask.sum() * (rho * rho).sum()))
    return {"loss": float(loss), "ess": ess, "errors": errors}


def packed_logits(groups, family, init, perturb: int = -1):
    """Logits of one packed micro-batch of three sequences (forward only), this rank's tokens,
    with sequence ``perturb``'s tokens changed; also which sequence each local token is in."""
    from megatron_p3o.model.packed import token_index
    from megatron_p3o.update.batching import packed_microbatch

    chunks = _build(family, groups, seq=BUDGET)
    load_model_state(chunks, init)
    samples = make_samples(family)[1:4]
    if perturb >= 0:
        s = samples[perturb]
        s.completion_ids = [(t * 7 + 3) % 250 + 1 for t in s.completion_ids]
        s.prompt_ids = [(t * 5 + 1) % 250 + 1 for t in s.prompt_ids]
    align = 2 * groups.layout.cp if groups.layout.cp > 1 else 1
    mb = packed_microbatch(samples, [0.0] * 3, [0, 1, 2], BUDGET, 0, align, align)
    seq_of = torch.zeros(mb["tokens"].shape[1], dtype=torch.long)
    cu = mb["cu_seqlens"].tolist()
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        seq_of[a:b] = i
    mine = token_index(
        tuple(mb["tokens"].shape), mb["cu_seqlens"], groups.cp_rank, groups.layout.cp
    )
    got = []

    def loss_fn(batch, logits):
        got.append(logits.detach().clone())
        return logits.sum() * 0, 0, {}

    with torch.no_grad():
        forward_backward(chunks, groups, [mb], loss_fn, forward_only=True)
    return {"logits": got[0][0] if got else None, "seq_of": seq_of[mine]}


def dir_errors(groups, family, a: str, b: str):
    """Relative L2 difference (float64) of every tensor saved in ``a`` against ``b``."""
    (ma,) = _build(family, groups, seq=BUDGET)
    (mb,) = _build(family, groups, seq=BUDGET)
    load_model_state([ma], a)
    load_model_state([mb], b)
    pb_ = dict(mb.named_parameters())
    return {
        n: float((p.double() - pb_[n].double()).norm() / pb_[n].double().norm().clamp_min(1e-30))
        for n, p in ma.named_parameters()
    }


def rollout_metrics_over_dp(groups, per_rank):
    """The trainer's reduction of the step's rollout numbers (``reduce_rollout_metrics``) on
    this rank's ``per_rank[dp_rank]``."""
    from megatron_p3o.observability.metrics import reduce_rollout_metrics

    out = dict(per_rank[groups.dp_rank])
    reduce_rollout_metrics(out, groups)
    return out
