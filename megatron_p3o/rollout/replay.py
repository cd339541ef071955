"""Replay buffer with a BAPO-style batch policy (Wan et al., 2026, "Buffer Matters").

Why: a group whose completions all score the same has zero group-relative advantage and
teaches nothing, yet costs a full rollout. BAPO adapts the batch instead of wasting those slots:

* **difficult** groups (mean reward ≤ ``difficult_max``, c1 — typically all wrong) are remembered
  as prompts and *re-evaluated*: rolled out again later with the newer policy
  (``take_reeval`` hands them to the rollout scheduler, ``reeval_per_step`` per batch);
* **high-quality** groups (``quality_min`` ≤ mean ≤ ``quality_max``, c2/c3 — mixed outcomes,
  the most informative) are stored with their completions, rewards and behaviour log-probs and
  *reused* off-policy, at most ``max_reuse`` times and while no older than ``max_age`` weight
  versions (P3O's ratio is taken against the stored ℓb, so reuse is an honest off-policy step);
* at each step the batch's homogeneous groups are replaced by stored high-quality ones (the
  batch keeps its size, so the micro-batch arithmetic holds).

Policy ``none`` passes batches through untouched. Everything is deterministic (a function of the
batches seen), and ``state_dict()``/``load_state_dict()`` put the buffer in the training checkpoint.

Policy ``fifo`` (ReVal, arXiv 2603.23355): a first-in-first-out buffer of single trajectories
(:class:`TrajectoryFIFO`); every trainer step makes one update on the fresh batch, then one on a
uniform sample (without replacement) of the buffer's older trajectories, then adds the fresh
ones. The buffer keeps tokens, ℓb, the reward the objective regresses on and the finish reason;
the reference model's ℓref and V_ref(s₁) are recomputed by one no-grad reference forward for
each replay batch (so a reference reset never leaves stale values behind).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Sequence, Tuple

import torch

from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.runtime.fields import check_choice, check_ranges
from megatron_p3o.types import TRAJECTORY_META, Group, Sample, routes_in, routes_out


@dataclass(frozen=True)
class ReplayConfig:
    """Attributes:
    policy: "none" or "bapo".
    capacity: stored high-quality groups (oldest evicted first).
    max_reuse: times a stored group may be trained on again.
    max_age: a stored group is dropped once the policy is this many versions newer.
    difficult_max: c1 — group mean reward ≤ c1 marks a prompt difficult (re-evaluate it).
    quality_min, quality_max: c2, c3 — groups with c2 ≤ mean ≤ c3 are stored for reuse.
    reeval_per_step: difficult prompts rolled out again in each rollout batch.
    difficult_capacity: difficult prompts remembered (oldest dropped first).
    """

    policy: str = "none"
    capacity: int = 256
    max_reuse: int = 2
    max_age: int = 4
    difficult_max: float = 0.0
    quality_min: float = 0.2
    quality_max: float = 0.8
    reeval_per_step: int = 2
    difficult_capacity: int = 1024
    fifo_capacity: int = 5120
    fifo_batch: int = 0

    RANGES: ClassVar[Dict[str, str]] = {
        "capacity": ">= 0",
        "max_reuse": ">= 0",
        "max_age": ">= 0",
        "reeval_per_step": ">= 0",
        "difficult_capacity": ">= 0",
        "fifo_batch": ">= 0",
        "fifo_capacity": ">= 1",
    }

    def __post_init__(self):
        check_choice("replay.policy", self.policy, ("none", "bapo", "fifo"))
        check_ranges(self, self.RANGES, "replay")
        if not self.quality_min <= self.quality_max:
            raise ConfigError(
                f"replay.quality_min={self.quality_min} > quality_max={self.quality_max}"
            )


class ReplayBuffer:
    def __init__(self, cfg: ReplayConfig):
        self.cfg = cfg
        self.stored: deque = deque()  # high-quality groups, oldest first
        self.difficult: deque = deque()  # (index, prompt_ids, answer) of difficult prompts
        self._difficult_ids: set = set()

    @property
    def active(self) -> bool:
        """The BAPO batch policy (``fifo`` replays through :class:`TrajectoryFIFO` instead)."""
        return self.cfg.policy == "bapo"

    def take_reeval(self) -> List[Tuple[int, List[int], str]]:
        """Up to ``reeval_per_step`` difficult prompts (oldest first), removed from the buffer."""
        out = []
        while self.active and self.difficult and len(out) < self.cfg.reeval_per_step:
            item = self.difficult.popleft()
            self._difficult_ids.discard(item[0])
            out.append(item)
        return out

    def _remember_difficult(self, g: Group) -> None:
        if g.index in self._difficult_ids or self.cfg.difficult_capacity == 0:
            return
        if len(self.difficult) >= self.cfg.difficult_capacity:
            self._difficult_ids.discard(self.difficult.popleft()[0])
        self.difficult.append((g.index, list(g.prompt_ids), g.answer))
        self._difficult_ids.add(g.index)

    def _eligible(self, version: int) -> None:
        """Drop stored groups that are too old or used up."""
        keep = [
            g
            for g in self.stored
            if g.uses < 1 + self.cfg.max_reuse and version - g.oldest_version <= self.cfg.max_age
        ]
        self.stored = deque(keep)

    def compose(
        self, groups: List[Group], version: int, dropped: Sequence[Group] = ()
    ) -> Tuple[List[Group], Dict[str, float]]:
        """The batch to train on at policy ``version``: homogeneous groups swapped for stored ones.

        Every fresh/re-evaluated group counts as one use; mixed ones are stored for reuse,
        difficult ones remembered for re-evaluation (also those dynamic sampling ``dropped``).
        """
        stats = {
            "replay_groups": 0.0,
            "replay_difficult": float(len(self.difficult)),
            "homogeneous_groups": float(sum(g.homogeneous for g in groups)),
        }
        if not self.active:
            return groups, stats
        c = self.cfg
        self._eligible(version)
        for g in dropped:
            if g.mean_reward <= c.difficult_max:
                self._remember_difficult(g)
        out: List[Group] = []
        for g in groups:
            g.uses += 1
            if g.homogeneous:
                if g.mean_reward <= c.difficult_max:
                    self._remember_difficult(g)
                if self.stored:
                    r = self.stored.pop()  # newest first: the least off-policy
                    r.uses += 1
                    r.source = "replay"
                    out.append(r)
                    stats["replay_groups"] += 1
                    continue
            out.append(g)
        for g in groups:  # stored after the swap, so a group is never reused in its own batch
            if not g.homogeneous and c.quality_min <= g.mean_reward <= c.quality_max and c.capacity:
                self.stored.append(g)
        for g in out:
            if g.source == "replay" and g.uses < 1 + c.max_reuse:
                self.stored.appendleft(g)  # reusable again, behind the fresher groups
        while len(self.stored) > c.capacity:
            self.stored.popleft()
        stats["replay_difficult"] = float(len(self.difficult))
        stats["replay_stored"] = float(len(self.stored))
        return out, stats

    def state_dict(self) -> dict:
        return {
            "stored": [g.to_dict() for g in self.stored],
            "difficult": [list(x) for x in self.difficult],
        }

    @staticmethod
    def regroup(states: List[dict], more_difficult: Sequence, dp: int, rank: int) -> dict:
        """This rank's buffer at a new DP size ``dp`` from every old rank's ``state_dict()``:
        the stored groups and the difficult prompts (then ``more_difficult``: re-evaluation
        requests the old ranks still owed) of all of them, dealt out round-robin."""
        stored = [x for s in states for x in s["stored"]]
        difficult = [x for s in states for x in s["difficult"]] + list(more_difficult)
        return {"stored": stored[rank::dp], "difficult": difficult[rank::dp]}

    def load_state_dict(self, st: dict) -> None:
        self.stored = deque(Group.from_dict(d) for d in st["stored"])
        self.difficult = deque((int(i), list(p), str(a)) for i, p, a in st["difficult"])
        self._difficult_ids = {i for i, _, _ in self.difficult}


class TrajectoryFIFO:
    """Single trajectories with the per-sequence reward their objective regresses on (ReVal's
    centred r), oldest evicted first; one buffer per DP rank (every rank of a model-parallel
    group holds the same one: same samples, same seeded draws)."""

    def __init__(self, cfg: ReplayConfig, seed: int, dp_rank: int):
        self.cfg, self.seed, self.dp_rank = cfg, seed, dp_rank
        self.items: deque = deque()  # (Sample, advantage)

    @property
    def active(self) -> bool:
        return self.cfg.policy == "fifo"

    def __len__(self) -> int:
        return len(self.items)

    def add(self, samples: Sequence[Sample], advantages) -> None:
        for s, a in zip(samples, [float(x) for x in advantages]):
            self.items.append((s, a))
        while len(self.items) > self.cfg.fifo_capacity:
            self.items.popleft()

    def draw(self, n: int, step: int):
        """``(samples, advantages)``: ``n`` trajectories drawn uniformly without replacement
        (seeded by run seed, step and DP rank: a resumed run draws the same), or None while the
        buffer holds fewer than ``n`` (every DP rank's buffer grows alike, so all agree)."""
        n = self.cfg.fifo_batch or n
        if len(self.items) < n:
            return None
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + self.dp_rank)
        pick = torch.randperm(len(self.items), generator=g)[:n].tolist()  # host
        chosen = [self.items[i] for i in pick]
        return [s for s, _ in chosen], [a for _, a in chosen]

    def state_dict(self) -> dict:
        return {
            "fifo": [
                {
                    "prompt_ids": s.prompt_ids,
                    "completion_ids": s.completion_ids,
                    "logprobs": s.logprobs,
                    "finish_reason": s.finish_reason,
                    "weight_version": s.weight_version,
                    "group_id": s.group_id,
                    "reward": s.reward,
                    "advantage": a,
                    "routed_experts": routes_out(s.routed_experts),
                    "token_versions": s.token_versions,
                    "policy_mask": s.policy_mask,
                    "meta": {k: v for k, v in s.meta.items() if k in TRAJECTORY_META},
                }
                for s, a in self.items
            ]
        }

    @staticmethod
    def regroup(states: List[dict], dp: int, rank: int) -> dict:
        """This rank's FIFO at a new DP size from every old rank's ``state_dict()`` (the
        trajectories of all of them, dealt out round-robin)."""
        fifo = [x for s in states for x in s.get("fifo", [])]
        return {"fifo": fifo[rank::dp]}

    def load_state_dict(self, st: dict) -> None:
        self.items = deque()
        for d in st.get("fifo", []):
            d = dict(d)
            a = float(d.pop("advantage"))
            d["routed_experts"] = routes_in(d.get("routed_experts"))
            self.items.append((Sample(**d), a))
