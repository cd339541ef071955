"""The run configuration: frozen dataclasses loaded strictly from YAML, with ``--set`` overrides.

Why strict: a misspelt key in a 70B recipe silently falling back to a default costs a cluster-day.
Unknown keys are errors naming the key and the nearest known one; values are type-checked
(ints are not floats' silent cousins, bools are not ints); ranges and the parallel/batch
arithmetic are checked once, with the numbers in the message.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import yaml

from megatron_p3o.advantage.estimators import AdvantageConfig
from megatron_p3o.checkpoint.state import CheckpointConfig
from megatron_p3o.evaluation.heldout import EvalConfig
from megatron_p3o.logprob.reference import ReferenceConfig
from megatron_p3o.loss.config import LossConfig
from megatron_p3o.model.builder import ModelConfig
from megatron_p3o.observability.run_log import WandbConfig, check_wandb
from megatron_p3o.reward.registry import RewardConfig
from megatron_p3o.rollout.config import RolloutConfig
from megatron_p3o.rollout.prompts import DataConfig
from megatron_p3o.rollout.replay import ReplayConfig
from megatron_p3o.runtime.errors import InputFileError, UserError, one_line, read_user_text
from megatron_p3o.runtime.parallel import ParallelConfig
from megatron_p3o.update.batching import BatchConfig
from megatron_p3o.update.optim import OptimConfig
from megatron_p3o.update.r2po import R2POConfig


class ConfigError(UserError, ValueError):
    """One bad key or value; the message names its dotted path."""


@dataclass(frozen=True)
class RunConfig:
    """Attributes:
    name: run name (a directory under ``dir``).
    dir: where run directories live.
    seed: global seed (data order, sampling, init).
    exit_signals: signals that end the run after the current step with a checkpoint, exit
        status 75 (:mod:`megatron_p3o.runtime.preemption`; a ``STOP`` file in the run directory does
        the same).
    exit_after_minutes: the same after this much wall clock (None: no budget).
    allow_config_change: resume although training-relevant keys differ from the checkpoint's
        recipe (they are then logged; see :func:`config_changes`).
    """

    name: str = "run"
    dir: str = "runs"
    seed: int = 1234
    exit_signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    exit_after_minutes: Optional[float] = None
    allow_config_change: bool = False

    def __post_init__(self):
        import signal

        for name in self.exit_signals:
            if name in ("SIGKILL", "SIGSTOP") or not isinstance(
                getattr(signal, str(name), None), signal.Signals
            ):
                raise ConfigError(f"run.exit_signals: {name!r} is not a signal that can be caught")
        if self.exit_after_minutes is not None and self.exit_after_minutes <= 0:
            raise ConfigError(f"run.exit_after_minutes={self.exit_after_minutes} must be > 0")


@dataclass(frozen=True)
class TrainConfig:
    """The whole run. See ``recipes/`` for complete examples."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    r2po: R2POConfig = field(default_factory=R2POConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    steps: int = 100

    def validate(self, world_size: int) -> "TrainConfig":
        """Choices, ranges, layout and batch arithmetic; returns self."""
        from megatron_p3o.loss import build_objective
        from megatron_p3o.runtime.parallel import LayoutError

        check_ranges(self)  # also for a config built in code, not loaded from a recipe
        check_wandb(self.wandb)  # no login: refused now, not after the model is built
        self._check_sglang(world_size)
        if (
            self.rollout.weight_sync == "disk"
            and self.rollout.engine == "sglang"
            and not self.rollout.weight_sync_dir
        ):
            raise ConfigError(
                "rollout.weight_sync=disk needs rollout.weight_sync_dir (a directory every "
                "node and the SGLang servers can read)"
            )
        _choice("optim.moments_dtype", self.optim.moments_dtype, ("float32", "bfloat16"))
        if self.optim.moments_dtype != "float32" and not self.optim.distributed_optimizer:
            raise ConfigError(
                "optim.moments_dtype=bfloat16 (precision-aware optimizer) needs "
                "optim.distributed_optimizer: true"
            )
        if self.rollout.fp8_kv_cache and not self.rollout.precision.startswith("fp8"):
            raise ConfigError(
                f"rollout.fp8_kv_cache needs an fp8 rollout.precision, got "
                f"{self.rollout.precision!r}"
            )
        if self.rollout.weight_rounding_step and self.rollout.engine != "embedded":
            raise ConfigError(
                "rollout.weight_rounding_step rounds the embedded engine's copy of the weights; "
                "SGLang has no such knob (use rollout.engine=embedded)"
            )
        if self.rollout.logit_noise and self.rollout.engine != "embedded":
            raise ConfigError(
                "rollout.logit_noise perturbs the embedded engine's logits; SGLang has no such "
                "knob (use rollout.engine=embedded)"
            )
        try:
            obj = build_objective(self.loss.objective, **self.loss.hyper)
        except ValueError as e:
            msg = str(e)
            raise ConfigError(msg if msg.startswith("loss.") else f"loss: {msg}") from None
        self._check_objective_sampling(obj)
        if self.parallel.world_size is not None and self.parallel.world_size != world_size:
            raise ConfigError(
                f"parallel.world_size={self.parallel.world_size}: the recipe is written for "
                f"{self.parallel.world_size} GPUs but the launch has {world_size} ranks"
            )
        try:
            lay = self.parallel.layout().resolve(world_size)
            if self.batch.max_tokens_per_gpu is None:  # padded rows are what CP splits
                lay.check_sequence(self.model.seq_length)
        except LayoutError as e:
            raise ConfigError(str(e)) from None
        self._check_fp8_rows(lay)
        seqs = self.batch.prompts_per_rollout * self.rollout.n_samples
        packed = self.batch.max_tokens_per_gpu is not None
        per_step = lay.dp * (1 if packed else self.batch.micro_batch_size)
        if seqs % self.batch.minibatches:
            raise ConfigError(
                f"batch: prompts_per_rollout × n_samples = {self.batch.prompts_per_rollout} × "
                f"{self.rollout.n_samples} = {seqs} sequences do not split into "
                f"minibatches={self.batch.minibatches} optimizer steps"
            )
        step_seqs = seqs // self.batch.minibatches
        if step_seqs % per_step:
            raise ConfigError(
                f"batch: {step_seqs} sequences per optimizer step are not a multiple of "
                + (
                    f"dp = {lay.dp}"
                    if packed
                    else f"dp × micro_batch_size = {lay.dp} × {self.batch.micro_batch_size} "
                    f"= {per_step}"
                )
            )
        return self

    def _check_objective_sampling(self, obj) -> None:
        """ReVal reads the logits as soft Q-values: sampling must be softmax(z) itself."""
        r = self.rollout
        if obj.unit_temperature:
            s = r.sampling
            if s.temperature != 1.0 or r.engine_temperature not in (None, 1.0):
                t = s.temperature if s.temperature != 1.0 else r.engine_temperature
                raise ConfigError(
                    f"rollout.sampling.temperature={t}: loss.objective={self.loss.objective!r} "
                    "reads the logits as soft Q-values, so rollouts must sample softmax(z) at "
                    "temperature 1"
                )
            if s.truncated:
                raise ConfigError(
                    f"rollout.sampling.top_p={s.top_p} / top_k={s.top_k}: "
                    f"loss.objective={self.loss.objective!r} needs the full softmax(z) "
                    "(top_p=1, top_k=0)"
                )
        if self.r2po.enabled and r.engine != "embedded":
            raise ConfigError(
                f"r2po.enabled with rollout.engine={r.engine!r}: sampling with R2PO's residual "
                "head needs a custom model class in SGLang, which this project does not ship; "
                "use rollout.engine=embedded"
            )
        if self.r2po.enabled and self.parallel.sequence_parallel:
            raise ConfigError(
                "r2po.enabled with parallel.sequence_parallel: the rollout head needs whole "
                "sequences on every TP rank"
            )
        needs_ref = obj.needs_ref_logprobs or self.r2po.enabled
        if self.reference.enabled is False and needs_ref:
            raise ConfigError(
                f"reference.enabled=false, but loss.objective={self.loss.objective!r} with "
                f"{dict(self.loss.hyper)} needs the reference model's log-probs"
            )

    def _check_fp8_rows(self, lay) -> None:
        """FP8 training: padded micro-batches must give every rank a multiple of 16 token rows
        (packed ones are padded to it, see batching.token_multiple)."""
        from megatron_p3o.update.batching import token_multiple

        if not self.model.fp8 or self.batch.max_tokens_per_gpu is not None:
            return
        rows = self.batch.micro_batch_size * self.model.seq_length
        need = token_multiple(lay, fp8=True)
        if rows % need:
            raise ConfigError(
                f"model.fp8={self.model.fp8}: micro_batch_size × seq_length = "
                f"{self.batch.micro_batch_size} × {self.model.seq_length} = {rows} tokens is not "
                f"a multiple of {need} (16 FP8 rows per rank × cp × tp under sequence "
                "parallelism); change seq_length, or pack (batch.max_tokens_per_gpu)"
            )

    def _check_sglang(self, world_size: int) -> None:
        r = self.rollout
        if r.engine == "sglang" and r.weight_sync == "colocated":
            if r.max_staleness > 0 or r.sync_every > 1:
                raise ConfigError(
                    f"rollout.weight_sync=colocated with rollout.max_staleness={r.max_staleness}, "
                    f"sync_every={r.sync_every}: a colocated server frees its GPU memory for every "
                    "update and takes it back with the new weights, so it cannot generate "
                    "meanwhile nor skip a sync; use max_staleness=0 and sync_every=1, or "
                    "weight_sync=distributed"
                )
            if r.sglang.tp_size > world_size:
                raise ConfigError(
                    f"rollout.weight_sync=colocated: rollout.sglang.tp_size={r.sglang.tp_size} "
                    f"> {world_size} trainer GPUs (server rank r shares trainer rank r's GPU)"
                )
        if r.engine == "sglang" and r.sglang.kv_cache_dtype == "fp8_e5m2":
            raise ConfigError(
                "rollout.sglang.kv_cache_dtype=fp8_e5m2 forces SGLang's triton attention "
                "backend; use fp8_e4m3"
            )
        if r.engine == "sglang" and r.sglang.quantization not in (None, "fp8"):
            raise ConfigError(
                f"rollout.sglang.quantization={r.sglang.quantization!r}: SGLang's online "
                "quantization replaces the weights' Parameters without their loaders, so weight "
                "pushes fail; use quantization=fp8 (a block-FP8 checkpoint, pushes quantized by "
                "the trainer) or null"
            )
        if r.engine == "sglang":
            _check_url("rollout.sglang.url", r.sglang.url)
            for i, u in enumerate(r.sglang_workers):
                _check_url(f"rollout.sglang_workers[{i}]", u)
            self._check_sglang_device()

    def _check_sglang_device(self) -> None:
        """What the server's device (and the weight group's backend) can do."""
        from megatron_p3o.rollout.sglang.launch import check_device_flags, resolve_device
        from megatron_p3o.rollout.sglang.weights import resolve_backend

        r, sg = self.rollout, self.rollout.sglang
        if sg.servers > 1 and sg.url is not None:
            raise ConfigError(
                f"rollout.sglang.servers={sg.servers} with rollout.sglang.url: an attached fleet "
                "names its servers in rollout.sglang_workers"
            )
        if sg.url is not None:
            return  # attached: whoever launched it chose its flags
        probe = replace(
            sg,
            deterministic=sg.deterministic or r.deterministic,
            routed_experts=(1, 1) if r.routing_replay == "r3" else None,
        )
        check_device_flags(probe)
        gloo = sg.sync_backend == "gloo" or (
            sg.sync_backend == "auto" and resolve_device(sg) == "cpu"
        )
        if sg.quantization == "fp8" and r.weight_sync == "distributed" and gloo:
            raise ConfigError(
                "rollout.sglang.quantization=fp8 with a gloo weight group: gloo cannot carry "
                "float8 tensors ('Invalid scalar type'); use sync_backend=nccl, or "
                "weight_sync=disk or tensor"
            )
        if resolve_device(sg) != "cpu":
            return
        if r.weight_sync == "colocated":
            raise ConfigError(
                "rollout.weight_sync=colocated shares the trainer's GPUs with the server (CUDA "
                "IPC); a CPU SGLang server takes weight_sync=tensor, distributed or disk"
            )
        if r.weight_sync == "distributed" and resolve_backend(sg) == "nccl":
            raise ConfigError(
                "rollout.sglang.sync_backend=nccl with a CPU SGLang server: NCCL refuses CPU "
                "tensors; use sync_backend=gloo (or auto)"
            )

    def check_rollout_gpus(self, world_size: int) -> None:
        """At launch (not in --dry-run, where the batch script has not yet named the servers):
        an NCCL weight group whose launched server shares a GPU with a trainer rank cannot form
        (NCCL: duplicate GPU)."""
        r = self.rollout
        from megatron_p3o.rollout.sglang.weights import resolve_backend

        if r.engine != "sglang" or r.weight_sync != "distributed" or r.sglang.url is not None:
            return  # attached servers: the batch script placed them on their own GPUs
        if resolve_backend(r.sglang) != "nccl":
            return
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(local)]
        train = {x.strip() for x in ids[:local]}
        server = None if r.sglang.gpus is None else {x.strip() for x in r.sglang.gpus.split(",")}
        if server is None or server & train:
            shared = "all of them" if server is None else ",".join(sorted(server & train))
            raise ConfigError(
                f"rollout.weight_sync=distributed (nccl) with a launched SGLang server on the "
                f"training GPUs "
                f"({shared}; trainer GPUs {','.join(sorted(train))}): NCCL refuses a group with "
                "two ranks on one GPU. Give rollout.sglang.gpus GPUs of their own, or use "
                "weight_sync=colocated or disk"
            )

    def batch_arithmetic(self, dp: int) -> str:
        """The derived batch numbers of one rollout batch (printed at launch and by --dry-run)."""
        b, n = self.batch, self.rollout.n_samples
        seqs = b.prompts_per_rollout * n
        per_step = seqs // b.minibatches
        head = (
            f"batch: {b.prompts_per_rollout} prompts × {n} samples = {seqs} sequences per "
            f"rollout → {b.minibatches} optimizer step(s) × {b.epochs} epoch(s); per step "
        )
        if b.max_tokens_per_gpu is not None:
            return head + (
                f"{per_step} = dp {dp} × {per_step // dp} sequences, packed into micro-batches "
                f"of ≤ {b.max_tokens_per_gpu} tokens"
                + (", tokens balanced over DP" if b.balance_dp and dp > 1 else "")
            )
        micro = per_step // (dp * b.micro_batch_size)
        return head + (
            f"{per_step} = dp {dp} × micro-batch {b.micro_batch_size} × {micro} micro-batches "
            f"padded to {self.model.seq_length} tokens"
        )


# -- value ranges -------------------------------------------------------------------------------

# Every numeric recipe value with an obvious valid range, by the dotted key the user writes. Why
# a table checked at load time: a negative lr passed --dry-run and the real run died after
# building the model, in a 35-line torch traceback; a count of 0 ended in a ZeroDivisionError.
# None (an optional value left unset) is not checked. Sampling parameters, the overlong reward,
# r2po steps and the replay policy check themselves (SamplingParams, OverlongConfig, ...).
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


def check_ranges(cfg: "TrainConfig") -> None:
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

_FLOAT_LITERAL = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(path: str, value: Any, tp) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(path, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: None is not allowed")
    if origin is Literal:  # the choices live in the annotation, checked once here
        if isinstance(value, bool) and ("off" if not value else "on") in args:
            value = "off" if not value else "on"  # YAML 1.1 reads a bare off/on as a bool
        _choice(path, value, args)
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}"
            )
        return _build(tp, value, path)
    if tp is Any:
        return value
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        inner = args[1] if len(args) == 2 else Any
        return {k: _coerce(f"{path}.{k}", v, inner) for k, v in value.items()}
    if origin in (tuple, Tuple, list, List):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        inner = args[0] if args else Any
        items = [_coerce(f"{path}[{i}]", v, inner) for i, v in enumerate(value)]
        return tuple(items) if origin in (tuple, Tuple) else items
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_LITERAL.match(value.strip()):
            return float(value)  # PyYAML (YAML 1.1) reads 3e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported field type {_type_name(tp)}")


def load_yaml_mapping(p: Path, what: str) -> dict:
    """A user's YAML file (a recipe, a stress grid) whose top level is a mapping; a missing,
    non-UTF-8 or malformed file is one :class:`ConfigError` naming it."""
    try:
        text = read_user_text(p, what)
    except InputFileError as e:
        raise ConfigError(str(e)) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {p}: invalid YAML: {one_line(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {p}: the top level must be a mapping")
    return data


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            path = f"{prefix}.{key}" if prefix else key
            near = difflib.get_close_matches(key, names, n=1)
            hint = ""
            if near:
                hint = f" (did you mean {(prefix + '.' if prefix else '') + near[0]!r}?)"
            raise ConfigError(
                f"unknown config key {path!r}{hint}; known under "
                f"{prefix or 'the top level'}: {names}"
            )
    kwargs = {k: _coerce(f"{prefix}.{k}" if prefix else k, v, hints[k]) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(_at(prefix, str(e), names)) from None


def _at(prefix: str, msg: str, names: Sequence[str]) -> str:
    """A component's own check (``__post_init__``) says ``temperature=0 …`` or
    ``sampling.temperature=0 …``; the user wrote ``rollout.sampling.temperature``: name it so."""
    if not prefix:
        return f"config: {msg}"
    head = re.match(r"[A-Za-z_][\w.]*", msg)
    key = head.group(0) if head else ""
    if key.startswith(prefix + ".") or key == prefix:
        return msg
    last = prefix.rsplit(".", 1)[-1]
    if key.startswith(last + "."):
        return prefix + msg[len(last) :]
    if key.split(".", 1)[0] in names:
        return f"{prefix}.{msg}"
    return f"{prefix}: {msg}"


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """``["optim.lr=1e-6", "loss.objective=grpo"]`` applied to a nested dict (values are YAML)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.sub=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_config(path: Optional[str | Path], overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML recipe (or only defaults when ``path`` is None) and apply ``--set`` items."""
    data: dict = {}
    if path is not None:
        data = load_yaml_mapping(Path(path), "recipe")
    cfg = _build(TrainConfig, apply_overrides(data, overrides))
    check_ranges(cfg)  # before data.task writes its splits, and before anything is built
    return resolve_task(cfg)


def resolve_task(cfg: TrainConfig) -> TrainConfig:
    """With ``data.task`` set: its splits written (once) as jsonl files under
    ``{run.dir}/tasks/``, which become ``data.path`` and, unless given, ``data.eval_path``."""
    d = cfg.data
    if not d.task:
        return cfg
    if d.path:
        raise ConfigError(f"data.task={d.task!r} and data.path={d.path!r}: set one of them")
    if cfg.reward.kind not in ("reasoning_gym", "python"):
        raise ConfigError(
            f"data.task={d.task!r} is scored by its dataset: set reward.kind: reasoning_gym "
            f"(got {cfg.reward.kind!r})"
        )
    for key, v in (
        ("task_train_size", d.task_train_size),
        ("task_heldout_size", d.task_heldout_size),
    ):
        if v < 1:
            raise ConfigError(f"data.{key}={v} must be >= 1")
    from megatron_p3o.data.tasks.reasoning_gym import materialize

    train, held = materialize(
        d.task, dict(d.task_args), d.task_format, d.task_seed, d.task_train_size,
        d.task_heldout_size, Path(cfg.run.dir) / "tasks",
    )  # fmt: skip
    return replace(cfg, data=replace(d, path=str(train), eval_path=d.eval_path or str(held)))


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


# Keys a resumed run may change freely: where and how long it runs, its layout, logging,
# evaluation, checkpoint cadence, where the servers are and how weights reach them.
RESUME_FREE = (
    "run.", "steps", "parallel.", "checkpoint.", "eval.", "wandb.", "data.eval_",
    "model.checkpoint", "model.hf_config", "rollout.sglang.", "rollout.sglang_workers",
    "rollout.weight_sync", "rollout.device",
)  # fmt: skip
# ... except these: the seed orders the prompts, so another seed changes the data mid-epoch
RESUME_BOUND = ("run.seed",)


def _flat(d: dict, prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, now: dict) -> List[Tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` of every training-relevant key that differs
    between the recipe a checkpoint was written with and the current one."""
    a, b = _flat(saved), _flat(now)
    return [
        (k, a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if (k in RESUME_BOUND or not k.startswith(RESUME_FREE)) and a.get(k) != b.get(k)
    ]
