"""Rollout scheduling: which prompts are rolled out with which weight version, and when.

One rule covers the three regimes (synchronous, lagged sync every L steps, asynchronous with
staleness bound K). The rollout backend *publishes* after each trainer step s = 0, 1, …: a
:class:`Publication` of the new weight version s+1 whose ``weights`` say what happened to them —
:class:`NoWeights` (not a sync point), :class:`LoadWeights` (tensors this scheduler loads into
its engine, (s+1) % L == 0) or :class:`WeightsPushed` (the backend pushed them to a server
itself) — and the difficult prompts the replay buffer wants re-evaluated. Rollout batch j
(consumed by trainer step j) is generated

    after publication j − K − 1, with the newest weights published up to it,
    i.e. weight version  L·⌊(j − K)/L⌋  (clamped to the run's first version),

so a sample trained on at step j is at most K + L − 1 versions stale, and which weights produce
each batch is fixed by the schedule, not by thread timing: with the embedded engine runs are
reproducible. SGLang is not: its per-request seed is honoured only under deterministic
inference (GPU only), and a push that lands while a request is in flight retracts it and resumes
it under the newer weights, so one sample may hold tokens of two versions
(``Sample.token_versions``; each token's ℓb is under the weights that sampled it).
K = 0 generates inline when the trainer asks; K ≥ 1 runs a producer thread that rolls out batch
j + 1 … j + K while the trainer trains on batch j (the overlap AReaL/slime-style async gives).

Checkpoints (:meth:`RolloutScheduler.state`). After step c − 1 the batches c … c + K − 1 were made
with weights older than the checkpoint's (versions ≤ c − 1), which a resumed run no longer has:
the checkpoint *carries* them whole (waiting for the producer to finish them), and records the
data cursor before batch c + K and the re-evaluation requests batches from c + K on consume. With
lagged sync (L > 1) batches after c may still be due from the last sync point's weights (version
v < c): :meth:`RolloutScheduler.weights_state` gives them (their tensors when this scheduler
loads them; a server the backend pushed to keeps only their version). A resumed run then trains
on exactly the samples of the uninterrupted one (issue 25; the lost or mislabelled samples after
recovery that NeMo-RL #3599, AReaL #1388 and slime #2092 report).

Each batch is scored here (rewards are cheap next to generation) so DAPO dynamic sampling can
refill groups with no learning signal (all rewards equal) from fresh prompts, up to a bound of
rounds. Injected noise on the behaviour log-probs (stress experiments) is applied here too.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from megatron_p3o.data.prompts import PromptData, PromptItem
from megatron_p3o.env.types import EnvItem
from megatron_p3o.rollout.config import RolloutConfig, RolloutShard
from megatron_p3o.rollout.engine import RolloutEngine
from megatron_p3o.runtime.errors import UserError
from megatron_p3o.types import Group, Sample, SamplingParams

ScoreFn = Callable[[Sequence[Sample], Sequence[str]], List[float]]
NamedTensors = List[Tuple[str, torch.Tensor]]
BUCKET_BYTES = 64 * 2**20  # weight-sync bucket size for an engine this scheduler loads


# -- what a publication carries about weights -------------------------------------------------
@dataclass(frozen=True)
class NoWeights:
    """Not a sync point: the engine keeps the weights it holds."""

    is_sync = False


@dataclass(frozen=True)
class LoadWeights:
    """A sync point: full HF-named tensors that the scheduler loads into its engine."""

    tensors: NamedTensors
    is_sync = True


@dataclass(frozen=True)
class WeightsPushed:
    """A sync point whose weights the backend already pushed to the (remote) engine."""

    is_sync = True


WeightUpdate = Union[NoWeights, LoadWeights, WeightsPushed]


@dataclass
class Publication:
    """After trainer step ``step``: weight version ``version``, what happened to the weights,
    and the prompts the replay buffer wants re-evaluated."""

    step: int  # the trainer step that just ended (start − 1 for the initial weights)
    version: int
    weights: WeightUpdate
    reeval: List[Tuple[int, List[int], str]] = field(default_factory=list)


@dataclass
class RolloutResult:
    index: int
    groups: List[Group]
    data_state: dict  # the data cursor before this batch drew its prompts
    stats: Dict[str, float]
    dropped: List[Group] = field(default_factory=list)  # groups replaced by dynamic sampling

    def to_state(self) -> dict:
        """Plain containers for a checkpoint's common state (groups as the replay buffer keeps
        them: :meth:`Group.to_dict`)."""
        return {
            "index": self.index,
            "groups": [g.to_dict() for g in self.groups],
            "data_state": self.data_state,
            "stats": self.stats,
            "dropped": [g.to_dict() for g in self.dropped],
        }

    @staticmethod
    def from_state(d: dict) -> "RolloutResult":
        return RolloutResult(
            int(d["index"]), [Group.from_dict(g) for g in d["groups"]], dict(d["data_state"]),
            dict(d["stats"]), [Group.from_dict(g) for g in d["dropped"]],
        )  # fmt: skip


class RolloutScheduler:
    """Produces rollout batch ``start``, ``start + 1``, … by the rule in the module docstring."""

    def __init__(
        self,
        engine: RolloutEngine,
        data: PromptData,
        score: ScoreFn,
        cfg: RolloutConfig,
        shard: RolloutShard,
        start: int,
        initial: WeightUpdate,
        pending: Sequence[dict] = (),
        carried: Sequence[dict] = (),
        initial_version: Optional[int] = None,
        turns=None,
    ):
        """``initial``: the weights batches from ``start + len(carried)`` on begin with, as
        version ``initial_version`` (default ``start``; older under lagged sync, see
        :meth:`weights_state`); ``pending``, ``carried``: a checkpoint's :meth:`state`;
        ``turns``: a :class:`~.turns.TurnLoop` for multi-turn rollouts (None: one completion
        per sample)."""
        self.engine, self.data, self.score, self.turns = engine, data, score, turns
        self.cfg, self.shard = cfg, shard
        self.start, self.consumed = start, start
        self.engine_lock = threading.RLock()
        self._cond = threading.Condition()
        v0 = start if initial_version is None else initial_version
        self._pubs: Dict[int, Publication] = {start - 1: Publication(start - 1, v0, initial)}
        # re-evaluation requests published before a checkpoint, not yet rolled out
        for p in pending:  # the initial publication keeps its weights and their version
            old = self._pubs.get(int(p["step"]))
            self._pubs[int(p["step"])] = Publication(
                int(p["step"]),
                old.version if old else int(p["version"]),
                old.weights if old else NoWeights(),
                [tuple(x) for x in p["reeval"]],
            )
        self._data_before: Dict[int, dict] = {}
        # batches generated, not yet trained on: first those a checkpoint carried
        self._ready: Dict[int, RolloutResult] = {}
        for i, d in enumerate(carried):
            res = RolloutResult.from_state(d)
            if res.index != start + i:
                raise ValueError(f"carried rollout batch {res.index}, expected {start + i}")
            self._ready[res.index] = res
        self._produce_from = start + len(carried)
        self._error: Optional[BaseException] = None
        self._stop = False
        self._thread = None
        if cfg.max_staleness > 0:
            self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
            self._thread.start()

    # -- the trainer's side ---------------------------------------------------------------------
    def publish(self, pub: Publication) -> None:
        """After trainer step ``pub.step``: its weight version, weights and re-evaluations."""
        if isinstance(pub.weights, LoadWeights):  # training goes on in place: keep a copy
            pub = replace(
                pub, weights=LoadWeights([(n, t.detach().clone()) for n, t in pub.weights.tensors])
            )
        with self._cond:
            self._pubs[pub.step] = pub
            self._cond.notify_all()

    def next(self) -> RolloutResult:
        """Rollout batch ``consumed`` (blocks until it is generated)."""
        j = self.consumed
        if self._thread is None:
            res = self._ready.pop(j, None) or self._produce(j)
        else:
            with self._cond:
                while j not in self._ready:
                    self._raise_producer_error(j)
                    self._cond.wait(timeout=1.0)
                res = self._ready.pop(j)
        assert res.index == j, (res.index, j)
        self.consumed += 1
        with self._cond:  # a checkpoint from now on restarts at batch `consumed`
            keep = self.consumed - self.cfg.max_staleness - 1
            self._pubs = {s: p for s, p in self._pubs.items() if s >= keep or p.weights.is_sync}
            self._data_before = {k: v for k, v in self._data_before.items() if k >= self.consumed}
        return res

    def _raise_producer_error(self, j: int) -> None:
        from megatron_p3o.runtime.preemption import RolloutInterrupted

        if isinstance(self._error, (UserError, RolloutInterrupted)):
            raise self._error from None  # bad rollout data: the user's message; a stop signal
        if self._error is not None:
            raise RuntimeError(f"rollout producer failed on batch {j}") from self._error
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError("rollout producer thread died") from None

    def state_dict(self) -> dict:
        """What a checkpoint after ``consumed`` = c batches needs (module docstring): the batches
        c … c + K − 1 whole (``carried``; this waits until the producer made them), the data
        cursor before batch c + K and the re-evaluation requests from publication c − 1 on."""
        c, k, end = self.consumed, self.cfg.max_staleness, self.shard.end
        upto = c + k if end is None else min(c + k, end)
        with self._cond:
            while True:
                missing = [i for i in range(c, upto) if i not in self._ready]
                if not missing and (
                    upto in self._data_before or self._thread is None or upto == end
                ):
                    break
                self._raise_producer_error(missing[0] if missing else upto)
                self._cond.wait(timeout=1.0)
            carried = [self._ready[i].to_state() for i in range(c, upto)]
            # nothing in flight (inline, or the producer stopped at the end): the live cursor
            data = self._data_before.get(upto) if self._thread is not None else None
            pending = [
                {"step": p.step, "version": p.version, "reeval": [list(x) for x in p.reeval]}
                for s, p in sorted(self._pubs.items())
                if s >= upto - k - 1 and p.reeval
            ]
        return {"data": data or self.data.state_dict(), "pending": pending, "carried": carried}

    @staticmethod
    def cursor_before_carried(state: dict) -> dict:
        """The data cursor before a saved state's carried batches (the live one when none is
        carried): where a resumed run at another DP size makes those batches again."""
        carried = state.get("carried", [])
        return carried[0]["data_state"] if carried else state["data"]

    @staticmethod
    def pending_reevals(state: dict) -> list:
        """The re-evaluation requests a saved state's publications still owed."""
        return [x for p in state["pending"] for x in p["reeval"]]

    @staticmethod
    def carried_reevals(state: dict) -> list:
        """The re-evaluated groups of a saved state's carried batches, as requests
        (``[index, prompt_ids, answer]``), for a run that makes those batches again."""
        return [
            [g["index"], g["prompt_ids"], g["answer"]]
            for b in state.get("carried", []) for g in b["groups"] if g["source"] == "reeval"
        ]  # fmt: skip

    def weights_state(self) -> Optional[dict]:
        """Under lagged sync: the weights the batches after the checkpoint are due from when they
        are older than the trainer's — ``{"version": v, "tensors": {name: tensor} | None}``
        (None: an engine the backend pushed to, whose tensors the trainer no longer has);
        None when they are the trainer's own (L = 1, or a sync point)."""
        c = self.consumed
        with self._cond:
            pub = max(
                (p for s, p in self._pubs.items() if p.weights.is_sync and s <= c - 1),
                key=lambda p: p.step,
            )
        if pub.version >= c:
            return None
        tensors = dict(pub.weights.tensors) if isinstance(pub.weights, LoadWeights) else None
        return {"version": pub.version, "tensors": tensors}

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # -- the producer ---------------------------------------------------------------------------
    def _wait_for(self, j: int) -> Tuple[Publication, List]:
        """Block until publication j − K − 1 exists; return the weights to use and the prompts to
        re-evaluate."""
        need = j - self.cfg.max_staleness - 1
        with self._cond:
            while need >= self.start and need not in self._pubs and not self._stop:
                self._cond.wait(timeout=1.0)
            if self._stop:
                raise _Stopped()
            with_w = [
                p
                for s, p in self._pubs.items()
                if p.weights.is_sync and s <= max(need, self.start - 1)
            ]
            pub = max(with_w, key=lambda p: p.step)
            reeval = list(self._pubs[need].reeval) if need in self._pubs else []
            for old in self._pubs.values():
                if old.step < pub.step:
                    old.weights = NoWeights()  # superseded: no later batch is made with them
            return pub, reeval

    def ensure_weights(self, pub: Publication) -> None:
        """Load ``pub``'s weights into the engine unless it already holds that version."""
        from megatron_p3o.weight_sync import iter_hf_buckets

        with self.engine_lock:
            # WeightsPushed: the backend pushed them to its server itself
            if isinstance(pub.weights, LoadWeights) and self.engine.weight_version != pub.version:
                self.engine.update_weights(
                    iter_hf_buckets(iter(pub.weights.tensors), BUCKET_BYTES), version=pub.version
                )

    def _sampling(self, j: int, rnd: int) -> SamplingParams:
        sh = self.shard
        return replace(sh.sampling, seed=sh.seed * 7919 + j * 31 + sh.dp_rank + rnd * 1_000_003)

    def _roll(self, items: List[PromptItem], sources: List[str], j: int, rnd: int) -> List[Group]:
        prompts = [it.prompt_ids for it in items]
        sampling = self._sampling(j, rnd)
        if self.turns is not None:  # multi-turn: the environment scores each trajectory
            envs = [EnvItem(it.index, self.data.prompts[it.index], it.answer,
                            sampling.seed * 31 + k) for k, it in enumerate(items)]  # fmt: skip
            samples = self.turns.run(self.engine, prompts, envs, self.cfg.n_samples, sampling)
        else:
            samples = self.engine.generate(prompts, self.cfg.n_samples, sampling)
        rewards = self.score(samples, [items[s.group_id].answer for s in samples])
        groups = [
            Group(it.index, list(it.prompt_ids), it.answer, [], src)
            for it, src in zip(items, sources)
        ]
        for s, r in zip(samples, rewards):
            s.reward = r
            groups[s.group_id].samples.append(s)
        return groups

    def _produce(self, j: int) -> RolloutResult:
        c, sh = self.cfg, self.shard
        pub, reeval = self._wait_for(j)
        t0 = time.perf_counter()
        with self.engine_lock:
            self.ensure_weights(pub)
            with self._cond:
                self._data_before[j] = self.data.state_dict()
                self._cond.notify_all()
            reeval = reeval[: sh.prompts]
            items = [PromptItem(i, list(ids), a) for i, ids, a in reeval]
            items += self.data.next_local(sh.prompts - len(items))
            groups = self._roll(
                items, ["reeval"] * len(reeval) + ["fresh"] * (sh.prompts - len(reeval)), j, 0
            )
            rounds, dropped = 0, []
            while c.dynamic_sampling and rounds < c.dynamic_max_rounds:
                empty = [i for i, g in enumerate(groups) if g.homogeneous]
                if not self.engine.any_rank(bool(empty)):
                    break
                rounds += 1
                new = self._roll(
                    self.data.next_local(len(empty)), ["fresh"] * len(empty), j, rounds
                )
                for i, g in zip(empty, new):
                    dropped.append(groups[i])
                    groups[i] = g
        if c.logprob_noise > 0:
            gen = torch.Generator().manual_seed(sh.seed * 104_729 + j * 13 + sh.dp_rank)
            for g in groups:
                for s in g.samples:
                    noise = (
                        torch.randn(len(s.logprobs), generator=gen, dtype=torch.float64)
                        * c.logprob_noise
                    )
                    # the policy's tokens only (an environment token has no ℓb to misreport)
                    s.logprobs = [x + float(e) * m for x, e, m in zip(s.logprobs, noise, s.mask())]
        toks = sum(s.policy_tokens for g in groups for s in g.samples)
        env_toks = sum(len(s.completion_ids) for g in groups for s in g.samples) - toks
        dt = time.perf_counter() - t0
        stats = {
            "rollout_s": dt,
            "rollout_tokens": float(toks),
            "rollout_env_tokens": float(env_toks),
            "dynamic_rounds": float(rounds),
            "dynamic_refilled": float(len(dropped)),
            "reeval_groups": float(len(reeval)),
            "rollout_version": float(pub.version),
        }
        with self._cond:
            before = self._data_before[j]
        return RolloutResult(j, groups, before, stats, dropped)

    def _run(self) -> None:
        j = self._produce_from
        try:
            while self.shard.end is None or j < self.shard.end:
                res = self._produce(j)
                with self._cond:
                    self._ready[j] = res
                    self._cond.notify_all()
                j += 1
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the trainer thread by next()
            with self._cond:
                self._error = e
                self._cond.notify_all()


class _Stopped(Exception):
    pass
