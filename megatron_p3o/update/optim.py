"""Megatron DDP wrapping and the (distributed) optimizer.

Why: gradient reduction must *sum* over DP×CP and let our loss carry the one global normalizer
(see ``loss/``); this module configures Megatron-Core's own DDP, ``finalize_model_grads`` and
``get_megatron_optimizer`` that way, so no compensating scale factor appears anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Sequence

import torch

from megatron_p3o.runtime import mcore_compat
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.runtime.fields import check_choice, check_ranges
from megatron_p3o.runtime.parallel import ParallelGroups


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer settings.

    Attributes:
        lr: peak learning rate.
        min_lr: floor of the schedule.
        weight_decay: decoupled weight decay (AdamW).
        adam_beta1 / adam_beta2 / adam_eps: Adam moments.
        clip_grad: global gradient-norm clip (0 disables).
        distributed_optimizer: shard optimizer state over DP (Megatron's distributed optimizer).
        grad_reduce_in_fp32: accumulate and reduce gradients in fp32.
        lr_warmup_steps: linear warm-up from 0 to ``lr``, in optimizer steps.
        lr_decay_steps: steps over which ``lr`` decays to ``min_lr`` (after warm-up).
        lr_decay_style: "constant", "linear" or "cosine".
        moments_dtype: dtype of Adam's two moments: "float32", or "bfloat16" (Megatron's
            precision-aware optimizer: fp32 master weights, bf16 moments — 8 instead of 12 bytes
            of state per parameter; needs the distributed optimizer and Transformer Engine's
            FusedAdam, so GPUs only).
        log_update_size: measure every optimizer step's update ‖Δθ‖ and ‖θ‖ (metrics
            ``update_norm``, ``param_norm``, ``update_rel``): the effective step size under Adam,
            after clipping. Costs one copy of this rank's main parameters per step (stress
            experiments turn it on; off by default).
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = True
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 1
    lr_decay_style: str = "constant"
    moments_dtype: str = "float32"
    log_update_size: bool = False

    RANGES: ClassVar[Dict[str, str]] = {
        "lr": "> 0",
        "min_lr": ">= 0",
        "weight_decay": ">= 0",
        "adam_beta1": "in [0, 1)",
        "adam_beta2": "in [0, 1)",
        "adam_eps": "> 0",
        "clip_grad": ">= 0",
        "lr_warmup_steps": ">= 0",
        "lr_decay_steps": ">= 1",
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES, "optim")
        if self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr={self.min_lr} must be <= optim.lr={self.lr}")
        check_choice(
            "optim.lr_decay_style", self.lr_decay_style,
            ("constant", "linear", "cosine", "inverse-square-root"),
        )  # fmt: skip
        check_choice("optim.moments_dtype", self.moments_dtype, ("float32", "bfloat16"))
        if self.moments_dtype != "float32" and not self.distributed_optimizer:
            raise ConfigError(
                "optim.moments_dtype=bfloat16 (precision-aware optimizer) needs "
                "optim.distributed_optimizer: true"
            )


def wrap_ddp(
    chunks: Sequence[torch.nn.Module], groups: ParallelGroups, cfg: OptimConfig
) -> List[torch.nn.Module]:
    """Wrap model chunks in Megatron's DDP and point the schedules at our grad finalizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        ddp = DistributedDataParallel(
            config=chunk.config,
            ddp_config=ddp_cfg,
            module=chunk,
            # Only the first chunk's buckets are built eagerly; as Megatron's training does.
            disable_bucketing=i > 0,
            pg_collection=groups.pg_collection,
        )
        wrapped.append(ddp)
    config = chunks[0].config
    config.no_sync_func = [m.no_sync for m in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = _finalizer(groups)
    return wrapped


def _finalizer(groups: ParallelGroups):
    from megatron.core.distributed import finalize_model_grads

    def finalize(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        # DP×CP all-reduce (sum), tied-embedding sync across PP stages. No division by a token
        # count: the loss was already divided by the step's global count before backward.
        finalize_model_grads(
            model, None, pg_collection=groups.pg_collection, force_all_reduce=force_all_reduce
        )

    return finalize


def build_optimizer(
    ddp_chunks: Sequence[torch.nn.Module], groups: ParallelGroups, cfg: OptimConfig
):
    """Megatron's optimizer (Adam/AdamW, fp32 main params, optional DP-sharded state)."""
    return mcore_compat.megatron_optimizer(
        optimizer_config(cfg, ddp_chunks[0].config.params_dtype),
        list(ddp_chunks),
        groups.pg_collection,
    )


def optimizer_config(cfg: OptimConfig, params_dtype: torch.dtype):
    """Megatron's ``OptimizerConfig`` for ``cfg``. Every field goes to the constructor:
    ``__post_init__`` derives others from them (``use_precision_aware_optimizer`` → the
    ``…_no_impact`` flag, main-param/grad dtypes), so a field set afterwards stays underived."""
    from megatron.core.optimizer import OptimizerConfig

    kwargs = {}
    if cfg.moments_dtype != "float32":
        from megatron_p3o.runtime.errors import UserError

        if not (torch.cuda.is_available() and mcore_compat.have_transformer_engine()):
            raise UserError(
                f"optim.moments_dtype={cfg.moments_dtype}: Megatron's precision-aware optimizer "
                "needs Transformer Engine's FusedAdam on GPUs; use float32 here"
            )
        moments = getattr(torch, cfg.moments_dtype)
        kwargs = dict(
            use_precision_aware_optimizer=True, exp_avg_dtype=moments, exp_avg_sq_dtype=moments
        )
    return OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.distributed_optimizer,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        params_dtype=params_dtype,
        **kwargs,
    )


def zero_grads(ddp_chunks: Sequence[torch.nn.Module], optimizer=None) -> None:
    for m in ddp_chunks:
        m.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()


def build_scheduler(optimizer, cfg: OptimConfig):
    """Megatron's LR/WD scheduler. It also applies each group's ``wd_mult`` (no decay on norms
    and biases): without it every group keeps the config's weight decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=max(cfg.lr_decay_steps, cfg.lr_warmup_steps + 1),
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def _sub_optimizers(optimizer) -> list:
    """The optimizers inside Megatron's ``ChainedOptimizer`` (dense and expert parameters), or
    ``optimizer`` itself."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _counted_params(sub) -> List[torch.Tensor]:
    """The main parameters ``sub`` updates, filtered exactly as Megatron filters their gradients
    for the gradient norm (``MegatronOptimizer.get_main_grads_for_grad_norm``): the second copy
    of a tied embedding (``shared``) and tensor-parallel replicas (norm weights on every TP rank)
    count once. With the distributed optimizer these are this DP rank's fp32 shards."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    tp = getattr(sub, "tp_group", None)
    return [
        p
        for p in sub.get_parameters()
        if param_is_not_shared(p) and tensor_parallel.param_is_not_tensor_parallel_duplicate(p, tp)
    ]


class UpdateSize:
    """The size of one optimizer step's update, ‖Δθ‖₂ = ‖θ_after − θ_before‖₂ over every
    parameter of the model, and ‖θ_before‖₂: under Adam the update is ≈ lr per coordinate
    whatever the gradient's scale, so this (not the gradient norm) is what a stress setting's
    step actually did to the weights.

    Construct it just before ``optimizer.step()`` (it copies the main parameters), call
    :meth:`measure` after. The norms reduce as Megatron reduces the gradient norm: its own
    ``get_grad_norm_fp32`` over each sub-optimizer's ``get_grad_stats_parallel_group()`` (the
    model-parallel group; the whole world with the distributed optimizer, whose DP shards are
    disjoint), sub-optimizers combined as √Σ‖·‖². Every rank gets the same numbers.
    """

    def __init__(self, optimizer):
        self.subs = [(s, _counted_params(s)) for s in _sub_optimizers(optimizer)]
        self.before = [[p.detach().clone() for p in ps] for _, ps in self.subs]

    @torch.no_grad()
    def measure(self) -> Dict[str, float]:
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

        upd2 = par2 = 0.0
        for (sub, ps), old in zip(self.subs, self.before):
            group = sub.get_grad_stats_parallel_group()  # model-parallel (or world): see above
            delta = [p.detach().float() - o.float() for p, o in zip(ps, old)]
            upd2 += float(get_grad_norm_fp32(delta, grad_stats_parallel_group=group)) ** 2
            par2 += float(get_grad_norm_fp32(old, grad_stats_parallel_group=group)) ** 2
        self.before = []
        upd, par = math.sqrt(upd2), math.sqrt(par2)
        return {
            "update_norm": upd,
            "param_norm": par,
            "update_rel": upd / par if par > 0 else float("nan"),
        }


def over_epochs(batch_cfg, one_step) -> list:
    """``(epoch, mini-batch, metrics)`` of every optimizer step of one rollout batch:
    ``batch.epochs`` passes over its ``batch.minibatches`` steps, in that order. The policy's
    update and R2PO's head phase share it; ``one_step(m)`` runs mini-batch ``m``'s step."""
    return [
        (epoch, m, one_step(m))
        for epoch in range(batch_cfg.epochs)
        for m in range(batch_cfg.minibatches)
    ]
