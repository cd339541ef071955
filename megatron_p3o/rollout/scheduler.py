"""Rollout scheduling: which prompts are rolled out with which weight version, and when.

One rule covers the three regimes (synchronous, lagged sync every L steps, asynchronous with
staleness bound K). The trainer *publishes* after each of its steps s = 0, 1, …: the new weight
version s+1 (with the weights themselves when (s+1) % L == 0) and the difficult prompts the
replay buffer wants re-evaluated. Rollout batch j (consumed by trainer step j) is generated

    after publication j − K − 1, with the newest weights published up to it,
    i.e. weight version  L·⌊(j − K)/L⌋  (clamped to the run's first version),

so a sample trained on at step j is at most K + L − 1 versions stale, and exactly which weights
produced each batch is fixed by the schedule, not by thread timing: runs are reproducible.
K = 0 generates inline when the trainer asks; K ≥ 1 runs a producer thread that rolls out batch
j + 1 … j + K while the trainer trains on batch j (the overlap AReaL/slime-style async gives).

Each batch is scored here (rewards are cheap next to generation) so DAPO dynamic sampling can
refill groups with no learning signal (all rewards equal) from fresh prompts, up to a bound of
rounds. Injected noise on the behaviour log-probs (stress experiments) is applied here too.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import UserError
from ..types import Group, Sample, SamplingParams
from .engine import RolloutEngine
from .prompts import PromptData, PromptItem

ScoreFn = Callable[[Sequence[Sample], Sequence[str]], List[float]]
NamedTensors = List[Tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class RolloutPlan:
    """Attributes:
    prompts: prompts per batch on this DP rank.
    n_samples: completions per prompt.
    sampling: engine sampling parameters (the seed is set per batch).
    sync_every: L.
    max_staleness: K (0 = synchronous).
    dynamic_sampling: refill all-equal-reward groups with fresh prompts (DAPO).
    max_rounds: refill rounds per batch before giving up (the rest stay, counted).
    logprob_noise: σ of Gaussian noise added to the behaviour log-probs (stress tests only).
    seed: run seed; dp_rank: this rank (sampling seeds differ per DP rank).
    bucket_bytes: weight-sync bucket size.
    end: the first batch index not to produce (the run's last step); None = no end. An
        async producer stops there, so nothing is generated that no step will train on, and
        ranks sharing a server stop after the same batch.
    """

    prompts: int
    n_samples: int
    sampling: SamplingParams
    sync_every: int = 1
    max_staleness: int = 0
    dynamic_sampling: bool = False
    max_rounds: int = 3
    logprob_noise: float = 0.0
    seed: int = 0
    dp_rank: int = 0
    bucket_bytes: int = 64 * 2**20
    end: Optional[int] = None


@dataclass
class Publication:
    step: int  # the trainer step that just ended (start − 1 for the initial weights)
    version: int
    weights: Optional[NamedTensors]
    reeval: List[Tuple[int, List[int], str]] = field(default_factory=list)


@dataclass
class RolloutResult:
    index: int
    groups: List[Group]
    data_state: dict  # the data cursor before this batch drew its prompts
    stats: Dict[str, float]
    dropped: List[Group] = field(default_factory=list)  # groups replaced by dynamic sampling


class RolloutScheduler:
    """Produces rollout batch ``start``, ``start + 1``, … by the rule in the module docstring."""

    def __init__(
        self,
        engine: RolloutEngine,
        data: PromptData,
        score: ScoreFn,
        plan: RolloutPlan,
        start: int,
        initial_weights: NamedTensors,
        pending: Sequence[dict] = (),
    ):
        self.engine, self.data, self.score, self.plan = engine, data, score, plan
        self.start, self.consumed = start, start
        self.engine_lock = threading.RLock()
        self._cond = threading.Condition()
        self._pubs: Dict[int, Publication] = {
            start - 1: Publication(start - 1, start, initial_weights)
        }
        for (
            p
        ) in pending:  # re-evaluation requests published before a checkpoint, not yet rolled out
            old = self._pubs.get(int(p["step"]))
            self._pubs[int(p["step"])] = Publication(
                int(p["step"]),
                int(p["version"]),
                old.weights if old else None,
                [tuple(x) for x in p["reeval"]],
            )
        self._data_before: Dict[int, dict] = {}
        self._error: Optional[BaseException] = None
        self._stop = False
        self._queue: "queue.Queue[RolloutResult]" = queue.Queue()
        self._thread = None
        if plan.max_staleness > 0:
            self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
            self._thread.start()

    # -- the trainer's side ---------------------------------------------------------------------
    def publish(
        self,
        step: int,
        version: int,
        weights: Optional[NamedTensors],
        reeval: Sequence[Tuple[int, List[int], str]] = (),
    ) -> None:
        """After trainer step ``step``: version ``version``, its weights (sync point) or None."""
        if weights is not None:
            weights = [(n, t.detach().clone()) for n, t in weights]  # training goes on in place
        with self._cond:
            self._pubs[step] = Publication(step, version, weights, list(reeval))
            self._cond.notify_all()

    def next(self) -> RolloutResult:
        """Rollout batch ``consumed`` (blocks until it is generated)."""
        j = self.consumed
        if self._thread is None:
            res = self._produce(j)
        else:
            while True:
                try:
                    res = self._queue.get(timeout=1.0)
                    break
                except queue.Empty:
                    if isinstance(self._error, UserError):
                        raise self._error from None  # bad rollout data: the user's message
                    if self._error is not None:
                        raise RuntimeError(f"rollout producer failed on batch {j}") from self._error
                    if not self._thread.is_alive():
                        raise RuntimeError("rollout producer thread died") from None
        assert res.index == j, (res.index, j)
        self.consumed += 1
        with self._cond:  # a checkpoint from now on restarts at batch `consumed`
            keep = self.consumed - self.plan.max_staleness - 1
            self._pubs = {s: p for s, p in self._pubs.items() if s >= keep or p.weights is not None}
            self._data_before = {k: v for k, v in self._data_before.items() if k >= self.consumed}
        return res

    def state(self) -> dict:
        """What a checkpoint after ``consumed`` batches needs to roll out batch ``consumed``
        again."""
        j = self.consumed
        if self._thread is None or (self.plan.end is not None and j >= self.plan.end):
            data = self.data.state()  # nothing in flight: the producer stopped at the end
        else:
            with self._cond:
                while j not in self._data_before and self._error is None:
                    self._cond.wait(timeout=1.0)
                if isinstance(self._error, UserError):
                    raise self._error
                if self._error is not None:
                    raise RuntimeError("rollout producer failed") from self._error
                data = self._data_before[j]
        with self._cond:
            pending = [
                {"step": p.step, "version": p.version, "reeval": [list(x) for x in p.reeval]}
                for s, p in sorted(self._pubs.items())
                if s >= j - self.plan.max_staleness - 1 and s >= self.start and p.reeval
            ]
        return {"data": data, "pending": pending}

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
        need = j - self.plan.max_staleness - 1
        with self._cond:
            while need >= self.start and need not in self._pubs and not self._stop:
                self._cond.wait(timeout=1.0)
            if self._stop:
                raise _Stopped()
            with_w = [
                p
                for s, p in self._pubs.items()
                if p.weights is not None and s <= max(need, self.start - 1)
            ]
            pub = max(with_w, key=lambda p: p.step)
            reeval = list(self._pubs[need].reeval) if need in self._pubs else []
            for old in self._pubs.values():
                if old.step < pub.step:
                    old.weights = None  # superseded: no later batch is generated with them
            return pub, reeval

    def ensure_weights(self, pub: Publication) -> None:
        """Load ``pub``'s weights into the engine unless it already holds that version."""
        from ..weight_sync import iter_hf_buckets

        with self.engine_lock:
            # an empty list: the trainer pushed these weights itself (a central server)
            if pub.weights and self.engine.weight_version != pub.version:
                self.engine.update_weights(
                    iter_hf_buckets(iter(pub.weights), self.plan.bucket_bytes), version=pub.version
                )

    def _sampling(self, j: int, rnd: int) -> SamplingParams:
        p = self.plan
        return replace(p.sampling, seed=p.seed * 7919 + j * 31 + p.dp_rank + rnd * 1_000_003)

    def _roll(self, items: List[PromptItem], sources: List[str], j: int, rnd: int) -> List[Group]:
        samples = self.engine.generate(
            [it.prompt_ids for it in items], self.plan.n_samples, self._sampling(j, rnd)
        )
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
        p = self.plan
        pub, reeval = self._wait_for(j)
        t0 = time.perf_counter()
        with self.engine_lock:
            self.ensure_weights(pub)
            with self._cond:
                self._data_before[j] = self.data.state()
                self._cond.notify_all()
            reeval = reeval[: p.prompts]
            items = [PromptItem(i, list(ids), a) for i, ids, a in reeval]
            items += self.data.next_local(p.prompts - len(items))
            groups = self._roll(
                items, ["reeval"] * len(reeval) + ["fresh"] * (p.prompts - len(reeval)), j, 0
            )
            rounds, dropped = 0, []
            while p.dynamic_sampling and rounds < p.max_rounds:
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
        if p.logprob_noise > 0:
            gen = torch.Generator().manual_seed(p.seed * 104_729 + j * 13 + p.dp_rank)
            for g in groups:
                for s in g.samples:
                    noise = (
                        torch.randn(len(s.logprobs), generator=gen, dtype=torch.float64)
                        * p.logprob_noise
                    )
                    s.logprobs = [x + float(e) for x, e in zip(s.logprobs, noise)]
        toks = sum(len(s.completion_ids) for g in groups for s in g.samples)
        dt = time.perf_counter() - t0
        stats = {
            "rollout_s": dt,
            "rollout_tokens": float(toks),
            "dynamic_rounds": float(rounds),
            "dynamic_refilled": float(len(dropped)),
            "reeval_groups": float(len(reeval)),
            "rollout_version": float(pub.version),
        }
        with self._cond:
            before = self._data_before[j]
        return RolloutResult(j, groups, before, stats, dropped)

    def _run(self) -> None:
        j = self.start
        try:
            while self.plan.end is None or j < self.plan.end:
                self._queue.put(self._produce(j))
                j += 1
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the trainer thread by next()
            self._error = e


class _Stopped(Exception):
    pass
