"""Rank bodies for the reference model, ReVal and R2PO tests.

Reference side: a TP=1 GPTModel in float64 run on *each sequence alone* (positions from 0),
log-probs and log-partitions with ``torch.log_softmax`` / ``torch.logsumexp``, R2PO's head as
plain float64 matrices (W₁, W₂ of the same seeded draw, whole), and the losses written from the
papers' formulas here — none of ``reference.py``, ``loss/reval.py``, ``rollout_head.py`` or the
batching code is used on that side.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_p3o.advantage.estimators import rarity_advantages
from megatron_p3o.checkpoint.state import load_model_state
from megatron_p3o.logprob.reference import ReferenceModel
from megatron_p3o.loss import build_objective
from megatron_p3o.loss.config import LossConfig
from megatron_p3o.loss.reval import ReValConfig, reval_rewards
from megatron_p3o.model.builder import BuildOptions
from megatron_p3o.model.rollout_head import HeadOptimConfig, RolloutHead
from megatron_p3o.update.batching import BatchConfig, MicroBatcher
from megatron_p3o.update.optim import OptimConfig, wrap_ddp, zero_grads
from megatron_p3o.update.policy_update import PolicyUpdate

from .bodies import FAMILIES, _build, desc_of, grad_errors, save_grads
from .packing_bodies import BUDGET, _my_share, make_samples

BETA = 0.5
HEAD_STD = 0.05  # large enough that the residual changes the logits visibly
HEAD_SEED = 11
HEAD_SAMPLES = (0, 2, 3)  # 4 + 11 + 7 tokens: one packed micro-batch


def _rewards_01(samples):
    """0/1 rewards: group 0 mixed (1 of 4 correct: rare outcome), group 1 all equal."""
    for i, s in enumerate(samples):
        s.reward = 1.0 if i in (1,) else 0.0
    return samples


def _batches(groups, samples, adv, packed=True):
    cfg = BatchConfig(max_tokens_per_gpu=BUDGET) if packed else BatchConfig(micro_batch_size=2)
    mine, a = _my_share(samples, adv, groups)
    (mbs,), _ = MicroBatcher(cfg, groups, BUDGET, 0).build(mine, a)
    return mbs


def _last_stage_rows(groups, mbs, keys):
    """``{sample index: {key: list}}`` of the response tensors on the last stage (all DP)."""
    out = {}
    if groups.is_last_stage():
        for mb in mbs:
            r = mb["response"]
            for i, sid in enumerate(r["sample_index"].tolist()):
                # the completion's length: its last policy token (a multi-turn sample's
                # environment span sits mid-completion, mask 0)
                on = r["mask"][i].nonzero()
                n = int(on.max()) + 1 if on.numel() else 0
                out[sid] = {
                    k: (r[k][i, :n].tolist() if r[k].dim() == 2 else float(r[k][i])) for k in keys
                }
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, out)  # world: every rank's share, for the test's assertions
    merged = {}
    for p in parts:
        merged.update(p)
    return merged


# -- reference model -------------------------------------------------------------------------
def reference_scores(groups, family, init):
    """ℓref and V_ref(s₁) of every sample from the reference model at this layout."""
    ref = ReferenceModel(desc_of(family), groups, BuildOptions(seq_length=BUDGET), init, 1.0)
    samples = make_samples(family)
    mbs = _batches(groups, samples, [0.0] * len(samples))
    ref.score(mbs, with_value=True)
    return _last_stage_rows(groups, mbs, ("ref_logprobs", "ref_values"))


def _logits_hidden(model, s, vocab):
    """``(logits [s, V], h [s, d])`` of one sequence alone; h = the output layer's input."""
    ids = torch.tensor(s.prompt_ids + s.completion_ids)[None]
    hidden = []
    hook = model.output_layer.register_forward_hook(lambda m, a, o: hidden.append(a[0]))
    logits = model(ids, torch.arange(ids.shape[1])[None], None)[0, :, :vocab].double()
    hook.remove()
    return logits, hidden[0][:, 0].double()


def _seq_forward(model, s, vocab, head=None):
    """float64 (ℓ [c], lse at p−1, and with ``head`` = (W₁, W₂) ℓ of the mixed logits)."""
    logits, h = _logits_hidden(model, s, vocab)
    p, c = len(s.prompt_ids), len(s.completion_ids)
    tgt = torch.tensor(s.completion_ids)[:, None]
    lp = torch.log_softmax(logits, -1)[p - 1 : p - 1 + c].gather(-1, tgt)[:, 0]
    lse = torch.logsumexp(logits[p - 1], -1)
    mixed = None
    if head is not None:
        z = logits + (torch.relu(h @ head[0].t()) @ head[1].t())[:, :vocab]
        mixed = torch.log_softmax(z, -1)[p - 1 : p - 1 + c].gather(-1, tgt)[:, 0]
    return lp, lse, mixed


def _f64(groups, family, ckpt):
    """A TP=1 GPTModel with ``ckpt``'s weights, in float64 (the reference side)."""
    (model,) = _build(family, groups, seq=BUDGET)
    load_model_state([model], ckpt)
    return model.double()


def reference_scores_f64(groups, family, init):
    model = _f64(groups, family, init)
    vocab = FAMILIES[family]["vocab_size"]
    out = {}
    with torch.no_grad():
        for i, s in enumerate(make_samples(family)):
            lp, lse, _ = _seq_forward(model, s, vocab)
            out[i] = {"ref_logprobs": lp.tolist(), "ref_values": float(lse), "policy": s.mask()}
    return out


# -- ReVal -----------------------------------------------------------------------------------
def reval_step(groups, family, init, ref_init, out, value_grad=True, packed=True):
    """One ReVal optimizer step's loss and gradients (saved to ``out``) at this layout."""
    chunks = _build(family, groups, seq=BUDGET)
    load_model_state(chunks, init)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    ref = ReferenceModel(desc_of(family), groups, BuildOptions(seq_length=BUDGET), ref_init, 1.0)
    samples = make_samples(family)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    gids = torch.tensor([s.group_id for s in samples])
    h = ReValConfig(beta=BETA, value_grad=value_grad)
    mbs = _batches(groups, samples, reval_rewards(rewards, gids, h).float(), packed)
    ref.score(mbs, with_value=True)
    obj = build_objective("reval", beta=BETA, value_grad=value_grad)
    step = PolicyUpdate(obj, groups, FAMILIES[family]["vocab_size"], LossConfig())
    zero_grads(ddp)
    metrics = step.run(ddp, mbs)
    save_grads(chunks, out)
    return {"metrics": metrics}


def reval_reference(groups, family, init, ref_init, compare_dirs=(), value_grad=True):
    """float64 ReVal: δ_i = V_θ − V_ref + Σ(ℓθ − ℓref) − (r_i − mean_group r)/β; mean δ²."""
    model, refm = _f64(groups, family, init), _f64(groups, family, ref_init)
    vocab = FAMILIES[family]["vocab_size"]
    samples = make_samples(family)
    deltas = []
    for s in samples:
        lp, v, _ = _seq_forward(model, s, vocab)
        with torch.no_grad():
            lr, vr, _ = _seq_forward(refm, s, vocab)
        group = [x.reward for x in samples if x.group_id == s.group_id]
        r = s.reward - sum(group) / len(group)
        v = v if value_grad else v.detach()
        m = torch.tensor(s.mask(), dtype=torch.float64)  # the policy's tokens only
        deltas.append(v - vr + ((lp - lr) * m).sum() - r / BETA)
    d = torch.stack(deltas)
    loss = (d * d).mean()
    loss.backward()
    _, errors = grad_errors(groups, family, model, compare_dirs, dtype=torch.float64)
    return {"loss": float(loss), "errors": errors}


def reval_split_sequence(groups, family, init):
    """A step whose two micro-batches hold the same sequence: must be refused."""
    chunks = _build(family, groups, seq=BUDGET)
    load_model_state(chunks, init)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    samples = make_samples(family)[:2]
    mbs = _batches(groups, samples, [0.0, 0.0])
    for mb in mbs:
        mb["response"]["ref_logprobs"] = torch.zeros_like(mb["response"]["mask"])
        mb["response"]["ref_values"] = torch.zeros(mb["response"]["mask"].shape[0])
    twice = mbs + [{**mbs[0], "response": dict(mbs[0]["response"])}]
    step = PolicyUpdate(build_objective("reval"), groups, FAMILIES[family]["vocab_size"])
    try:
        step.run(ddp, twice)
    except ValueError as e:
        return str(e)
    return None


# -- R2PO ------------------------------------------------------------------------------------
def _head(groups, chunks):
    return RolloutHead(chunks, groups, HeadOptimConfig(init_std=HEAD_STD), seed=HEAD_SEED)


def head_matrices(groups, family):
    """The head's whole W₁, W₂ (TP=1 draw of the same seed), for the float64 reference."""
    chunks = _build(family, groups, seq=BUDGET)
    head = _head(groups, chunks)
    return head.w1.detach().double(), head.w2.detach().double()


def head_logits(groups, family, init):
    """Mixed logits z^μ of one packed micro-batch at this layout, gathered over TP, and the
    base logits; with the token positions of each sequence's completion."""
    from megatron_p3o.model.forward import forward_backward

    chunks = _build(family, groups, seq=BUDGET)
    load_model_state(chunks, init)
    head = _head(groups, chunks)
    samples = [make_samples(family)[i] for i in HEAD_SAMPLES]
    mbs = _batches(groups, samples, [0.0] * 3)
    got = {}

    def loss_fn(batch, logits):
        full = logits.detach()
        if groups.layout.tp_enabled:
            parts = [torch.empty_like(full) for _ in range(groups.layout.tp)]
            dist.all_gather(parts, full.contiguous(), group=groups.tp)  # TP: whole vocabulary
            full = torch.cat(parts, -1)
        got.setdefault("logits", []).append(full[0])
        got.setdefault("index", []).append(batch["response"]["index"])
        return logits.sum() * 0, 0, {}

    with torch.no_grad():
        with head.mixed():
            forward_backward(chunks, groups, mbs, loss_fn, forward_only=True)
        mixed = got.pop("logits")
        forward_backward(chunks, groups, mbs, loss_fn, forward_only=True)
    if not groups.is_last_stage():
        return None
    vocab = FAMILIES[family]["vocab_size"]
    return {
        "mixed": [m[:, :vocab] for m in mixed],
        "base": [b[:, :vocab] for b in got["logits"]],
        "order": [mb["response"]["sample_index"] for mb in mbs],
        "cu": [mb["cu_seqlens"] for mb in mbs],
    }


def head_logits_f64(groups, family, init):
    """float64 W_lm·h + W₂·ReLU(W₁·h) of each of the three sequences alone."""
    model = _f64(groups, family, init)
    w1, w2 = head_matrices(groups, family)
    vocab = FAMILIES[family]["vocab_size"]
    out = []
    for s in [make_samples(family)[i] for i in HEAD_SAMPLES]:
        with torch.no_grad():
            z, h = _logits_hidden(model, s, vocab)
        out.append((z + (torch.relu(h @ w1.t()) @ w2.t())[:, :vocab], z))
    return out


def r2po_phases(groups, family, init, ref_init, out):
    """Head phase then policy phase on one batch, as :mod:`megatron_p3o.update.r2po` runs them: the
    head's loss and gradients (gathered over TP); the policy phase's loss and ℓold; policy
    gradients saved to ``out``."""
    chunks = _build(family, groups, seq=BUDGET)
    load_model_state(chunks, init)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    head = _head(groups, chunks)
    ref = ReferenceModel(desc_of(family), groups, BuildOptions(seq_length=BUDGET), ref_init, 1.0)
    vocab = FAMILIES[family]["vocab_size"]
    samples = _rewards_01(make_samples(family))
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    gids = torch.tensor([s.group_id for s in samples])
    # head phase
    mbs = _batches(groups, samples, rarity_advantages(rewards, gids).float())
    ref.score(mbs)
    obj = build_objective("ppo", eps_low=0.2, eps_high=0.2, kl_coef=0.04)
    upd = PolicyUpdate(obj, groups, vocab, LossConfig(objective="ppo"))
    with head.mixed():
        upd.recompute_old_logprobs(ddp, mbs)
        for mb in mbs:  # a stale ℓμ,old (as after an earlier head step): the ratio is not 1
            if "old_logprobs" in mb["response"]:
                r = mb["response"]
                r["old_logprobs"] = r["old_logprobs"] + _stale(r["sample_index"], r["mask"])
        zero_grads(ddp)
        head.zero_grad()
        head_metrics = upd.run(ddp, mbs)
    head.reduce_grads()
    grads = {}
    if head.on_stage:
        g2 = head.w2.grad
        if groups.layout.tp_enabled:
            parts = [torch.empty_like(g2) for _ in range(groups.layout.tp)]
            dist.all_gather(parts, g2.contiguous(), group=groups.tp)  # TP: W₂'s whole gradient
            g2 = torch.cat(parts)
        grads = {"w1": head.w1.grad.clone(), "w2": g2[:vocab].clone()}
    # policy phase: GRPO on the base head, ℓold recomputed from the base head
    adv = (rewards - torch.tensor([rewards[gids == g].mean() for g in gids.tolist()])).float()
    pmbs = _batches(groups, samples, adv)
    grpo = PolicyUpdate(build_objective("grpo"), groups, vocab, LossConfig(objective="grpo"))
    grpo.recompute_old_logprobs(ddp, pmbs)
    old = _last_stage_rows(groups, pmbs, ("old_logprobs",))
    zero_grads(ddp)
    pol_metrics = grpo.run(ddp, pmbs)
    save_grads(chunks, out)
    return {"head": head_metrics, "head_grads": grads, "policy": pol_metrics, "old": old}


def _stale(sample_index, mask):
    """0.3·sin(1 + 7·i + j) at token j of sample i (the shift the reference applies too)."""
    j = torch.arange(mask.shape[1])[None].float()
    return 0.3 * torch.sin(1.0 + 7.0 * sample_index[:, None].float() + j) * mask


def r2po_reference(groups, family, init, ref_init, compare_dirs=()):
    """float64 head phase (PPO-clip on μ with the stale ℓμ,old, +0.04·k3(μ‖ref), rarity
    advantage, token mean) and policy phase (GRPO on the base head, ℓold = the base head's, so
    the ratio is 1; sequence-mean of token-means), written from the R2PO paper."""
    model, refm = _f64(groups, family, init), _f64(groups, family, ref_init)
    w1, w2 = head_matrices(groups, family)
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    vocab = FAMILIES[family]["vocab_size"]
    samples = _rewards_01(make_samples(family))
    adv = {}  # rarity: c_i = 1/#{j: R_j = R_i}, standardised in the group; all-equal skipped
    for g in sorted({s.group_id for s in samples}):
        idx = [i for i, s in enumerate(samples) if s.group_id == g]
        r = [samples[i].reward for i in idx]
        if len(set(r)) == 1:
            continue
        c = torch.tensor([1.0 / r.count(x) for x in r], dtype=torch.float64)
        c = (c - c.mean()) / (((c - c.mean()) ** 2).mean().sqrt() + 1e-6)
        adv.update({i: float(v) for i, v in zip(idx, c)})
    head_sum, n_tok = 0.0, 0
    for i, s in enumerate(samples):
        if i not in adv:
            continue
        _, _, mu = _seq_forward(model, s, vocab, head=(w1, w2))
        with torch.no_grad():
            lr, _, _ = _seq_forward(refm, s, vocab)
        j = torch.arange(mu.numel(), dtype=torch.float64)
        old = mu.detach() + 0.3 * torch.sin(1.0 + 7.0 * i + j)
        ratio = torch.exp(mu - old)
        a = adv[i]
        surr = -torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
        k3 = (mu - lr) + torch.exp(lr - mu) - 1.0
        m = torch.tensor(s.mask(), dtype=torch.bool)  # environment tokens reach no loss
        head_sum = head_sum + (surr + 0.04 * k3)[m].sum()
        n_tok += int(m.sum())
    head_loss = head_sum / n_tok
    head_loss.backward()
    head_grads = {"w1": w1.grad.clone(), "w2": w2.grad[:vocab].clone()}
    model.zero_grad()
    # policy phase
    old, pol = {}, []
    for i, s in enumerate(samples):
        lp, _, _ = _seq_forward(model, s, vocab)
        group = [x.reward for x in samples if x.group_id == s.group_id]
        a = s.reward - sum(group) / len(group)
        ratio = torch.exp(lp - lp.detach())
        m = torch.tensor(s.mask(), dtype=torch.bool)
        pol.append((-torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a))[m].mean())
        old[i] = {"ref_logprobs": lp.detach().tolist(), "policy": s.mask()}
    pol_loss = torch.stack(pol).mean()
    pol_loss.backward()
    _, errors = grad_errors(groups, family, model, compare_dirs, dtype=torch.float64)
    return {
        "head_loss": float(head_loss),
        "head_grads": head_grads,
        "policy_loss": float(pol_loss),
        "old": old,
        "errors": errors,
    }


def policy_err(got, want):
    """Largest |Δℓref| over the tokens the policy sampled (a trajectory's environment tokens
    carry no log-prob), after checking both sides cover the same completion."""
    assert len(got["ref_logprobs"]) == len(want["ref_logprobs"]), (got, want)
    pairs = zip(got["ref_logprobs"], want["ref_logprobs"], want["policy"])
    return max(abs(a - b) for a, b, m in pairs if m)
