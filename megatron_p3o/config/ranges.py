"""The range table of the run configuration: every numeric key's bound, checked at load and in
``TrainConfig.validate`` with the key and the numbers in the message; URL and choice checks."""

from __future__ import annotations

import difflib
from typing import Optional, Sequence, Tuple

from megatron_p3o.runtime.errors import (
    ConfigError,
)

_RULES = {
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    ">= 2": lambda v: v >= 2,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "a port in [1, 65535]": lambda v: 1 <= v <= 65535,
    "in [0, 65535] (0: a free port)": lambda v: 0 <= v <= 65535,
}
RANGES: Tuple[Tuple[str, str], ...] = (
    ("steps", ">= 1"),
    ("model.seq_length", ">= 2"),
    ("model.moe_aux_loss_coeff", ">= 0"),
    *((f"parallel.{k}", ">= 1") for k in ("tp", "pp", "cp", "ep", "vpp", "etp", "world_size")),
    ("optim.lr", "> 0"),
    ("optim.min_lr", ">= 0"),
    ("optim.weight_decay", ">= 0"),
    ("optim.adam_beta1", "in [0, 1)"),
    ("optim.adam_beta2", "in [0, 1)"),
    ("optim.adam_eps", "> 0"),
    ("optim.clip_grad", ">= 0"),
    ("optim.lr_warmup_steps", ">= 0"),
    ("optim.lr_decay_steps", ">= 1"),
    ("loss.prepass_fuse", ">= 1"),
    ("loss.logprob_chunk", ">= 1"),
    ("rollout.embedded_max_batch", ">= 1"),
    ("rollout.n_samples", ">= 1"),
    ("rollout.sync_every", ">= 1"),
    ("rollout.max_staleness", ">= 0"),
    ("rollout.dynamic_max_rounds", ">= 0"),
    ("rollout.logprob_noise", ">= 0"),
    ("rollout.logit_noise", ">= 0"),
    ("rollout.weight_rounding_step", "in [0, 1]"),
    ("rollout.engine_temperature", "> 0"),
    ("rollout.weight_sync_port", "a port in [1, 65535]"),
    ("rollout.sglang.mem_fraction_static", "in (0, 1]"),
    ("rollout.sglang.max_total_tokens", ">= 1"),
    ("rollout.sglang.tp_size", ">= 1"),
    ("rollout.sglang.port", "a port in [1, 65535]"),
    ("rollout.sglang.router_port", "in [0, 65535] (0: a free port)"),
    ("rollout.sglang.servers", ">= 1"),
    ("rollout.sglang.startup_timeout_s", "> 0"),
    ("rollout.sglang.request_timeout_s", "> 0"),
    ("rollout.sglang.max_concurrency", ">= 1"),
    ("rollout.sglang.request_batch", ">= 1"),
    ("rollout.sglang.max_retries", ">= 0"),
    ("rollout.sglang.max_restarts", ">= 0"),
    ("data.eval_every", ">= 0"),
    ("data.task_train_size", ">= 1"),
    ("data.task_heldout_size", ">= 1"),
    ("advantage.eps", ">= 0"),
    ("batch.prompts_per_rollout", ">= 1"),
    ("batch.minibatches", ">= 1"),
    ("batch.epochs", ">= 1"),
    ("batch.micro_batch_size", ">= 1"),
    ("batch.max_tokens_per_gpu", ">= 1"),
    ("checkpoint.every", ">= 0"),
    ("checkpoint.keep_last", ">= 0"),
    ("reference.reset_every", ">= 0"),
    ("r2po.head_clip", "> 0"),
    ("r2po.head_kl_coef", ">= 0"),
    ("r2po.head.lr", "> 0"),
    ("r2po.head.weight_decay", ">= 0"),
    ("r2po.head.clip_grad", ">= 0"),
    ("r2po.head.init_std", ">= 0"),
    ("eval.every", ">= 0"),
)


def _value_at(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_ranges(cfg) -> None:
    """Every value of :data:`RANGES` in its range (and finite), one line naming the first that
    is not, e.g. ``optim.lr=-0.001 must be > 0``; then the few ranges between two values."""
    import math

    for path, rule in RANGES:
        v = _value_at(cfg, path)
        if v is None:
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{path}={v} must be a finite number")
        if not _RULES[rule](v):
            raise ConfigError(f"{path}={v} must be {rule}")
    o = cfg.optim
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} must be <= optim.lr={o.lr}")
    _choice(
        "optim.lr_decay_style", o.lr_decay_style,
        ("constant", "linear", "cosine", "inverse-square-root"),
    )  # fmt: skip
    try:
        cfg.replay.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_url(path: str, url: Optional[str]) -> None:
    """``http(s)://host:port``: without a scheme urllib raises ``unknown url type`` mid-run."""
    from urllib.parse import urlsplit

    if url is None:
        return
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{path}={url!r} is not a URL like http://HOST:PORT")


def _choice(path: str, value, choices: Sequence) -> None:
    if value not in choices:
        near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        raise ConfigError(
            f"{path}={value!r}; choose one of {list(choices)}"
            f"{f' (did you mean {near[0]!r}?)' if near else ''}"
        )


# -- strict loading ----------------------------------------------------------------------------
