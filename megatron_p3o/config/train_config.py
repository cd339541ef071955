"""The run configuration: frozen dataclasses loaded strictly from YAML, with ``--set`` overrides.

Why strict: a misspelt key in a 70B recipe silently falling back to a default costs a cluster-day.
Unknown keys are errors naming the key and the nearest known one; values are type-checked
(ints are not floats' silent cousins, bools are not ints); ranges and the parallel/batch
arithmetic are checked once, with the numbers in the message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import ClassVar, Dict, List, Optional

from megatron_p3o.advantage.estimators import AdvantageConfig
from megatron_p3o.checkpoint.state import CheckpointConfig
from megatron_p3o.data.prompts import DataConfig
from megatron_p3o.evaluation.heldout import EvalConfig
from megatron_p3o.logprob.reference import ReferenceConfig
from megatron_p3o.loss.config import LossConfig
from megatron_p3o.model.builder import ModelConfig
from megatron_p3o.observability.run_log import WandbConfig, check_wandb
from megatron_p3o.reward.registry import RewardConfig
from megatron_p3o.rollout.config import RolloutConfig
from megatron_p3o.rollout.replay import ReplayConfig
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.runtime.fields import check_ranges, check_url
from megatron_p3o.runtime.parallel import ParallelConfig
from megatron_p3o.update.batching import BatchConfig
from megatron_p3o.update.optim import OptimConfig
from megatron_p3o.update.r2po import R2POConfig


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

    RANGES: ClassVar[Dict[str, str]] = {"steps": ">= 1"}

    def __post_init__(self):
        """Its own field, then what spans components and needs no environment (the rest:
        :meth:`validate`, at launch)."""
        check_ranges(self, self.RANGES, "")
        if self.data.task and self.reward.kind not in ("reasoning_gym", "python"):
            raise ConfigError(
                f"data.task={self.data.task!r} is scored by its dataset: set reward.kind: "
                f"reasoning_gym (got {self.reward.kind!r})"
            )
        mt = self.rollout.multi_turn
        if mt is not None and self.eval.sets:
            raise ConfigError(
                "eval.sets with rollout.multi_turn: the evaluation sets score one completion "
                "per prompt; a multi-turn run is evaluated on data.eval_path through its "
                "environment (remove eval.sets)"
            )
        if mt is not None and mt.max_total_tokens >= self.model.seq_length:
            raise ConfigError(
                f"rollout.multi_turn.max_total_tokens={mt.max_total_tokens} leaves no room for "
                f"the prompt in model.seq_length={self.model.seq_length} (a trajectory is the "
                "prompt plus up to max_total_tokens)"
            )
        if (
            mt is not None
            and mt.agent
            and mt.max_prompt_tokens + mt.max_total_tokens > (self.model.seq_length)
        ):
            raise ConfigError(
                f"rollout.multi_turn.max_prompt_tokens={mt.max_prompt_tokens} + max_total_tokens="
                f"{mt.max_total_tokens} exceeds model.seq_length={self.model.seq_length} (an "
                "agent's segment is its conversation plus up to max_total_tokens)"
            )

    def with_task_files(self) -> "TrainConfig":
        """``data.task``'s splits written under ``{run.dir}/tasks/`` and named by ``data.path``
        (:meth:`~megatron_p3o.data.prompts.DataConfig.with_task_files`); without a task, self."""
        data = self.data.with_task_files(self.run.dir)
        return self if data is self.data else replace(self, data=data)

    def validate(self, world_size: int) -> "TrainConfig":
        """Choices, ranges, layout and batch arithmetic; returns self."""
        from megatron_p3o.loss import build_objective
        from megatron_p3o.runtime.parallel import LayoutError

        check_wandb(self.wandb)  # no login: refused now, not after the model is built
        self._check_sglang(world_size)
        self._check_objective_sampling(build_objective(self.loss.objective, **self.loss.hyper))
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
        mt = r.multi_turn
        if mt is not None and mt.credit == "turn":
            seq = obj.spec.advantages is not None or (
                self.loss.objective == "gspo" and not getattr(obj.hyper, "token_level", False)
            )
            other = ("r2po.enabled" if self.r2po.enabled else
                     f"loss.objective={self.loss.objective!r} (one advantage per sequence)"
                     if seq else
                     "replay.policy=fifo" if self.replay.policy == "fifo" else None)  # fmt: skip
            if other is not None:
                raise ConfigError(
                    f"rollout.multi_turn.credit=turn with {other}: per-turn advantages reach "
                    "only the token-advantage objectives' own update (use credit: trajectory)"
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
        if self.reference.enabled is False and self.reference.needed(obj, self.r2po.enabled):
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
            check_url("rollout.sglang.url", r.sglang.url)
            for i, u in enumerate(r.sglang_workers):
                check_url(f"rollout.sglang_workers[{i}]", u)
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
