"""Environment steps outside the trainer's process: one worker process per running episode,
killed when a step runs past its timeout.

Why processes: an environment runs whatever the policy wrote through whatever tool the user
wrote. In a thread of the trainer a step that never returns cannot be stopped (Python has no way
to end a thread), a CPU-bound one takes the GIL from the trainer, and one that allocates without
bound takes the trainer's memory. In a process of its own a step is bounded three ways: a
deadline (past it the worker gets SIGKILL and its episode ends ``tool_error``), an address-space
limit (``RLIMIT_AS``: an allocation past it is a ``MemoryError`` inside the step), and the size of
what it may send back (an observation is cut to ``max_chars`` characters in the worker, before
anything is sent or tokenized).

The workers are forked from a small server process (``multiprocessing``'s forkserver, which
imports this module and the environment's, never torch), so starting one costs milliseconds,
not an interpreter start. A worker holds one environment instance at a time (its episode's
state) and is reused for later episodes (``reset`` makes a new instance); the pool keeps as
many as episodes run at once (``rollout.multi_turn.concurrency``) and replaces a killed one.

The environment is named, not passed (:class:`EnvSpec`: ``module:Class`` and keyword
arguments), so a worker can build it; its observations cross as text.
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing as mp
import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from megatron_p3o.env.types import StepResult

# ("ok", value) | ("error", "Type: message") | ("timeout", None) | ("died", "why")
Outcome = Tuple[str, Any]


@dataclass(frozen=True)
class EnvSpec:
    """Which environment a worker builds: ``target`` ``"module:Class"``, ``args`` its keyword
    arguments; ``memory_mb`` the worker's address-space limit (0: none); ``max_chars`` the
    longest observation text sent back (longer ones are cut, in the worker)."""

    target: str
    args: Dict[str, Any] = field(default_factory=dict)
    memory_mb: int = 0
    max_chars: int = 65536

    def build(self):
        mod, name = self.target.split(":", 1)
        return getattr(importlib.import_module(mod), name)(**self.args)


def cut_observation(obs, max_chars: int):
    """``(text or None, cut)``: bytes decoded as UTF-8 (undecodable bytes replaced), then cut
    to ``max_chars`` characters."""
    if obs is None:
        return None, False
    if isinstance(obs, bytes):
        obs = obs[: 4 * max_chars].decode("utf-8", errors="replace")
    text = str(obs)
    return (text[:max_chars], True) if len(text) > max_chars else (text, False)


def _limit_memory(mb: int) -> None:
    if mb > 0:
        import resource

        n = mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (n, n))


def _serve(conn, memory_mb: int) -> None:
    """The worker's loop: ``("reset", (spec, item))`` builds a fresh environment and resets it,
    ``("step", text)`` steps it; every answer is an :data:`Outcome`. A worker never raises: an
    exception in the environment (``MemoryError`` past the limit included) is its answer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's Ctrl-C is the trainer's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _limit_memory(memory_mb)
    env, spec = None, None
    while True:
        try:
            op, payload = conn.recv()
        except (EOFError, OSError):
            return
        if op == "close":
            return
        try:
            if op == "reset":
                spec, item = payload
                env = spec.build()
                obs, cut = cut_observation(env.reset(item), spec.max_chars)
                out: Outcome = ("ok", (obs, cut))
            else:
                out = ("ok", _cut_result(env.step(payload), spec.max_chars))
        except BaseException as e:  # noqa: BLE001 - the environment's failure is an answer
            out = ("error", f"{type(e).__name__}: {e}"[:2000])
        try:
            conn.send(out)
        except Exception as e:  # noqa: BLE001 - an answer that does not pickle
            conn.send(("error", f"the answer cannot be sent ({type(e).__name__}: {e})"[:2000]))


_CTX = None
_START = threading.Lock()


@contextmanager
def _without_main():
    """While a worker starts: ``multiprocessing`` would have it import the parent's
    ``__main__`` (a script without an ``if __name__ == "__main__"`` guard would run again in
    every worker); a worker needs only this module and the environment's, so that part of its
    preparation is dropped."""
    from multiprocessing import spawn

    real = spawn.get_preparation_data

    def prep(name):
        return {k: v for k, v in real(name).items() if not k.startswith("init_main")}

    with _START:
        spawn.get_preparation_data = prep
        try:
            yield
        finally:
            spawn.get_preparation_data = real


def _context():
    """The forkserver context, started once per process with this module preloaded."""
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        _CTX = ctx
    return _CTX


class EnvWorker:
    """One worker process and its pipe."""

    def __init__(self, memory_mb: int):
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, memory_mb), daemon=True)
        with _without_main():
            self.proc.start()
        child.close()
        self.dead = False

    async def call(self, op: str, payload, timeout_s: float) -> Outcome:
        """Send one request and wait for its answer at most ``timeout_s``; past it the worker
        is killed (``("timeout", None)``). A worker that died answers ``("died", why)``."""
        if self.dead:
            return ("died", "the environment's worker is gone")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fd = self.conn.fileno()

        def answer(why):
            if not fut.done():
                fut.set_result(why)

        try:
            self.conn.send((op, payload))
        except (OSError, ValueError) as e:
            self.kill()
            return ("died", f"the environment's worker is gone ({type(e).__name__})")
        loop.add_reader(fd, answer, "ready")
        late = loop.call_later(timeout_s, answer, "late")
        try:
            why = await fut
        except asyncio.CancelledError:
            self.kill()  # an interrupted rollout: the step may never end
            raise
        finally:
            late.cancel()
            loop.remove_reader(fd)
        if why == "late":
            self.kill()
            return ("timeout", None)
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            code = self.proc.exitcode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            return ("died", f"the environment's worker died ({how})")

    def kill(self) -> None:
        """SIGKILL and reap (a tool stuck in C code or ``while True`` ends here)."""
        self.dead = True
        if self.proc.is_alive():
            try:  # it may die between the two calls (the forkserver, its parent, reaps it)
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.join(5)
        self.conn.close()

    def close(self) -> None:
        if self.dead:
            return
        try:
            self.conn.send(("close", None))
        except (OSError, ValueError):
            pass
        self.proc.join(1)
        self.kill()


class EnvPool:
    """Workers for ``size`` episodes at once; :meth:`acquire` one per episode, :meth:`release`
    it after (a killed one is dropped and replaced by the next acquire)."""

    def __init__(self, memory_mb: int = 0):
        self.memory_mb = memory_mb
        self.idle: List[EnvWorker] = []
        self.busy: List[EnvWorker] = []
        self._lock = threading.Lock()  # rollouts and evaluation may share a pool

    def acquire(self) -> EnvWorker:
        with self._lock:
            w = self.idle.pop() if self.idle else None
        w = w or EnvWorker(self.memory_mb)
        with self._lock:
            self.busy.append(w)
        return w

    def release(self, w: EnvWorker) -> None:
        with self._lock:
            if w in self.busy:
                self.busy.remove(w)
            if not w.dead:
                self.idle.append(w)

    def kill_busy(self) -> None:
        """Every worker still inside a step (an interrupted rollout)."""
        with self._lock:
            busy, self.busy = self.busy, []
        for w in busy:
            w.kill()

    def close(self) -> None:
        self.kill_busy()
        for w in self.idle:
            w.close()
        self.idle = []

    def __len__(self) -> int:
        return len(self.idle) + len(self.busy)


def _cut_result(res, max_chars: int):
    if not isinstance(res, StepResult):
        return (f"step() returned {type(res).__name__}, not a StepResult", None)
    obs, cut = cut_observation(res.observation, max_chars)
    return StepResult(obs, res.reward, res.done, res.tool_calls, res.tool_error), cut


async def _on_loop(fn, timeout_s: float) -> Outcome:
    """``fn()`` (a coroutine or a plain value) bounded by ``timeout_s`` on the running loop."""
    try:
        value = fn()
        if asyncio.iscoroutine(value):
            value = await asyncio.wait_for(value, timeout_s)
        return ("ok", value)
    except asyncio.TimeoutError:
        return ("timeout", None)
    except Exception as e:  # noqa: BLE001 - the environment's failure is an answer
        return ("error", f"{type(e).__name__}: {e}"[:2000])


class Episode:
    """One episode's environment: ``reset`` and ``step`` return :data:`Outcome` values whose
    ``ok`` values are ``(observation, cut)`` and ``(StepResult | error text, cut)``."""

    def __init__(self, host: "EnvHost"):
        self.host = host
        self.worker = host.pool.acquire() if not host.on_loop else None
        self.env = None

    async def reset(self, item, timeout_s: float) -> Outcome:
        spec = self.host.spec
        if self.worker is not None:
            return await self.worker.call("reset", (spec, item), timeout_s)
        out = await _on_loop(spec.build, timeout_s)
        if out[0] != "ok":
            return out
        self.env = out[1]
        out = await _on_loop(lambda: self.env.reset(item), timeout_s)
        return ("ok", cut_observation(out[1], spec.max_chars)) if out[0] == "ok" else out

    async def step(self, text: str, timeout_s: float) -> Outcome:
        if self.worker is not None:
            return await self.worker.call("step", text, timeout_s)
        out = await _on_loop(lambda: self.env.step(text), timeout_s)
        return ("ok", _cut_result(out[1], self.host.spec.max_chars)) if out[0] == "ok" else out

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """An on-loop environment's ``aclose()`` (a remote session to end), bounded; its
        failure is not the episode's."""
        fn = getattr(self.env, "aclose", None)
        if fn is not None:
            await _on_loop(fn, timeout_s)

    def close(self) -> None:
        if self.worker is not None:
            self.host.pool.release(self.worker)


class EnvHost:
    """Where an environment's episodes run: ``async def step`` environments on the rollout's
    event loop (their waits are remote: a tool server, an HTTP environment), every other one in
    a worker process of :class:`EnvPool`."""

    def __init__(self, spec: EnvSpec, on_loop: bool):
        self.spec, self.on_loop = spec, on_loop
        self.pool = EnvPool(spec.memory_mb)

    def episode(self) -> Episode:
        return Episode(self)

    def interrupt(self) -> None:
        """Kill every worker still inside a step (an interrupted rollout)."""
        self.pool.kill_busy()

    def close(self) -> None:
        self.pool.close()
