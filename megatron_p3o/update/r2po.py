"""R2PO (Wang, Xu, Yuan et al., arXiv 2601.11960): a residual rollout head, trained in its own
phase, decouples exploration from the policy.

Rollouts are always sampled from μ_φ = softmax(z^μ / T), z^μ = W_lm·h + W₂·ReLU(W₁·h)
(:mod:`megatron_p3o.model.rollout_head`); the policy π_θ = softmax(W_lm·h / T) is what is
evaluated and served. Training alternates two phases; a round is ``head_steps`` head-phase
trainer steps followed by ``policy_steps`` policy-phase ones:

* **head phase** (trunk and lm_head frozen, W₁/W₂ train): PPO-clip on the mixed logits with
  r = exp(ℓμ − ℓμ,old) (ℓμ,old recomputed with the head before its update), clip ``head_clip``,
  plus ``head_kl_coef``·k3(μ_φ ‖ π_ref), with the rarity advantage
  (:func:`~megatron_p3o.advantage.estimators.rarity_advantages`; all-equal groups skipped);
* **policy phase** (head frozen): ``loss.objective`` on the base head — GRPO with ℓold
  recomputed from the base head (the authors' setting; ``loss.hyper.tis_cap`` adds their
  optional truncated weight min(π_old/μ, C)), or P3O, whose ratio is against the engine's μ.

The head phase runs the ordinary schedule with the head on: its trunk gradients are computed and
thrown away (the pipeline schedule needs every stage's backward), and only the head's own
optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict

import torch

from megatron_p3o.advantage.estimators import rarity_advantages
from megatron_p3o.loss import build_objective
from megatron_p3o.loss.config import LossConfig
from megatron_p3o.loss.ess import EmptyStepError
from megatron_p3o.model.rollout_head import HeadOptimConfig, RolloutHead
from megatron_p3o.observability.metrics import combine_optimizer_steps
from megatron_p3o.runtime.fields import check_ranges
from megatron_p3o.update.optim import over_epochs, zero_grads
from megatron_p3o.update.policy_update import PolicyUpdate


@dataclass(frozen=True)
class R2POConfig:
    """Attributes:
    enabled: sample rollouts with the residual head and alternate the two phases.
    head_steps: K, head-phase trainer steps at the start of every round.
    policy_steps: M, policy-phase trainer steps after them.
    head_clip: PPO clip ε of the head phase.
    head_kl_coef: weight of k3(μ_φ ‖ π_ref) in the head phase.
    head: the head's optimizer and initialisation.
    """

    enabled: bool = False
    head_steps: int = 2
    policy_steps: int = 8
    head_clip: float = 0.2
    head_kl_coef: float = 0.04
    head: HeadOptimConfig = field(default_factory=HeadOptimConfig)

    RANGES: ClassVar[Dict[str, str]] = {"head_clip": "> 0", "head_kl_coef": ">= 0"}

    def __post_init__(self):
        check_ranges(self, self.RANGES, "r2po")
        if self.head_steps < 0 or self.policy_steps < 0 or self.head_steps + self.policy_steps < 1:
            raise ValueError(
                f"r2po.head_steps={self.head_steps}, policy_steps={self.policy_steps}: both "
                ">= 0, and a round needs at least one step"
            )

    def phase(self, step: int) -> str:
        """``"head"`` or ``"policy"`` for trainer step ``step`` (0-based)."""
        in_round = step % (self.head_steps + self.policy_steps)
        return "head" if in_round < self.head_steps else "policy"


class R2PO:
    """The head, its phase's objective, and one head-phase update of a rollout batch. Given the
    trainer's model (chunks, DDP wrappers, optimizer), groups and reference model, and the
    loss and batch settings the head phase shares with the policy."""

    def __init__(self, cfg: R2POConfig, chunks, ddp, opt, groups, reference, vocab_size: int,
                 temperature: float, loss_cfg: LossConfig, batch_cfg, seed: int):  # fmt: skip
        self.cfg, self.ddp, self.opt, self.reference = cfg, ddp, opt, reference
        self.batch_cfg = batch_cfg
        self.head = RolloutHead(chunks, groups, cfg.head, seed=seed + 17)
        objective = build_objective(
            "ppo", eps_low=cfg.head_clip, eps_high=cfg.head_clip, kl_coef=cfg.head_kl_coef
        )
        loss = LossConfig(
            objective="ppo",
            logprob_chunk=loss_cfg.logprob_chunk,
            nonfinite=loss_cfg.nonfinite,
            log_entropy=loss_cfg.log_entropy,
        )
        self.update = PolicyUpdate(objective, groups, vocab_size, loss, temperature)

    def head_update(self, batch, batcher) -> Dict[str, float]:
        """One rollout batch's head-phase optimizer steps (mini-batches × epochs)."""
        adv = rarity_advantages(batch.rewards, batch.group_index)
        per_step, packing = batcher.build(batch.samples, adv)
        for mbs in per_step:  # π_ref of the base head: the initial policy
            self.reference.score(mbs)

        def one_step(m):
            zero_grads(self.ddp, self.opt)
            self.head.zero_grad()
            try:
                metrics = self.update.run(self.ddp, per_step[m])
            except EmptyStepError:  # every group all-equal: nothing to learn from
                return {"head_skipped": 1.0}
            metrics["head_grad_norm"] = self.head.step()
            metrics["head_skipped"] = 0.0
            return metrics

        with self.head.mixed():
            for mbs in per_step:  # ℓμ,old: the head before this phase's update
                self.update.recompute_old_logprobs(self.ddp, mbs)
            steps = over_epochs(self.batch_cfg, one_step)
        zero_grads(self.ddp, self.opt)  # the trunk's gradients of the head phase are discarded
        merged = combine_optimizer_steps(steps).items()
        out = {f"head/{k}": v for k, v in merged if isinstance(v, (int, float))}
        skipped = float(torch.isnan(adv).sum()) / max(len(adv), 1)
        return {**out, **packing, "head/skipped_fraction": skipped}
