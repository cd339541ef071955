"""What the multi-turn loop asks of an engine: a place for a trajectory (admission under the
concurrency cap), one model turn at a time, and the place back.

Why an interface of its own: the loop runs one coroutine per trajectory, and each engine serves
concurrent turns its own way. A server engine (SGLang) batches continuously by itself: every
turn is one request from a thread of this module's pool (:class:`ThreadedTurnServer`, the
default of :meth:`~megatron_p3o.rollout.engine.RolloutEngine.turn_server`). The embedded engine
batches in-process (:mod:`megatron_p3o.rollout.embedded_turns`: every trajectory keeps its KV
cache between its turns, so a turn prefills only what was appended since the last).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from megatron_p3o.types import Sample, SamplingParams


class TurnServer:
    """Admission, turns and release for the trajectories of one rollout (``k`` = a
    trajectory's index). ``context_length``: the engine's context (None: unbounded)."""

    context_length: Optional[int] = None

    async def admit(self, k: int) -> None:
        raise NotImplementedError

    async def generate(self, k: int, ids: Sequence[int], sampling: SamplingParams,
                       key: Optional[str] = None) -> Sample:  # fmt: skip
        """One completion of ``ids`` (the trajectory so far); ``finish_reason`` may be
        ``abort``. ``key``: the trajectory's routing key."""
        raise NotImplementedError

    def release(self, k: int) -> None:
        raise NotImplementedError

    @property
    def weight_version(self) -> int:
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - most servers hold nothing
        pass


class ThreadedTurnServer(TurnServer):
    """Each turn is one :meth:`~megatron_p3o.rollout.engine.RolloutEngine.generate_turn` call
    in a thread of a pool of ``slots`` (the concurrency cap), so ``slots`` requests are in
    flight at once and the server batches them as they come."""

    def __init__(self, engine, slots: int):
        self.engine, self.slots = engine, slots
        self.context_length = getattr(engine, "context_length", None)
        self._sem: Optional[asyncio.Semaphore] = None
        self._pool = ThreadPoolExecutor(max(1, slots), thread_name_prefix="turn")

    async def admit(self, k: int) -> None:
        if self._sem is None:  # made inside the running loop
            self._sem = asyncio.Semaphore(self.slots)
        await self._sem.acquire()

    async def generate(self, k, ids, sampling, key=None) -> Sample:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, self.engine.generate_turn, list(ids), sampling, key
        )

    def release(self, k: int) -> None:
        self._sem.release()

    @property
    def weight_version(self) -> int:
        return int(getattr(self.engine, "weight_version", 0))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
