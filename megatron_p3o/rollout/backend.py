"""The rollout backend: everything the trainer asks of rollouts, behind one interface.

Why: the trainer should not know whether its samples come from an engine on every rank or from
one SGLang server for the whole job. A backend generates batch j at the weight version the
schedule fixes (:mod:`.scheduler`), publishes the trainer's weights after each step (loading or
pushing them at sync points), evaluates with the current weights, saves and restores its
state, and stops. :func:`build_backend` is the only place that looks at ``rollout.engine``.

Every method is called by every rank at the same point: at sync points ``publish`` and
``evaluate`` gather weights over the model-parallel groups.
"""

from __future__ import annotations

import abc
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

from megatron_p3o.data.prompts import PromptData
from megatron_p3o.rollout.config import RolloutConfig, RolloutShard
from megatron_p3o.rollout.engine import RolloutEngine
from megatron_p3o.rollout.scheduler import (
    LoadWeights,
    NoWeights,
    Publication,
    RolloutResult,
    RolloutScheduler,
    ScoreFn,
    WeightsPushed,
    WeightUpdate,
)
from megatron_p3o.runtime.parallel import ParallelGroups
from megatron_p3o.types import Sample, SamplingParams
from megatron_p3o.weight_sync.source import TrainerWeights

Reeval = Sequence[Tuple[int, List[int], str]]


class RolloutBackend(abc.ABC):
    """Batches at scheduled weight versions; weight publication; evaluation; state; stop."""

    def __init__(
        self,
        engine: RolloutEngine,
        weights: TrainerWeights,
        data: PromptData,
        score: ScoreFn,
        cfg: RolloutConfig,
        shard: RolloutShard,
        start: int,
        resume: Optional[dict] = None,
        turns=None,
    ):
        """``resume``: a checkpoint's :meth:`state` of this DP rank, plus ``weights`` (the
        scheduler's :meth:`~.scheduler.RolloutScheduler.weights_state`, tensors present);
        ``turns``: the multi-turn loop (:class:`~.turns.TurnLoop`), or None."""
        self.engine, self.weights, self.cfg, self.turns = engine, weights, cfg, turns
        self.scheduler: Optional[RolloutScheduler] = None
        resume = resume or {}
        old = resume.get("weights")
        if old is not None:  # lagged sync: batches are still due from the last sync's weights
            initial, version = LoadWeights(list(old["tensors"].items())), int(old["version"])
        else:  # the engine gets the trainer's weights (resumed runs too)
            initial, version = self._sync(start), None
        self.scheduler = RolloutScheduler(
            engine, data, score, cfg, shard, start, initial, resume.get("pending", ()),
            resume.get("carried", ()), version, turns,
        )  # fmt: skip

    @abc.abstractmethod
    def _sync(self, version: int) -> WeightUpdate:
        """Make the trainer's current weights version ``version`` of the engine (all ranks)."""

    @abc.abstractmethod
    def evaluate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        version: int,
        precision: Optional[str] = None,
        items=None,
    ):
        """One completion per prompt with the trainer's current weights (all ranks), in
        ``precision`` (an embedded-engine precision; None = the rollout engine's own); with
        ``items`` (multi-turn: one :class:`~megatron_p3o.env.types.EnvItem` per prompt) one
        trajectory per prompt through the same turn loop as the rollouts."""

    eval_turns = None  # evaluation's own view of the turn loop, where it needs one

    def _generate(self, engine, prompts, sampling, items) -> List[Sample]:
        if items is not None and self.turns is not None:
            turns = self.eval_turns or self.turns
            return turns.run(engine, prompts, items, 1, sampling)
        return engine.generate(prompts, 1, sampling)

    def next_batch(self) -> RolloutResult:
        """The next rollout batch (blocks until the schedule's weight version produced it)."""
        return self.scheduler.next()

    def before_update(self) -> None:  # noqa: B027 - most backends have nothing to do here
        """The trainer is about to update the model (a colocated server frees its memory)."""

    def publish(self, step: int, reeval: Reeval = ()) -> None:
        """After optimizer step ``step``: version ``step + 1``, synced every ``sync_every``."""
        version = step + 1
        sync = version % self.cfg.sync_every == 0
        update = self._sync(version) if sync else NoWeights()
        self.scheduler.publish(Publication(step, version, update, list(reeval)))

    def state_dict(self) -> dict:
        """Batches made but not trained on, the data cursor after them, pending
        re-evaluations."""
        return self.scheduler.state_dict()

    def weights_state(self) -> Optional[dict]:
        """The rollout weights batches after a checkpoint are still due from, when older."""
        return self.scheduler.weights_state()

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        self.engine.stop()


class EmbeddedBackend(RolloutBackend):
    """An engine on every rank (transformers, in a chosen precision): the model-parallel ranks
    of one DP rank hold identical engines with identical seeds and need not talk. Multi-turn
    trajectories run on the DP leader only, its peers get them
    (:class:`~megatron_p3o.rollout.turn_ranks.LeaderTurns`: tools are called once)."""

    def __init__(self, engine, weights, data, score, cfg, shard, start, resume=None, turns=None):
        g = weights.groups
        if turns is not None and g.layout.tp * g.layout.pp * g.layout.cp > 1:
            from megatron_p3o.rollout.turn_ranks import LeaderTurns
            from megatron_p3o.runtime.parallel import new_object_group

            # the producer thread's and evaluation's exchanges, each over a group of its own
            turns, self.eval_turns = (LeaderTurns(turns, g, new_object_group())
                                      for _ in range(2))  # fmt: skip
        super().__init__(engine, weights, data, score, cfg, shard, start, resume, turns)

    def _sync(self, version: int) -> WeightUpdate:
        return LoadWeights(self.weights.full())

    _eval_engine = None

    def evaluate(self, prompts, sampling, version, precision=None, items=None) -> List[Sample]:
        """Held-out completions. In the trainer's ``precision`` they come from a noise-free
        engine whenever the rollout engine differs from the trainer's policy: another precision,
        or a stress injection that perturbs the engine itself (logit noise, rounded weights),
        even at the same precision — scores measure the policy, not the mismatch."""
        injected = bool(self.engine.logit_noise or self.engine.rounding_step)
        if precision is not None and (precision != self.engine.precision or injected):
            return self._generate(self._evaluator(precision, version), prompts, sampling, items)
        pub = Publication(version - 1, version, self._sync(version))
        s = self.scheduler
        with s.engine_lock:  # borrowed from the rollout producer for the duration
            s.ensure_weights(pub)
            with self.engine.base_head():  # the policy is the base head (R2PO)
                return self._generate(self.engine, prompts, sampling, items)

    def _evaluator(self, precision: str, version: int):
        """A second, noise-free engine in the trainer's precision for evaluation (built on first
        use), so that scores measure the policy, not the rollout precision."""
        from megatron_p3o.model.description import description_to_hf_config
        from megatron_p3o.rollout.embedded import EmbeddedEngine

        e = self._eval_engine
        if e is None or e.precision != precision:
            hf = description_to_hf_config(self.weights.desc)
            e = EmbeddedEngine(
                hf, precision, pad_token_id=self.engine.pad_token_id, device=self.engine.device,
                max_batch=self.engine.max_batch,
            )  # fmt: skip
            self._eval_engine = e
        if e.weight_version != version:
            policy = [(n, t) for n, t in self.weights.full() if not n.startswith("rollout_head.")]
            e.update_weights([policy], version)
        return e


class SGLangBackend(RolloutBackend):
    """One SGLang server (or router) for the whole job, driven from global rank 0
    (:mod:`.central`); weights stream to rank 0 and are pushed at every sync point."""

    def __init__(
        self, producer, evaluator, weights, data, score, cfg, shard, start, resume, turns=None
    ):
        self.evaluator = evaluator  # a second view with its own object group (see central)
        super().__init__(producer, weights, data, score, cfg, shard, start, resume, turns)

    def _sync(self, version: int) -> WeightUpdate:
        from megatron_p3o.weight_sync import iter_hf_buckets
        from megatron_p3o.weight_sync.fp8 import quantize_named

        fp8 = self.cfg.sglang.quantization == "fp8"  # block FP8 + scales, see weight_sync.fp8
        if self.cfg.weight_sync == "colocated":  # every rank builds its GPU's IPC payload
            self.engine.update_weights_colocated(
                self.weights, version, self.cfg.sglang.tp_size, fp8=fp8
            )
        else:  # streamed to rank 0, which pushes (process group, tensors or disk)
            tensors = self.weights.to_rank0()
            if fp8:
                tensors = quantize_named(tensors)
            self.engine.update_weights(iter_hf_buckets(tensors, 256 * 2**20), version)
        self.evaluator.weight_version = version
        return WeightsPushed()

    def before_update(self) -> None:
        if self.cfg.weight_sync == "colocated":
            self.engine.release_memory()

    def evaluate(self, prompts, sampling, version, precision=None, items=None) -> List[Sample]:
        # the server's precision and the last sync point's weights (a trainer-precision
        # evaluation would need a generation path in Megatron: not built)
        return self._generate(self.evaluator, prompts, sampling, items)


def build_backend(
    cfg: RolloutConfig,
    groups: ParallelGroups,
    weights: TrainerWeights,
    data: PromptData,
    score: ScoreFn,
    shard: RolloutShard,
    start: int,
    resume: Optional[dict],
    params_dtype: str,
    pad_token_id: int,
    rollout_head: bool = False,
    log_dir: str = ".",
    turns=None,
) -> RolloutBackend:
    """The backend ``cfg.engine`` names; engines it started are stopped if it fails.
    ``rollout_head``: the engine samples with R2PO's residual head (embedded engine only);
    ``log_dir``: where launched SGLang servers write their (redacted) logs and pid files;
    ``turns``: the multi-turn loop (:class:`~.turns.TurnLoop`) or None."""
    from megatron_p3o.model.description import description_to_hf_config

    if cfg.engine == "embedded":
        from megatron_p3o.rollout.embedded import EmbeddedEngine

        hf = description_to_hf_config(weights.desc)
        device = str(groups.device) if cfg.device == "auto" else cfg.device
        engine = EmbeddedEngine(
            hf, cfg.precision, pad_token_id=pad_token_id, device=device,
            logit_noise=cfg.logit_noise, fp8_kv_cache=cfg.fp8_kv_cache,
            rollout_head=rollout_head, max_batch=cfg.embedded_max_batch,
            weight_rounding_step=cfg.weight_rounding_step,
        )  # fmt: skip
        return EmbeddedBackend(engine, weights, data, score, cfg, shard, start, resume, turns)
    hf = description_to_hf_config(weights.desc, params_dtype)  # config.json of disk pushes
    if cfg.sglang.quantization == "fp8":
        from megatron_p3o.weight_sync.fp8 import quantization_config

        hf["quantization_config"] = quantization_config()
    producer, evaluator = _central_engines(cfg, groups, hf, log_dir)
    try:
        return SGLangBackend(
            producer, evaluator, weights, data, score, cfg, shard, start, resume, turns
        )
    except BaseException:
        producer.stop()
        raise


def _central_engines(cfg: RolloutConfig, groups: ParallelGroups, hf_config: dict, log_dir: str):
    """SGLang on global rank 0, driven for every rank: one view for the rollout producer, one
    for evaluation, each with its own object group."""
    import os

    from megatron_p3o.rollout.central import CentralEngine
    from megatron_p3o.rollout.sglang import build_fleet
    from megatron_p3o.rollout.sglang.launch import resolve_device
    from megatron_p3o.runtime.parallel import new_object_group

    inner = None
    if groups.rank == 0:
        sg = replace(cfg.sglang, deterministic=cfg.sglang.deterministic or cfg.deterministic)
        if hf_config.get("num_experts_per_tok") and (
            cfg.routing_replay == "r3" or resolve_device(sg) != "cpu"
        ):  # MoE: every token's experts (replay, or route agreement; a CPU server cannot)
            sg = replace(
                sg,
                routed_experts=(hf_config["num_hidden_layers"], hf_config["num_experts_per_tok"]),
            )
        if resolve_device(sg) != "cpu":  # a driver CUDA 13 cannot use: one line, before launch
            from megatron_p3o.rollout.sglang.preflight import check_launch

            check_launch()
        if cfg.weight_sync == "distributed":
            _check_nccl(sg)
        check_transport(cfg, sg, groups.device.type == "cuda")
        if cfg.weight_sync == "colocated":  # else /release_memory_occupation frees nothing
            f = _colocated_fraction(sg, groups.device)
            sg = replace(sg, memory_saver=True, mem_fraction_static=f)
        if cfg.multi_turn is not None:  # every turn to the server that holds its prefix
            sg = replace(sg, sticky_routing=True)
        inner = build_fleet(sg, cfg.sglang_workers, sg.log_dir or log_dir, cfg.weight_sync)
        inner.start()
        try:
            if cfg.weight_sync == "distributed":
                # launched servers live on rank 0's node; attached ones reach it by name
                local = sg.url is None
                master = "127.0.0.1" if local else os.environ.get("MASTER_ADDR", "127.0.0.1")
                inner.init_weight_update_groups(master, cfg.weight_sync_port)
        except BaseException:
            inner.stop()
            raise
    return tuple(
        CentralEngine(
            inner, groups, new_object_group(), cfg.weight_sync, cfg.weight_sync_dir, hf_config
        )
        for _ in range(2)
    )


def _colocated_fraction(sg, device) -> float:
    """The launch fraction that gives the colocated server the GPU share the plan counts: the
    trainer's model, DDP and optimizer are built before the server starts, and SGLang sizes its
    pool from the memory free then (:func:`~.sglang.launch.colocated_fraction`; rank 0's GPU,
    which server rank 0 shares). Without CUDA (a CPU server) the recipe's fraction stands."""
    import torch

    from megatron_p3o.rollout.sglang.launch import colocated_fraction

    if sg.url is not None or device.type != "cuda":
        return sg.mem_fraction_static
    free, total = torch.cuda.mem_get_info(device)
    f = colocated_fraction(sg.mem_fraction_static, total, free)
    print(f"colocated SGLang server: --mem-fraction-static {f} of the {free / 2**30:.1f} GiB "
          f"free gives the planned {sg.mem_fraction_static} of {total / 2**30:.0f} GiB",
          flush=True)  # fmt: skip
    return f


def _is_local(url: str) -> bool:
    """The URL's host is this machine (loopback, or one of this host's names/addresses)."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    if host in ("localhost", "0.0.0.0", "::1") or host.startswith("127."):
        return True
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        addrs = set()
    return host in names or host in addrs


def check_transport(cfg: RolloutConfig, sg, cuda: bool) -> None:
    """One line each, before any server starts: a colocated push serves one server (its payload
    ranks are trainer ranks 0…T−1, the GPUs of that one server); CUDA-IPC tensor payloads (a
    trainer on CUDA) reach only servers on this node."""
    from megatron_p3o.rollout.sglang.launch import SGLangSetupError

    servers = len(cfg.sglang_workers) if sg.url is not None else sg.servers
    if cfg.weight_sync == "colocated" and max(servers, 1) > 1:
        raise SGLangSetupError(
            f"rollout.weight_sync=colocated with {servers} servers: a colocated push serves one "
            "server, on the GPUs of trainer ranks 0..tp_size-1; use rollout.sglang.servers=1 (or "
            "weight_sync=distributed for a fleet)"
        )
    if cfg.weight_sync == "tensor" and cuda:
        urls = list(cfg.sglang_workers) or ([sg.url] if sg.url is not None else [])
        remote = [u for u in urls if not _is_local(u)]
        if remote:
            raise SGLangSetupError(
                f"rollout.weight_sync=tensor from a CUDA trainer sends CUDA-IPC handles, which "
                f"only a server on this node can open; {remote[0]} is on another node: use "
                "weight_sync=distributed or disk"
            )


def _check_nccl(sg) -> None:
    """Before any server starts: an NCCL weight group needs one NCCL version on both sides."""
    import os

    from megatron_p3o.rollout.sglang.launch import PYTHON_ENV
    from megatron_p3o.rollout.sglang.weights import (
        check_nccl_versions,
        resolve_backend,
        server_nccl_version,
        trainer_nccl_version,
    )

    python = sg.python or os.environ.get(PYTHON_ENV)
    if resolve_backend(sg) != "nccl" or not python:
        return
    trainer = trainer_nccl_version()
    if trainer is not None:  # probed in the servers' own environment (an LD_PRELOAD for them)
        from megatron_p3o.rollout.sglang.launch import server_env

        env = server_env(gpus=sg.gpus, ld_preload=sg.ld_preload)
        check_nccl_versions(trainer, server_nccl_version(python, env), python)
