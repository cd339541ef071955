"""Where multi-turn trajectories run when a job has several ranks, and how their samples reach
every rank: the ranks meet once per rollout, when its samples are handed out — never per turn.

- An engine on every rank (embedded): each DP rank's leader (TP = PP = CP = 0) runs its
  trajectories, environments included, and its model-parallel peers get a copy
  (:class:`LeaderTurns`). Peers running their own copies would call every tool TP·PP·CP times
  and, with a tool whose answer varies, train on batches that differ across a TP group.
- One server for the job (SGLang, :class:`~megatron_p3o.rollout.central.CentralEngine`):
  global rank 0 runs every DP rank's trajectories against it (:func:`central_turns`), so each
  trajectory advances on its own whatever rank it belongs to.

A failure on the rank that ran them (a user error, a stop signal) reaches every rank as the
same exception: no rank is left waiting in the exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron_p3o.runtime.collectives import gather_objects, scatter_objects
from megatron_p3o.runtime.errors import UserError


@dataclass
class _Failed:
    kind: str  # "interrupted" | "user" | "error"
    message: str


class RolloutFailed(UserError, RuntimeError):
    """A multi-turn rollout failed on the rank that ran it (the message is that rank's)."""


def _outcome(fn):
    """``fn()``, or the failure as a :class:`_Failed` (sent to the other ranks)."""
    from megatron_p3o.runtime.preemption import RolloutInterrupted

    try:
        return fn()
    except RolloutInterrupted as e:
        return _Failed("interrupted", str(e))
    except UserError as e:
        return _Failed("user", str(e))
    except Exception as e:  # noqa: BLE001 - every rank raises it
        return _Failed("error", f"{type(e).__name__}: {e}")


def _raise_if_failed(got):
    from megatron_p3o.runtime.preemption import RolloutInterrupted

    if isinstance(got, _Failed):
        if got.kind == "interrupted":
            raise RolloutInterrupted(got.message)
        if got.kind == "user":
            raise RolloutFailed(got.message)
        raise RuntimeError(f"multi-turn rollout failed: {got.message}")
    return got


def _hand_out(groups, objects, dp_samples, why: str) -> list:
    """Every DP leader's samples (or failure) → each rank gets its DP rank's, in two
    collectives over the rollout's own gloo group ``objects``."""
    mine = (groups.dp_rank, dp_samples if groups.is_dp_leader else None)
    gathered = gather_objects(mine, 0, objects, why)
    out: Optional[List] = None
    if groups.rank == 0:
        by_dp = {d: s for d, s in gathered if s is not None}
        failed = next((s for s in by_dp.values() if isinstance(s, _Failed)), None)
        out = [failed or by_dp[d] for d, _ in gathered]
    got = scatter_objects(out, 0, objects, "each rank its DP rank's trajectories")
    return _raise_if_failed(got)


class LeaderTurns:
    """A turn loop run by each DP leader only; its model-parallel peers get its samples."""

    def __init__(self, loop, groups, objects):
        self.loop, self.groups, self.objects = loop, groups, objects

    def __getattr__(self, name):
        return getattr(self.loop, name)

    def run(self, engine, prompts, items, n, sampling):
        samples = None
        if self.groups.is_dp_leader:
            samples = _outcome(lambda: self.loop.run(engine, prompts, items, n, sampling))
        why = "the DP leader's trajectories to its model-parallel peers (once per rollout)"
        return _hand_out(self.groups, self.objects, samples, why)


def central_turns(central, loop, prompts, items, n, sampling) -> list:
    """Every DP rank's trajectories run on global rank 0 against ``central.inner``; each rank
    gets its DP rank's samples (``group_id`` counted from its own first prompt)."""
    g = central.groups
    leader = g.is_dp_leader
    mine = (g.dp_rank, [list(p) for p in prompts] if leader else None,
            list(items) if leader else None)  # fmt: skip
    why = "every DP leader's prompts and environment items to the rank that drives the server"
    gathered = gather_objects(mine, 0, central.objects, why)
    out: Optional[List] = None
    if g.rank == 0:
        flat_p, flat_i, owners = [], [], []
        for dp_rank, ps, its in gathered:
            if ps is not None:
                owners.append((dp_rank, len(flat_p), len(ps)))
                flat_p += ps
                flat_i += its

        def run():
            return loop.run_local(central.inner, flat_p, flat_i, n, sampling) if flat_p else []

        samples = _outcome(run)
        by_dp = {}
        for dp_rank, start, count in owners:
            if isinstance(samples, _Failed):
                by_dp[dp_rank] = samples
                continue
            part = [s for s in samples if start <= s.group_id < start + count]
            for s in part:
                s.group_id -= start
            by_dp[dp_rank] = part
        out = [by_dp.get(d, []) for d, _, _ in gathered]
    got = scatter_objects(out, 0, central.objects, "each rank its DP rank's trajectories")
    return _raise_if_failed(got)
