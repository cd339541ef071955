"""Rank bodies for the distributed P3O loss tests (reference: float64, single process, written
here from the formulas doc, not with the code under test)."""

from __future__ import annotations

import math

import torch

from megatron_p3o.checkpoint.state import load_model_state
from megatron_p3o.loss import build_objective
from megatron_p3o.loss.config import LossConfig
from megatron_p3o.update.optim import OptimConfig, wrap_ddp, zero_grads
from megatron_p3o.update.policy_update import PolicyUpdate

from .bodies import (
    FAMILIES,
    SEQ,
    _build,
    _split_microbatches,
    grad_errors,
    make_batch,
    reference_logprobs,
    save_grads,
)

RL_BATCH = 6


def make_rl_batch(family: str, noise: float = 0.5, seed: int = 11):
    b = make_batch(family, batch=RL_BATCH)
    g = torch.Generator().manual_seed(seed)
    vocab = FAMILIES[family]["vocab_size"]
    b["behavior_logprobs"] = -math.log(vocab) + noise * torch.randn(RL_BATCH, SEQ, generator=g)
    adv = torch.randn(RL_BATCH, generator=g)
    b["advantages"] = adv[:, None].expand(RL_BATCH, SEQ).clone()
    b["sample_index"] = torch.arange(RL_BATCH)
    b["old_logprobs"] = b["behavior_logprobs"] + 0.2 * torch.randn(RL_BATCH, SEQ, generator=g)
    b["rewards"] = torch.rand(RL_BATCH, generator=g)
    b["group_ids"] = torch.arange(RL_BATCH) // 3
    return b


def p3o_reference_loss(lp, lb, adv, mask):
    """P3O per the formulas doc, float64."""
    d = torch.where(mask > 0, lp - lb, torch.zeros_like(lp))
    rho = torch.exp(d) * mask
    n = mask.sum()
    e = (rho.sum() ** 2 / (n * (rho * rho).sum())).detach()
    k3 = (d + torch.exp(torch.clamp(-d, -10, 10)) - 1) * mask
    per = -torch.minimum(rho.detach(), e) * adv * lp + (1 - e) * k3
    return (per * mask).sum() / n, float(e)


def p3o_grads(
    groups,
    family: str,
    init: str,
    out: str,
    n_micro: int,
    scope: str = "step",
    objective: str = "p3o",
):
    chunks = _build(family, groups)
    load_model_state(chunks, init)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    step = PolicyUpdate(
        build_objective(objective),
        groups,
        FAMILIES[family]["vocab_size"],
        LossConfig(ess_scope=scope),
    )
    zero_grads(ddp)
    batch = make_rl_batch(family)
    if objective == "oapl":  # the advantage stage computes A* over whole prompt groups
        from megatron_p3o.loss.oapl import oapl_advantages

        a_star = oapl_advantages(batch["rewards"], batch["group_ids"]).float()
        batch["advantages"] = a_star[:, None].expand(RL_BATCH, SEQ).clone()
    metrics = step.run(ddp, _split_microbatches(batch, groups, n_micro))
    save_grads(chunks, out)
    return metrics


def p3o_reference(groups, family: str, init: str, compare_dirs=(), objective: str = "p3o"):
    b = make_rl_batch(family)
    model, _, lp = reference_logprobs(groups, family, init, b)
    if objective == "p3o":
        loss, e = p3o_reference_loss(
            lp, b["behavior_logprobs"].double(), b["advantages"].double(), b["loss_mask"].double()
        )
    else:
        from tests.unit.test_objectives import ref_loss

        e = None
        loss = ref_loss(
            objective,
            dict(
                lp=lp,
                lb=b["behavior_logprobs"].double(),
                lold=b["old_logprobs"].double(),
                lref=None,
                mask=b["loss_mask"].double(),
                adv=b["advantages"][:, 0].double(),
                rewards=b["rewards"].double(),
                groups=b["group_ids"],
            ),
        )
    loss.backward()
    _, errors = grad_errors(groups, family, model, compare_dirs)
    return {"loss": float(loss), "ess": e, "errors": errors}


def nan_behavior_error(groups, family: str, init: str):
    """A NaN in ℓb at a valid position must raise an error naming the sample."""
    chunks = _build(family, groups)
    load_model_state(chunks, init)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    step = PolicyUpdate(build_objective("p3o"), groups, FAMILIES[family]["vocab_size"])
    b = make_rl_batch(family)
    r, t = 4, int(b["loss_mask"][4].nonzero()[0])
    b["behavior_logprobs"][r, t] = float("nan")
    try:
        step.run(ddp, _split_microbatches(b, groups, 1))
    except ValueError as e:
        return str(e)
    return None
