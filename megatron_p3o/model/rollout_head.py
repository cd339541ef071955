"""R2PO's residual rollout head (Wang, Xu, Yuan et al., arXiv 2601.11960).

    z^μ_t = W_lm·h_t + W₂·ReLU(W₁·h_t)        W₁: d×d, W₂: V×d, no biases, init N(0, σ²)
h_t is the final normalized hidden state (the input of Megatron's ``output_layer``); rollouts
sample softmax(z^μ / T), evaluation and the policy's own log-probs use W_lm·h only.

In Megatron the head lives on the last pipeline stage, next to the output layer. W₂ is split
over the tensor-parallel group exactly like the output layer's vocabulary (rank r holds rows
[r·V/tp, (r+1)·V/tp)), so each rank adds its residual shard to its own logit shard. W₁ is
replicated over TP; the gradient reaching ReLU(W₁·h) is summed over TP (each rank saw only its
vocabulary shard), which makes W₁'s gradient and the trunk's whole on every TP rank.

The head is not a submodule of the model: Megatron's DDP, optimizer and checkpoints of the
policy never see it. It is attached by a forward hook on ``output_layer``, switched between
``base`` (the hook adds nothing) and ``mixed`` (z^μ), and has its own AdamW whose gradients are
summed over DP×CP here (the loss carries the global normalizer, as for the policy). On the fused
log-prob path (``model.fused_logprob``) no logits exist: the hook hands the kernel
ReLU(W₁·h) and W₂ as a second output-layer term instead (the same z^μ, never materialised).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_p3o.model.output_layer import SumGradOverTP
from megatron_p3o.runtime.collectives import all_gather_into, all_sum
from megatron_p3o.runtime.fields import check_ranges
from megatron_p3o.runtime.parallel import LayoutError, ParallelGroups

HF_W1, HF_W2 = "rollout_head.w1.weight", "rollout_head.w2.weight"


@dataclass(frozen=True)
class HeadOptimConfig:
    """Attributes: lr, weight_decay, clip_grad (0 = off), init_std (σ of W₁, W₂'s init)."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    init_std: float = 1e-6

    RANGES: ClassVar[Dict[str, str]] = {
        "lr": "> 0",
        "weight_decay": ">= 0",
        "clip_grad": ">= 0",
        "init_std": ">= 0",
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES, "r2po.head")


def residual_features(h: Tensor, w1: Tensor, tp_group=None) -> Tensor:
    """ReLU(W₁·h) ``[..., d]``, its gradient summed over TP (W₂'s shards each saw one part)."""
    x = torch.relu(h @ w1.t())
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        x = SumGradOverTP.apply(x, tp_group)  # W₂ shards each saw one part of x
    return x


def residual_logits(h: Tensor, w1: Tensor, w2_shard: Tensor, tp_group=None) -> Tensor:
    """W₂·ReLU(W₁·h) on this rank's vocabulary shard: ``h [..., d]`` → ``[..., V/tp]``."""
    return residual_features(h, w1, tp_group) @ w2_shard.t()


class RolloutHead:
    """W₁, W₂ (this rank's shard) on the last pipeline stage; ``None`` parameters elsewhere."""

    def __init__(self, chunks, groups: ParallelGroups, cfg: HeadOptimConfig, seed: int):
        if groups.layout.sequence_parallel:
            raise LayoutError(
                "r2po: the rollout head needs whole sequences on every TP rank; turn "
                "parallel.sequence_parallel off"
            )
        self.groups, self.cfg, self.mode = groups, cfg, "base"
        last = chunks[-1]
        self.on_stage = groups.is_last_stage()
        self.w1 = self.w2 = None
        self.vocab_size = last.description.vocab_size
        self.padded = last.padded_vocab_size
        if not self.on_stage:
            self.opt = None
            return
        d = last.description.hidden_size
        tp, r = groups.layout.tp, groups.tp_rank
        v_local = self.padded // tp
        g = torch.Generator().manual_seed(seed)  # same draw on every rank, then sliced: any TP
        w1 = torch.randn(d, d, generator=g) * cfg.init_std  # host, then the device
        w2 = torch.randn(self.padded, d, generator=g) * cfg.init_std
        w2[self.vocab_size :] = 0  # padded vocabulary rows: never sampled, never trained
        dev = groups.device
        self.w1 = torch.nn.Parameter(w1.to(dev))
        self.w2 = torch.nn.Parameter(w2[r * v_local : (r + 1) * v_local].contiguous().to(dev))
        self.opt = torch.optim.AdamW(
            [self.w1, self.w2], lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999)
        )
        self._hook = getattr(last, "module", last).output_layer.register_forward_hook(self._add)

    def _add(self, module, args, output):
        if self.mode != "mixed":
            return output
        fused = getattr(module, "p3o_fused", None)
        if fused is not None and fused.weight is not None:
            # fused log-prob path (model.fused_logprob): no logits exist; the residual joins the
            # kernel as a second output-layer term, z^μ = W_lm·h + W₂·x, x = ReLU(W₁·h)
            fused.add_term(residual_features(args[0].float(), self.w1, self.groups.tp), self.w2)
            return output
        logits, bias = output
        res = residual_logits(args[0].float(), self.w1, self.w2, self.groups.tp)
        return logits + res.to(logits.dtype), bias

    _add.p3o_fused_aware = True  # the fused output layer may keep its path with this hook

    @contextmanager
    def mixed(self):
        """The model's logits are z^μ (rollout head on) inside the block."""
        self.mode = "mixed"
        try:
            yield
        finally:
            self.mode = "base"

    def parameters(self) -> List[torch.nn.Parameter]:
        return [p for p in (self.w1, self.w2) if p is not None]

    # -- the head's optimizer step --------------------------------------------------------------
    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def reduce_grads(self) -> None:
        """Sum the head's gradients over DP×CP (each rank's tokens gave a share of the step's
        gradient; the loss already carries the step's global normalizer)."""
        if not self.on_stage:
            return
        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if dist.get_world_size(self.groups.dp_cp) > 1:
                all_sum(p.grad, self.groups.dp_cp, "the head gradient of the whole step")

    def step(self) -> float:
        """:meth:`reduce_grads`, clip by the global norm, AdamW; returns the norm (last stage;
        NaN elsewhere)."""
        if not self.on_stage:
            return float("nan")
        self.reduce_grads()
        w1, w2 = self.w1.grad, self.w2.grad
        sq = w2.double().pow(2).sum().reshape(1)
        if self.groups.layout.tp_enabled:
            all_sum(sq, self.groups.tp, "W₂'s shards make its norm (W₁ is replicated: once)")
        norm = float((sq[0] + w1.double().pow(2).sum()).sqrt())
        c = self.cfg.clip_grad
        if c and norm > c:
            for p in self.parameters():
                p.grad.mul_(c / (norm + 1e-6))
        if norm == norm and norm != float("inf"):  # non-finite gradients: no update
            self.opt.step()
        self.zero_grad()
        return norm

    # -- weights for the engine, checkpoints -------------------------------------------------
    @torch.no_grad()
    def hf_tensors(self) -> List[Tuple[str, Tensor]]:
        """``[(name, full tensor)]`` on the last stage (W₂ gathered over TP, vocabulary padding
        dropped); empty elsewhere. All TP ranks of the last stage call this."""
        if not self.on_stage:
            return []
        w2 = self.w2.detach()
        if self.groups.layout.tp_enabled:
            parts = [torch.empty_like(w2) for _ in range(self.groups.layout.tp)]
            all_gather_into(parts, w2.contiguous(), self.groups.tp,
                            "the engine needs W₂ over the whole vocabulary")  # fmt: skip
            w2 = torch.cat(parts)
        return [(HF_W1, self.w1.detach().cpu()), (HF_W2, w2[: self.vocab_size].cpu())]

    def adam_step(self) -> int:
        """Optimizer steps the head has taken (0: no Adam moments exist yet)."""
        st = self.opt.state if self.opt is not None else {}
        return int(max([float(st[p]["step"]) for p in self.parameters() if p in st] + [0]))

    def sharded_state(self, moments: bool = True) -> Dict[str, object]:
        """W₁ (replicated), W₂ (TP-sharded) and, once the head has stepped, their Adam moments,
        as dist-checkpoint tensors (a resume may use another TP/DP)."""
        from megatron.core.dist_checkpointing import ShardedTensor

        if not self.on_stage:
            return {}
        g = self.groups
        tp, r, dp = g.layout.tp, g.tp_rank, g.dp_cp_rank
        out: Dict[str, object] = {}
        st = self.opt.state
        for name, p, sharded in (("w1", self.w1, False), ("w2", self.w2, True)):
            tensors = {"": p.data}
            if moments:
                s_ = st.get(p) or {}
                for kind in ("exp_avg", "exp_avg_sq"):
                    tensors[kind] = s_[kind] if kind in s_ else torch.zeros_like(p.data)
            for kind, t in tensors.items():
                key = f"rollout_head.{name}" + (f".{kind}" if kind else "")
                if sharded:
                    out[key] = ShardedTensor.from_rank_offsets(
                        key, t, (0, r, tp), replica_id=(0, 0, dp)
                    )
                else:
                    out[key] = ShardedTensor.from_rank_offsets(key, t, replica_id=(0, r, dp))
        return {"rollout_head": out}

    def load(self, ckpt, adam_step: int) -> None:
        """Restore the head (and its Adam moments when it had stepped) from a checkpoint."""
        from megatron_p3o.checkpoint.state import load_sharded

        if not self.on_stage:
            return
        request = self.sharded_state(moments=adam_step > 0)
        loaded = load_sharded(request, ckpt)["rollout_head"]
        with torch.no_grad():
            for name, p in (("w1", self.w1), ("w2", self.w2)):
                p.copy_(loaded[f"rollout_head.{name}"])
                if adam_step:
                    self.opt.state[p] = {
                        "step": torch.tensor(float(adam_step)),
                        "exp_avg": loaded[f"rollout_head.{name}.exp_avg"].clone(),
                        "exp_avg_sq": loaded[f"rollout_head.{name}.exp_avg_sq"].clone(),
                    }
