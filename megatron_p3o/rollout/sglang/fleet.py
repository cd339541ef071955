"""Several SGLang servers as one engine: generation through one URL (an sglang-router in front
of them, or the single server), weight pushes sent to the servers directly (slime's
arrangement: the router balances requests; one weight-update group spans every server, so each
bucket is broadcast once for the fleet).

The fleet is either attached (``rollout.sglang.url``, with ``rollout.sglang_workers`` naming the
servers behind a router) or launched (``rollout.sglang.servers`` servers on consecutive ports,
plus a router when there are several); a launched fleet relaunches a server that died, also when
the failure is seen through the router.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

from megatron_p3o.rollout.engine import Bucket, RolloutEngine
from megatron_p3o.rollout.sglang.attach import (
    adopt_layout,
    close_stale_session,
    read_context_length,
)
from megatron_p3o.rollout.sglang.client import SGLangEngine
from megatron_p3o.rollout.sglang.launch import (
    API_KEY_ENV,
    ServerProcess,
    resolve_python,
    router_command,
)
from megatron_p3o.rollout.sglang.launch import server_env as launch_env
from megatron_p3o.rollout.sglang.protocol import distributed_payload, with_last
from megatron_p3o.rollout.sglang.weights import (
    GROUP_JOIN_TIMEOUT_S,
    broadcast,
    group_name,
    host_store,
    race,
    resolve_backend,
    weight_sync_group,
)
from megatron_p3o.runtime.ports import free_port
from megatron_p3o.types import Sample, SamplingParams
from megatron_p3o.weight_sync.ipc import serialize_named_tensors

GROUP_RECORD = "weight_group.json"  # in the log dir: the group the last launch formed
RELEASED_RECORD = "released_memory.json"  # in the log dir: regions a trainer released


@dataclass(frozen=True)
class FleetSettings:
    """How many servers (the part of ``rollout.sglang`` this module reads).

    Attributes:
        servers: servers to launch (ports ``port`` … ``port + servers − 1``); more than one gets
            an sglang-router in front (ignored when attaching with ``url``).
        router_port: the launched router's port (0: a free one).
    """

    servers: int = 1
    router_port: int = 0


class SGLangFleet(RolloutEngine):
    """``router``: the generation engine; ``workers``: one engine per server (may be just the
    router's server itself); ``transport``: "distributed" or "tensor" for :meth:`update_weights`."""

    name = "sglang"

    def __init__(
        self,
        router: SGLangEngine,
        workers: Sequence[SGLangEngine],
        transport: str = "distributed",
        router_process: Optional[ServerProcess] = None,
    ):
        self.router, self.workers, self.transport = router, list(workers), transport
        self.router_process = router_process
        self.weight_version = 0
        self._group = None  # (process group, name, backend) spanning every server
        self.group_record: Optional[Path] = None  # where the group's name is kept (build_fleet)
        self.released_record: Optional[Path] = None  # memory a colocated push released
        self._store = None  # the weight-update group's rendezvous store (rank 0 hosts it)
        if router_process is not None:
            router.process = router_process
            router.concurrency = sum(w.concurrency for w in self.workers)
            router.on_failure = self._recover_workers

    @classmethod
    def solo(cls, engine: SGLangEngine, transport: str = "distributed") -> "SGLangFleet":
        """One server as a fleet of one: its router and its only worker (its weight group lives
        here, as for any fleet)."""
        return cls(engine, [engine], transport)

    def start(self) -> "SGLangFleet":
        """Launch what is to be launched (all at once), then wait for every server. Attached
        servers are taken as they are found: a session a killed trainer left open is closed
        and generation continued before their health is awaited (a paused server never
        passes ``/health``), and their TP size is read from them
        (:mod:`.attach`: ``close_stale_session``, ``adopt_layout``)."""
        attached = [w for w in self.workers if not w.launches]
        try:
            for w in self.workers:
                if w.launches and w.server is None:
                    w.launch()
            released = self._released()  # a trainer killed while the memory was released
            for w in attached:
                close_stale_session(w, released)
            self._record_released([] if attached else released)
            for w in self.workers:
                if w is not self.router:
                    w.wait_healthy(w.cfg.startup_timeout_s)
            if self.router_process is not None:  # the router needs healthy servers
                self.router_process.start()
            self.router.start()
            if self.router_process is not None:
                self._wait_router_ready()
            for w in attached:
                adopt_layout(w, self.transport)
            for w in self.workers:
                read_context_length(w)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_router_ready(self) -> None:
        """Until the router has registered every server (``/readiness``: its /health answers
        before that, and a server busy joining a weight group fails its registration)."""
        want = len(self.workers)
        self.router.wait_healthy(
            self.router.cfg.startup_timeout_s,
            "/readiness",
            ready=lambda r: isinstance(r, dict) and r.get("healthy_workers") == want,
        )

    def stop(self) -> None:
        self._leave_group()
        if self.router_process is not None:
            self.router_process.stop()
        for w in {id(w): w for w in [self.router, *self.workers]}.values():
            w.stop()

    def _leave_group(self) -> None:
        """Servers that outlive this trainer (attached) destroy its weight-update group, so
        that they hold no dead groups (and their NCCL buffers) across restarts; best effort."""
        if self._group is None:
            return
        name = self._group[1]
        self._group = None
        left = [w.leave_weight_group(name) for w in self.workers if not w.launches]
        if all(left) and self.group_record is not None:
            self.group_record.unlink(missing_ok=True)

    def _destroy_recorded_group(self) -> None:
        """A restarted trainer: the group the previous launch formed with these (attached)
        servers, if it did not destroy it itself (a crash), is destroyed first (SGLang 0.5.23's
        ``/destroy_weights_update_group``); a server that no longer holds it says so and the
        launch goes on (the new group has a name of its own anyway)."""
        rec = self.group_record
        if rec is None or not rec.is_file():
            return
        try:
            old = json.loads(rec.read_text())
        except ValueError:
            return
        for w in self.workers:
            if not w.launches and w.url in old.get("workers", []):
                w.leave_weight_group(old.get("group", ""), quiet=False)

    def _record_group(self, name: str) -> None:
        if self.group_record is None:
            return
        self.group_record.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.group_record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"group": name, "workers": [w.url for w in self.workers]}))
        tmp.replace(self.group_record)

    def _recover_workers(self) -> None:
        """A request through the router failed: relaunch (and reload) any server that died."""
        dead = [w for w in self.workers if w.server is not None and not w.server.alive()]
        for w in dead:
            w.relaunch()
        if not dead:
            time.sleep(1.0)

    def health(self) -> dict:
        hs = [w.health() for w in self.workers]
        return {
            "ok": all(h["ok"] for h in hs),
            "weight_version": self.weight_version,
            "workers": hs,
        }

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        keys: Optional[Sequence[str]] = None,
    ) -> List[Sample]:
        return self.router.generate(prompts, n, sampling, keys)

    def generate_turn(self, ids, sampling: SamplingParams, key: Optional[str] = None) -> Sample:
        return self.router.generate_turn(ids, sampling, key)

    @property
    def context_length(self) -> Optional[int]:
        """The shortest context of the servers (None where none reported one)."""
        known = [w.context_length for w in self.workers if w.context_length is not None]
        return min(known) if known else None

    def init_weight_update_groups(self, master_address: str, port: int) -> None:
        """One group spanning every server: {trainer rank 0} ∪ server 0's ranks ∪ server 1's …
        (world 1 + Σ tp_size), so each bucket is broadcast once for the whole fleet. Every
        server's join and the trainer's are one rendezvous: they run concurrently, and the first
        of them to fail (a server refusing the group, the trainer's end) is an error at once, in
        one line (:func:`.weights.race`). The group is named per launch
        (:func:`.weights.group_name`); the one a previous launch left on attached servers is
        destroyed first."""
        from megatron_p3o.rollout.sglang.launch import SGLangSetupError

        world = 1 + sum(w.cfg.tp_size for w in self.workers)
        offsets = [
            1 + sum(w.cfg.tp_size for w in self.workers[:i]) for i in range(len(self.workers))
        ]
        backend = resolve_backend(self.workers[0].cfg)
        name = group_name()
        self._destroy_recorded_group()
        what = f"weight-update group {name} ({backend}, {master_address}:{port}, world {world})"
        try:
            store = host_store(master_address, port, world)
        except (RuntimeError, OSError) as e:  # the port is taken: before any server is asked
            msg = " ".join(str(e).split())
            raise SGLangSetupError(
                f"{what}: the trainer cannot host its rendezvous: {msg} (set "
                "rollout.weight_sync_port to a free port)"
            ) from None
        jobs = [
            (
                f"SGLang {w.label} ({w.url})",
                lambda w=w, off=off: w.join_weight_group(master_address, port, world, off, name),
            )
            for w, off in zip(self.workers, offsets)
        ]
        jobs.append(
            (
                "the trainer's end",
                lambda: weight_sync_group(master_address, port, world, name, backend, store),
            )
        )
        try:
            pg = race(jobs, GROUP_JOIN_TIMEOUT_S, what)[-1]
        except Exception as e:
            raise SGLangSetupError(str(e)) from None
        self._group = (pg, name, backend)
        self._store = store  # the rendezvous store lives as long as the group
        self._record_group(name)

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Every server pauses and opens a session; each bucket (streamed once from the
        trainer) is broadcast once over the fleet's group while every server announces it, or,
        for tensor pushes, serialized once per (server, TP rank) and posted to each server; then
        every server closes and resumes.

        One serialization per destination, as SGLang's own ``Engine`` makes them
        (``_serialize_tensors_per_rank``; each TP rank reads only its own, ``tp_worker.py``
        ``deserialize_own_rank``): torch counts one CUDA-IPC reference per serialization, and
        every process that opens the handles gives one back (``rebuild_cuda_tensor`` in
        ``torch/multiprocessing/reductions.py``). One payload opened by several ranks or servers
        was given back more often than counted, so the trainer's allocator could reuse a
        bucket's memory while a server rank still mapped it. CPU payloads are data, where
        sharing was harmless; they follow the same rule."""
        with self.sessions():
            for bucket, last in with_last(buckets):
                if self.transport == "tensor":
                    for w in self.workers:
                        payloads = [serialize_named_tensors(bucket) for _ in range(w.cfg.tp_size)]
                        w.push_tensors(payloads, version, last)
                else:
                    self._broadcast_bucket(bucket, version, last)
        for w in self.workers:
            w.weight_version = version
        self.weight_version = version

    def _broadcast_bucket(self, bucket: Bucket, version: int, last: bool) -> None:
        if self._group is None or any(w._group is None for w in self.workers):
            raise RuntimeError(
                "a distributed push needs init_weight_update_groups first (a relaunched server "
                "left the group; or use update_weights_from_disk)"
            )
        pg, name, backend = self._group
        body = distributed_payload(bucket, name, version, last)
        with ThreadPoolExecutor(len(self.workers)) as pool:
            futs = [
                pool.submit(w._post_checked, "/update_weights_from_distributed", body)
                for w in self.workers
            ]
            broadcast(pg, [t for _, t in bucket], backend)
            for f in futs:
                f.result()

    @contextmanager
    def sessions(self):
        """A weight-update session on every server (pause → begin … end → continue)."""
        with ExitStack() as stack:
            for w in self.workers:
                stack.enter_context(w.weight_update_session())
            yield self

    def pause_generation(self) -> None:
        for w in self.workers:
            w.pause_generation()

    def begin_weight_update(self) -> None:
        for w in self.workers:
            w.begin_weight_update()

    def end_weight_update(self) -> None:
        for w in self.workers:
            w.end_weight_update()

    def continue_generation(self) -> None:
        for w in self.workers:
            w.continue_generation()

    def push_ipc(self, payloads: Sequence[str], version: int, last: bool) -> None:
        for w in self.workers:
            w.push_tensors(payloads, version, last)

    def release_memory(self) -> None:
        from megatron_p3o.rollout.sglang.protocol import MEMORY_TAGS

        self._record_released(MEMORY_TAGS)  # before: a kill in between leaves it recorded
        for w in self.workers:
            w.release_memory()

    def resume_memory(self, tags: Sequence[str]) -> None:
        for w in self.workers:
            w.resume_memory(tags)
        self._record_released([t for t in self._released() if t not in tags])

    def _released(self) -> List[str]:
        """The memory regions the record says are released (SGLang 0.5.23 reports none of its
        own: ``offload_tags`` lives in the scheduler, and resuming a region that is not
        released fails there)."""
        rec = self.released_record
        if rec is None or not rec.is_file():
            return []
        try:
            return list(json.loads(rec.read_text()).get("tags", []))
        except ValueError:
            return []

    def _record_released(self, tags: Sequence[str]) -> None:
        rec = self.released_record
        if rec is None:
            return
        if not tags:
            rec.unlink(missing_ok=True)
            return
        rec.parent.mkdir(parents=True, exist_ok=True)
        tmp = rec.with_suffix(".tmp")
        tmp.write_text(json.dumps({"tags": list(tags), "workers": [w.url for w in self.workers]}))
        tmp.replace(rec)

    def update_weights_from_disk(self, model_path: str, version: int) -> None:
        for w in self.workers:
            w.update_weights_from_disk(model_path, version)
        self.weight_version = version


def build_fleet(cfg, worker_urls: Sequence[str], log_dir, transport: str) -> SGLangFleet:
    """The fleet ``cfg`` describes (not started): attached to ``cfg.url`` (and the servers in
    ``worker_urls`` behind it), or ``cfg.servers`` launched servers with a router when > 1."""
    log_dir = Path(log_dir)
    if cfg.url is not None:
        router = SGLangEngine(cfg, log_dir=log_dir)
        workers = [SGLangEngine(replace(cfg, url=u), label=f"worker{i}", log_dir=log_dir)
                   for i, u in enumerate(worker_urls)]  # fmt: skip
        fleet = SGLangFleet(router, workers or [router], transport)
        fleet.group_record = log_dir / GROUP_RECORD  # attached servers outlive this launch
        fleet.released_record = log_dir / RELEASED_RECORD
        return fleet
    servers = [SGLangEngine(cfg, port=cfg.port + i, label=f"server{i}", log_dir=log_dir)
               for i in range(cfg.servers)]  # fmt: skip
    if cfg.servers == 1:
        return SGLangFleet(servers[0], servers, transport)
    port = cfg.router_port or free_port(cfg.host)
    key = os.environ.get(API_KEY_ENV)
    proc = ServerProcess(
        router_command(
            resolve_python(cfg), cfg.host, port, [s.url for s in servers], sticky=cfg.sticky_routing
        ),  # fmt: skip
        launch_env(),
        log_dir / "router.log",
        secrets=[key] if key else [],
    )
    router = SGLangEngine(replace(cfg, url=f"http://{cfg.host}:{port}"), label="router")
    return SGLangFleet(router, servers, transport, proc)
