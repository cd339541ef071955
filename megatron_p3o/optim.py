"""Megatron DDP wrapping and the (distributed) optimizer.

Why: gradient reduction must *sum* over DP×CP and let our loss carry the one global normalizer
(see ``loss/``); this module configures Megatron-Core's own DDP, ``finalize_model_grads`` and
``get_megatron_optimizer`` that way, so no compensating scale factor appears anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from . import mcore_compat
from .parallel import ParallelGroups


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
        from .errors import UserError

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
