"""Run a test body on N gloo ranks, paying the Megatron import and process-group start once.

Why: importing Megatron-Core and starting a process group costs ~13 s per launch on 2-core
machines. A :class:`RankPool` keeps N spawned worker processes (one per rank, one shared gloo
world) for the whole pytest session; each test sends a body by reference
(``module:qualname``), a :class:`~megatron_p3o.runtime.parallel.Layout` and keyword arguments.
Every rank
initializes that layout, runs the body, and sends back its result or its traceback. A rank that
fails or a test that outlives its timeout fails the test with every rank's traceback, and the
pool is torn down (the next test gets a fresh one: after a failure ranks may be stuck in a
collective).
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import time
import traceback
from typing import Any, Callable, List, Optional

from megatron_p3o.runtime.ports import free_port

DEFAULT_TIMEOUT = float(os.environ.get("P3O_TEST_TIMEOUT", "300"))


def _worker(rank: int, world: int, port: int, conn) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from megatron_p3o.runtime import parallel

    try:
        from megatron_p3o.runtime import cpu_shim

        cpu_shim.install()
        parallel.init_distributed()
        conn.send(("ready", None))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        module, qualname, layout, seed, kwargs = msg
        try:
            fn: Any = importlib.import_module(module)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            groups = parallel.initialize(layout, seed=seed) if layout is not None else None
            result = fn(groups, **kwargs)
            conn.send(("ok", result))
        except BaseException:
            conn.send(("err", f"rank {rank}:\n{traceback.format_exc()}"))


class RankFailure(AssertionError):
    pass


class RankPool:
    """N persistent gloo ranks. ``run(body, layout, **kwargs)`` returns the per-rank results."""

    def __init__(self, world_size: int, start_timeout: float = 180.0):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            # Not daemonic: dist_checkpointing's writer starts child processes of its own.
            p = ctx.Process(target=_worker, args=(r, world_size, port, child), daemon=False)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        _ALL_POOLS.append(self)
        self._collect(start_timeout, "start-up")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _collect(self, timeout: float, what: str) -> List[Any]:
        deadline = time.monotonic() + timeout
        results: List[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        errors = []
        while pending:
            now = time.monotonic()
            if now > deadline or (errors and now > errors[0][0] + 10.0):
                break
            for r in sorted(pending):
                if self.conns[r].poll(0.05):
                    try:
                        status, payload = self.conns[r].recv()
                    except EOFError:
                        status, payload = (
                            "err",
                            f"rank {r}: process died (exit {self.procs[r].exitcode})",
                        )
                    pending.discard(r)
                    if status == "err":
                        errors.append((time.monotonic(), payload))
                    else:
                        results[r] = payload
                elif not self.procs[r].is_alive():
                    pending.discard(r)
                    errors.append(
                        (
                            time.monotonic(),
                            f"rank {r}: process died (exit {self.procs[r].exitcode})",
                        )
                    )
        if errors or pending:
            self.close()
            msg = [f"{what} failed on {self.world_size} ranks"]
            msg += [e for _, e in errors]
            if pending:
                waited = "10s after the first error" if errors else f"{timeout:.0f}s"
                msg.append(
                    f"ranks {sorted(pending)} gave no answer within {waited} "
                    "(timeout or stuck in a collective)"
                )
            raise RankFailure("\n".join(msg))
        return results

    def run(
        self,
        body: Callable,
        layout=None,
        *,
        seed: int = 1234,
        timeout: Optional[float] = None,
        **kwargs,
    ) -> List[Any]:
        if not self.alive:
            raise RankFailure("rank pool is not alive")
        msg = (body.__module__, body.__qualname__, layout, seed, kwargs)
        for c in self.conns:
            c.send(msg)
        return self._collect(timeout or DEFAULT_TIMEOUT, f"{body.__qualname__} {layout}")

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        self.procs = []
        self.conns = []


_ALL_POOLS: List["RankPool"] = []


@atexit.register
def _close_all() -> None:
    for pool in _ALL_POOLS:
        pool.close()


class PoolRegistry:
    """One pool per world size for the whole session; a broken pool is replaced on next use."""

    def __init__(self):
        self._pools = {}

    def __call__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.procs or not pool.alive:
            pool = RankPool(world_size)
            self._pools[world_size] = pool
        return pool

    def close(self):
        for p in self._pools.values():
            p.close()
        self._pools.clear()
