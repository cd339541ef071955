"""The run configuration: frozen dataclasses loaded strictly from YAML, with ``--set`` overrides.

Why strict: a misspelt key in a 70B recipe silently falling back to a default costs a cluster-day.
Unknown keys are errors naming the key and the nearest known one; values are type-checked
(ints are not floats' silent cousins, bools are not ints); ranges and the parallel/batch
arithmetic are checked once, with the numbers in the message.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from .errors import UserError
from .optim import OptimConfig
from .replay import ReplayConfig
from .rollout.sglang_engine import SGLangConfig


class ConfigError(UserError, ValueError):
    """One bad key or value; the message names its dotted path."""


@dataclass(frozen=True)
class RunConfig:
    """Attributes:
    name: run name (a directory under ``dir``).
    dir: where run directories live.
    seed: global seed (data order, sampling, init).
    """

    name: str = "run"
    dir: str = "runs"
    seed: int = 1234


@dataclass(frozen=True)
class ModelConfig:
    """Attributes:
    checkpoint: Megatron dist checkpoint made by ``checkpoints_convert.hf_to_megatron``.
    params_dtype: training dtype ("float32", "bfloat16").
    seq_length: longest prompt + completion, in tokens.
    use_te: Transformer Engine layers (None = when available).
    fp8: TE FP8 recipe or None.
    hf_config: an HF config.json describing the model, for ``--dry-run`` before the
        checkpoint exists (the checkpoint's own description wins when it does).
    """

    checkpoint: str = ""
    params_dtype: str = "float32"
    seq_length: int = 512
    use_te: Optional[bool] = None
    fp8: Optional[str] = None
    hf_config: str = ""


@dataclass(frozen=True)
class ParallelConfig:
    """Attributes: tp / pp / cp sizes, vpp (virtual stages per rank), sequence_parallel, and
    world_size: the GPU count the recipe is written for (checked at launch; None = any)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: Optional[int] = None
    sequence_parallel: bool = False
    world_size: Optional[int] = None


@dataclass(frozen=True)
class LossConfig:
    """Attributes:
    objective: one of ``megatron_p3o.loss.OBJECTIVES`` (p3o by default).
    hyper: the objective's hyper-parameters (checked against its dataclass).
    ess_scope: "step" (exact) or "microbatch".
    nonfinite: "error" or "mask".
    logprob_chunk: tokens per log-prob block (None = automatic).
    """

    objective: str = "p3o"
    hyper: Dict[str, Any] = field(default_factory=dict)
    ess_scope: str = "step"
    nonfinite: str = "error"
    logprob_chunk: Optional[int] = None


@dataclass(frozen=True)
class SamplingConfig:
    """Attributes: temperature, top_p, top_k, max_new_tokens (see ``types.SamplingParams``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256


@dataclass(frozen=True)
class RolloutConfig:
    """Attributes:
    engine: "embedded" (CPU, transformers) or "sglang".
    precision: embedded engine precision (fp32, bf16, fp16, fp8, fp8_block).
    n_samples: completions per prompt (the GRPO group size G).
    sampling: sampling parameters.
    sync_every: push weights to the engine every L optimizer steps (OAPL's L).
    max_staleness: asynchronous rollouts may lag the trainer by at most K versions (0: sync).
    dynamic_sampling: DAPO dynamic sampling — refill groups whose rewards are all equal with
        fresh prompts, up to ``dynamic_max_rounds`` rounds per batch.
    logprob_noise: stress tests only — σ of Gaussian noise added to the behaviour log-probs.
    engine_temperature: stress tests only — let the engine sample at another temperature
        than the trainer's ``sampling.temperature`` (None: the same, as it must be).
    sglang: the SGLang server/router (``engine: sglang``): attach with ``url``, or launch.
    weight_sync: how weights reach SGLang — "nccl" (update_weights_from_distributed,
        disaggregated GPUs), "colocated" (CUDA IPC, same GPUs) or "disk" (fallback).
    weight_sync_dir: shared directory for the "disk" mode.
    weight_sync_port: TCP port on trainer rank 0 for the "nccl" weight-update rendezvous
        (worker i uses weight_sync_port + i).
    sglang_workers: URLs of the SGLang servers behind ``sglang.url`` when it is a router;
        weights are pushed to each of them (empty: ``sglang.url`` is the one server).
    """

    engine: str = "embedded"
    precision: str = "bf16"
    n_samples: int = 8
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sync_every: int = 1
    max_staleness: int = 0
    dynamic_sampling: bool = False
    dynamic_max_rounds: int = 3
    logprob_noise: float = 0.0
    engine_temperature: Optional[float] = None
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    weight_sync: str = "nccl"
    weight_sync_dir: str = ""
    weight_sync_port: int = 29650
    sglang_workers: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class DataConfig:
    """Attributes: path (jsonl/parquet), eval_path (held-out set, optional), prompt_key,
    answer_key, chat_template, shuffle, eval_every (steps; 0 = only at start and end)."""

    path: str = ""
    eval_path: str = ""
    eval_every: int = 0
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    chat_template: bool = False
    shuffle: bool = True


@dataclass(frozen=True)
class RewardConfig:
    """Attributes: kind (math_verify, exact_match, python) and function ("module:callable")."""

    kind: str = "math_verify"
    function: str = ""


@dataclass(frozen=True)
class AdvantageConfig:
    """Attributes: kind (grpo, dr_grpo, rloo) and eps (GRPO's std floor)."""

    kind: str = "grpo"
    eps: float = 1e-6


@dataclass(frozen=True)
class BatchConfig:
    """Attributes:
    prompts_per_rollout: prompts per rollout batch (× n_samples sequences).
    minibatches: optimizer steps per rollout batch.
    epochs: passes over the rollout batch.
    micro_batch_size: sequences per micro-batch per DP rank.
    """

    prompts_per_rollout: int = 64
    minibatches: int = 1
    epochs: int = 1
    micro_batch_size: int = 4


@dataclass(frozen=True)
class CheckpointConfig:
    """Attributes: every (optimizer steps; 0 = only at the end), keep_last."""

    every: int = 50
    keep_last: int = 2


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
    steps: int = 100

    def validate(self, world_size: int) -> "TrainConfig":
        """Choices, ranges, layout and batch arithmetic; returns self."""
        from .loss import build_objective
        from .parallel import Layout, LayoutError

        _choice("loss.ess_scope", self.loss.ess_scope, ("step", "microbatch"))
        _choice("loss.nonfinite", self.loss.nonfinite, ("error", "mask"))
        _choice("rollout.engine", self.rollout.engine, ("embedded", "sglang"))
        _choice(
            "rollout.precision",
            self.rollout.precision,
            ("fp32", "bf16", "fp16", "fp8", "fp8_block"),
        )
        _choice("rollout.weight_sync", self.rollout.weight_sync, ("nccl", "colocated", "disk"))
        if (
            self.rollout.weight_sync == "disk"
            and self.rollout.engine == "sglang"
            and not self.rollout.weight_sync_dir
        ):
            raise ConfigError(
                "rollout.weight_sync=disk needs rollout.weight_sync_dir (a directory every "
                "node and the SGLang servers can read)"
            )
        _choice("reward.kind", self.reward.kind, ("math_verify", "exact_match", "python"))
        _choice("advantage.kind", self.advantage.kind, ("grpo", "dr_grpo", "rloo"))
        _choice("model.params_dtype", self.model.params_dtype, ("float32", "bfloat16", "float16"))
        for path, v, lo in (
            ("steps", self.steps, 1),
            ("rollout.n_samples", self.rollout.n_samples, 1),
            ("rollout.sync_every", self.rollout.sync_every, 1),
            ("rollout.max_staleness", self.rollout.max_staleness, 0),
            ("rollout.dynamic_max_rounds", self.rollout.dynamic_max_rounds, 0),
            ("batch.prompts_per_rollout", self.batch.prompts_per_rollout, 1),
            ("batch.minibatches", self.batch.minibatches, 1),
            ("batch.epochs", self.batch.epochs, 1),
            ("batch.micro_batch_size", self.batch.micro_batch_size, 1),
            ("model.seq_length", self.model.seq_length, 2),
        ):
            if v < lo:
                raise ConfigError(f"{path}={v} must be >= {lo}")
        if self.rollout.logprob_noise < 0:
            raise ConfigError(f"rollout.logprob_noise={self.rollout.logprob_noise} must be >= 0")
        if self.rollout.engine_temperature is not None and not self.rollout.engine_temperature > 0:
            raise ConfigError(
                f"rollout.engine_temperature={self.rollout.engine_temperature} must be > 0"
            )
        try:
            self.replay.check()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            build_objective(self.loss.objective, **self.loss.hyper)
        except ValueError as e:
            raise ConfigError(f"loss: {e}") from None
        if self.parallel.world_size is not None and self.parallel.world_size != world_size:
            raise ConfigError(
                f"parallel.world_size={self.parallel.world_size}: the recipe is written for "
                f"{self.parallel.world_size} GPUs but the launch has {world_size} ranks"
            )
        try:
            lay = Layout(
                self.parallel.tp,
                self.parallel.pp,
                self.parallel.cp,
                None,
                self.parallel.vpp,
                self.parallel.sequence_parallel,
            ).resolve(world_size)
            lay.check_sequence(self.model.seq_length)
        except LayoutError as e:
            raise ConfigError(str(e)) from None
        seqs = self.batch.prompts_per_rollout * self.rollout.n_samples
        per_step = lay.dp * self.batch.micro_batch_size
        if seqs % self.batch.minibatches:
            raise ConfigError(
                f"batch: prompts_per_rollout × n_samples = {self.batch.prompts_per_rollout} × "
                f"{self.rollout.n_samples} = {seqs} sequences do not split into "
                f"minibatches={self.batch.minibatches} optimizer steps"
            )
        step_seqs = seqs // self.batch.minibatches
        if step_seqs % per_step:
            raise ConfigError(
                f"batch: {step_seqs} sequences per optimizer step are not a multiple of dp × "
                f"micro_batch_size = {lay.dp} × {self.batch.micro_batch_size} = {per_step}"
            )
        return self


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
        return dict(value)
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
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


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
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {p}: invalid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"recipe {p}: the top level must be a mapping")
    return _build(TrainConfig, apply_overrides(data, overrides))


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
