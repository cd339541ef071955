"""One SGLang server (or a router) over HTTP: health, generation, weight-update sessions, and
recovery of a launched server that died.

Pushes follow SGLang 0.5.23's rules: ``/pause_generation`` (retract: in-flight requests wait and
resume under the new weights, their tokens labelled per version) → ``/begin_weight_update`` →
every bucket (cache flush and ``weight_version`` on the last one only) → ``/end_weight_update``
(fp8 servers re-quantize here) → ``/continue_generation``. A launched server that died is
relaunched (at most ``max_restarts`` times, one relaunch however many requests saw it die) and
reloaded from the last disk push; after a push that came over a process group or as tensors it
cannot be reloaded from here, and the run stops with a clear error: samples are never tagged with
a version the server does not hold.

A server the trainer attaches to (``rollout.sglang.url``, ``rollout.sglang_workers``) is taken
as it is found: a weight-update session a killed trainer left open is closed and generation
continued, and its tensor-parallel size comes from the server (``GET /server_info``), not the
recipe (:mod:`.attach`). Answers are
any JSON (SGLang answers the memory routes with ``null``); only a ``success: false`` object is a
failure.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from megatron_p3o.rollout.engine import RolloutEngine
from megatron_p3o.rollout.sglang.launch import (
    API_KEY_ENV,
    ServerProcess,
    cpu_stub_dir,
    launch_command,
    resolve_device,
    resolve_python,
    server_env,
)
from megatron_p3o.rollout.sglang.protocol import (
    ROUTING_KEY_HEADER,
    EngineResponseError,
    EngineUnavailableError,
    batch_payload,
    disk_payload,
    generate_payload,
    init_group_payload,
    parse_generate_response,
    release_payload,
    request_chunks,
    resume_payload,
    tensor_payload,
)
from megatron_p3o.rollout.sglang.weights import resolve_backend
from megatron_p3o.types import Sample, SamplingParams

_NET_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError, OSError)
REFUSED_GRACE_S = 5.0  # an attached URL refusing connections this long: nothing listens there
NOTE_EVERY_S = 20.0  # a "still waiting" line this often while a server starts
STALE_CALL_S = 20.0  # an attached server's answer to the stale-session calls


def unreachable(e: BaseException) -> Optional[str]:
    """Why nothing can answer at the URL (refused, unknown host, no route), or None for an
    error a starting server gives too (a timeout, HTTP 503 until it is ready)."""
    if isinstance(e, urllib.error.HTTPError):
        return None
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, socket.gaierror):
        return f"unknown host: {reason.strerror}"
    if isinstance(reason, OSError) and reason.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "no route to host"
    return None


@dataclass(frozen=True)
class ClientSettings:
    """How the trainer talks to a server (the part of ``rollout.sglang`` this module reads).

    Attributes:
        url: attach to a running server or sglang router (no launch) when set.
        request_timeout_s: per HTTP request.
        max_concurrency: concurrent /generate requests per server (a router gets this many
            times its servers).
        request_batch: completions per /generate request (SGLang's batch form: lists of
            ``input_ids`` and ``sampling_params``, answered in order). 1 sends one request per
            completion, as a router balancing requests across servers expects; more cuts the
            HTTP and scheduling cost per completion when completions are short
            (``benchmarks/bench_sglang_requests.py``).
        max_retries: retries of one request after a connection failure.
        max_restarts: relaunches of a launched server that died (then a clear error).
        sticky_routing: a router the trainer launches runs sglang-router's ``manual`` policy:
            requests that carry one routing key (header ``x-smg-routing-key``) go to one server.
            Multi-turn rollouts set it and key every turn of a trajectory by its prompt, so each
            turn reaches the server that holds its prefix in its cache (an attached router must
            run that policy itself).
    """

    url: Optional[str] = None
    request_timeout_s: float = 600.0
    max_concurrency: int = 256
    request_batch: int = 1
    max_retries: int = 3
    max_restarts: int = 2
    sticky_routing: bool = False


class SGLangEngine(RolloutEngine):
    """A server at ``cfg.url``, or one this engine launches at ``port`` (logs in ``log_dir``)."""

    name = "sglang"

    def __init__(self, cfg, port: Optional[int] = None, label: str = "server0", log_dir=None):
        self.cfg, self.label = cfg, label
        self.port = cfg.port if port is None else port
        self.url = (cfg.url or f"http://{cfg.host}:{self.port}").rstrip("/")
        self.log_dir = Path(log_dir or cfg.log_dir or ".")
        self.server: Optional[ServerProcess] = None  # launched by this engine
        self.process: Optional[ServerProcess] = None  # whose liveness wait_healthy watches
        self.concurrency = cfg.max_concurrency
        self.request_batch = cfg.request_batch
        self.restarts = 0
        self.weight_version = 0
        self._group = None  # the weight-update group this server joined (its name)
        self._last_disk: Optional[Tuple[str, int]] = None  # (path, version) of the last disk push
        self._lock = threading.Lock()  # one recovery at a time
        self._epoch = 0  # bumped by each recovery: requests that failed before it just retry
        self.on_failure: Optional[Callable[[], None]] = None  # a router's: recover its servers
        self.context_length: Optional[int] = None  # read_context_length

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def launches(self) -> bool:
        return self.cfg.url is None

    def start(self) -> "SGLangEngine":
        if self.launches and self.server is None:
            self.launch()
        self.wait_healthy(self.cfg.startup_timeout_s)
        return self

    def launch(self) -> None:
        """Start the server process (returns at once; :meth:`wait_healthy` waits)."""
        python = resolve_python(self.cfg)
        cpu = cpu_stub_dir(python) if resolve_device(self.cfg) == "cpu" else None
        key = os.environ.get(API_KEY_ENV)
        self.server = ServerProcess(
            launch_command(self.cfg, self.port, python),
            server_env(gpus=self.cfg.gpus, cpu_libdir=cpu, ld_preload=self.cfg.ld_preload),
            self.log_dir / f"{self.label}.log",
            secrets=[key] if key else [],
        ).start(config={"api-key": key} if key else None)
        self.process = self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.server = self.process = None

    def wait_healthy(
        self, timeout_s: float, path: str = "/health", ready=None, any_status: bool = False
    ) -> int:
        """Until ``path`` answers 200 (and ``ready(response)`` holds, when given), or, with
        ``any_status``, answers at all; returns the HTTP status. Fails at once if the watched
        process exits, naming its last log lines. An attached server (no process of ours) that
        refuses the connection for :data:`REFUSED_GRACE_S` is an error naming the URL: the user
        said it runs, and waiting the whole ``startup_timeout_s`` (15 min by default) in silence
        looked like a hang. Meanwhile a note every :data:`NOTE_EVERY_S` says what is awaited
        and for how long (rank 0)."""
        start = time.monotonic()
        deadline, note_at = start + timeout_s, start + NOTE_EVERY_S
        last, refused_since = None, None
        while time.monotonic() < deadline:
            p = self.process
            if p is not None and not p.alive():
                raise EngineUnavailableError(
                    f"SGLang {self.label} exited with code {p.returncode} during start-up "
                    f"({p.printable}); last log lines: {p.tail()}"
                )
            try:
                last = self._request("GET", path, None, timeout=5)
                if ready is None or ready(last):
                    if p is not None:
                        p.forget_config()
                    return 200
                refused_since = None
            except _NET_ERRORS as e:  # not up yet (or 503 until ready)
                if any_status and isinstance(e, urllib.error.HTTPError):
                    return e.code
                last = e
                why = unreachable(e) if p is None else None
                refused_since = (refused_since or time.monotonic()) if why else None
                if why and time.monotonic() - refused_since >= REFUSED_GRACE_S:
                    raise EngineUnavailableError(self._unreachable_message(why)) from None
            if time.monotonic() >= note_at:
                note_at += NOTE_EVERY_S
                self._note_waiting(path, time.monotonic() - start, timeout_s, last)
            time.sleep(0.5)
        tail = f"; last log lines: {self.process.tail()}" if self.process is not None else ""
        raise EngineUnavailableError(
            f"SGLang {self.label} at {self.url} not healthy ({path}) after {timeout_s:.0f}s: "
            f"{last}{tail}"
        )

    def _unreachable_message(self, why: str) -> str:
        key = "rollout.sglang_workers" if self.label.startswith("worker") else "rollout.sglang.url"
        return (
            f"SGLang {self.label}: nothing answers at {self.url} ({why} for "
            f"{REFUSED_GRACE_S:.0f}s): start the server first, or fix {key} (unset "
            "rollout.sglang.url to let the trainer launch one)"
        )

    def _note_waiting(self, path: str, waited: float, timeout_s: float, last) -> None:
        """One line on rank 0: what is awaited, for how long so far, where its log is."""
        if os.environ.get("RANK", "0") != "0":
            return
        log = f"; log {self.process.log_path}" if self.process is not None else ""
        why = f"HTTP {last.code}" if isinstance(last, urllib.error.HTTPError) else last
        why = f"; last answer: {why}" if isinstance(last, BaseException) else ""
        print(
            f"waiting for SGLang {self.label} at {self.url}{path}: {waited:.0f}s of "
            f"{timeout_s:.0f}s (rollout.sglang.startup_timeout_s){log}{why}",
            flush=True,
        )

    def health(self) -> dict:
        try:
            self._request("GET", "/health", None, timeout=5)
            ok = True
        except _NET_ERRORS:
            ok = False
        return {
            "ok": ok,
            "weight_version": self.weight_version,
            "url": self.url,
            "restarts": self.restarts,
        }

    def served_version(self) -> str:
        """The ``weight_version`` the server itself reports (``/model_info``)."""
        info = self._request("GET", "/model_info", None, timeout=30)
        if not isinstance(info, dict) or "weight_version" not in info:
            raise EngineResponseError(
                f"SGLang {self.label} at {self.url}: /model_info has no weight_version: "
                f"{str(info)[:200]}"
            )
        return str(info["weight_version"])

    def _get(self, path: str):
        """``(HTTP status, answer)`` of ``GET path``; no answer at all is an error."""
        try:
            return 200, self._request("GET", path, None, timeout=30)
        except urllib.error.HTTPError as e:
            return e.code, None
        except _NET_ERRORS as e:
            raise EngineUnavailableError(
                f"SGLang {self.label} at {self.url}: GET {path} failed: {e}"
            ) from None

    def _notice(self, message: str) -> None:
        print(f"SGLang {self.label} at {self.url}: {message}", file=sys.stderr, flush=True)

    # -- HTTP ---------------------------------------------------------------------------------
    def _request(
        self,
        method: str,
        path: str,
        body: Optional[dict],
        timeout: Optional[float] = None,
        key: Optional[str] = None,
    ):
        """The answer's JSON, whatever it is (an object, a list, ``null``: SGLang's memory routes
        return nothing); ``{}`` for an empty body, ``{"text": …}`` for one that is not JSON."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if os.environ.get(API_KEY_ENV):
            headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
        if key is not None:  # sglang-router's manual policy: one key, one server
            headers[ROUTING_KEY_HEADER] = key
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout or self.cfg.request_timeout_s) as r:
            raw = r.read()
        try:
            return json.loads(raw) if raw else {}
        except ValueError:  # the router answers /health in plain text
            return {"text": raw.decode(errors="replace")}

    def _post_with_recovery(self, path: str, body: dict, key: Optional[str] = None):
        """POST; on a connection failure recover (relaunch a dead launched server) and retry."""
        err = None
        for _ in range(self.cfg.max_retries + 1):
            epoch = self._epoch
            try:
                return self._request("POST", path, body, key=key)
            except urllib.error.HTTPError as e:  # the server answered: not a liveness problem
                detail = e.read().decode(errors="replace")[:500]
                raise EngineResponseError(
                    f"SGLang {self.label} {path} returned HTTP {e.code}: {detail}"
                ) from None
            except _NET_ERRORS as e:
                err = e
                self._recover(epoch)
        raise EngineUnavailableError(
            f"SGLang {self.label} at {self.url} did not answer {path} after "
            f"{self.cfg.max_retries + 1} attempts: {err}"
        )

    def _recover(self, failed_epoch: int) -> None:
        with self._lock:
            if self._epoch != failed_epoch:
                return  # another request's recovery came after this one's failure: retry
            if self.on_failure is not None:
                self.on_failure()
            elif self.server is not None and not self.server.alive():
                self.relaunch()
            else:
                time.sleep(1.0)
            self._epoch += 1

    def relaunch(self) -> None:
        """A launched server died: start it again (bounded) and give it the trainer's weights."""
        if self.restarts >= self.cfg.max_restarts:
            raise EngineUnavailableError(
                f"SGLang {self.label} died (exit {self.server.returncode}) and was restarted "
                f"{self.restarts} times already (max_restarts={self.cfg.max_restarts}); last log "
                f"lines: {self.server.tail()}"
            )
        print(
            f"SGLang {self.label} died (exit {self.server.returncode}); relaunching",
            file=sys.stderr,
            flush=True,
        )
        self.restarts += 1
        self.server.stop()
        self.launch()
        self.wait_healthy(self.cfg.startup_timeout_s)
        self._restore_weights()

    def _restore_weights(self) -> None:
        """A relaunched server holds the base weights of ``model_path``: reload the trainer's
        last weights from the last disk push, or stop — never serve them as the current ones."""
        if self._last_disk is not None:
            path, version = self._last_disk
            self._post_checked("/update_weights_from_disk", disk_payload(path, version))
            return
        self._group = None  # the server's end of the group died with it
        if self.weight_version > 0:
            raise EngineUnavailableError(
                f"SGLang {self.label} at {self.url} died and was restarted with the base "
                f"weights; the trainer's weights (version {self.weight_version}) came over a "
                "process group or as tensors and cannot be replayed from here. Restart the job: "
                "it resumes from its last checkpoint (or use rollout.weight_sync=disk, which a "
                "restarted server reloads)"
            )

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        keys: Optional[Sequence[str]] = None,
    ) -> List[Sample]:
        if n < 1:
            raise ValueError(f"generate: n={n} must be >= 1")
        jobs = [
            (g, list(p), None if sampling.seed is None else sampling.seed * 1_000_003 + g * n + j,
             None if keys is None else keys[g])
            for g, p in enumerate(prompts)
            for j in range(n)
        ]  # fmt: skip
        from rich.progress import Progress

        shape = self.cfg.routed_experts
        per = self.request_batch  # >= 1 (TrainConfig.validate)
        chunks = request_chunks(jobs, per)

        def one(chunk):
            bodies = [
                generate_payload(p, sampling, seed, routed_experts=shape is not None)
                for _, p, seed, _ in chunk
            ]
            key = chunk[0][3]
            if len(chunk) == 1:
                resps = [self._post_with_recovery("/generate", bodies[0], key)]
            else:
                resps = self._post_with_recovery("/generate", batch_payload(bodies), key)
                if not isinstance(resps, list) or len(resps) != len(chunk):
                    raise EngineResponseError(
                        f"SGLang {self.label}: a batch of {len(chunk)} /generate requests got "
                        f"{len(resps) if isinstance(resps, list) else type(resps).__name__} "
                        "answers"
                    )
            return [
                parse_generate_response(r, p, g, routed_experts=shape)
                for r, (g, p, _, _) in zip(resps, chunk)
            ]

        out: List[Sample] = []
        with (
            ThreadPoolExecutor(max(1, min(self.concurrency, len(chunks)))) as pool,
            Progress(transient=True, disable=not sys.stderr.isatty()) as bar,
        ):
            task = bar.add_task(f"rollout (sglang {self.label})", total=len(jobs))
            for samples in pool.map(one, chunks):
                out.extend(samples)
                bar.advance(task, len(samples))
        return out

    def generate_turn(self, ids, sampling: SamplingParams, key: Optional[str] = None) -> Sample:
        """One ``/generate`` per multi-turn turn (the server batches concurrent turns); an
        aborted request is a sample with ``finish_reason`` "abort", not an error."""
        shape = self.cfg.routed_experts
        body = generate_payload(ids, sampling, sampling.seed, routed_experts=shape is not None)
        resp = self._post_with_recovery("/generate", body, key)
        return parse_generate_response(resp, ids, 0, routed_experts=shape, allow_abort=True)

    # -- weights ------------------------------------------------------------------------------
    def _post_checked(self, path: str, body: dict):
        """POST and refuse ``success: false`` (SGLang answers weight routes that way); any
        other answer is success (``/release_memory_occupation`` answers ``null``)."""
        resp = self._post_with_recovery(path, body)
        if isinstance(resp, dict) and resp.get("success", True) is False:
            raise EngineResponseError(f"SGLang {self.label} {path} failed: {resp.get('message')}")
        return resp

    def pause_generation(self) -> None:
        """Retract: in-flight requests wait, and resume under the new weights."""
        self._post_checked("/pause_generation", {"mode": "retract"})

    def begin_weight_update(self) -> None:
        self._post_checked("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._post_checked("/end_weight_update", {})

    def continue_generation(self) -> None:
        self._post_checked("/continue_generation", {})

    @contextmanager
    def weight_update_session(self):
        """pause (retract) → begin → … → end → continue, for pushes of new weights."""
        self.pause_generation()
        try:
            self.begin_weight_update()
            try:
                yield self
            finally:
                self.end_weight_update()
        finally:
            self.continue_generation()

    def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Inside a session like every push: with requests in flight (async rollouts) SGLang
        cannot flush its cache and answers 400, unless they are retracted first."""
        with self.weight_update_session():
            self._post_checked("/update_weights_from_disk", disk_payload(model_path, version))
        self.weight_version = version
        self._last_disk = (model_path, version)

    def join_weight_group(
        self, master_address: str, master_port: int, world: int, rank_offset: int, name: str
    ) -> None:
        """Ask the server to join the weight-update group ``name`` as ranks ``rank_offset`` …
        ``rank_offset + tp_size − 1`` (blocks until every member joined: call it concurrently
        with the trainer's end, :func:`.weights.weight_sync_group`)."""
        body = init_group_payload(
            master_address, master_port, world, name, resolve_backend(self.cfg), rank_offset
        )
        self._post_checked("/init_weights_update_group", body)
        self._group = name

    def leave_weight_group(self, name: str, quiet: bool = True) -> bool:
        """``/destroy_weights_update_group`` (SGLang 0.5.23): the server drops the group
        ``name`` (best effort: never raises; True when the server no longer holds it)."""
        body = {"group_name": name}
        try:
            resp = self._request("POST", "/destroy_weights_update_group", body, timeout=30)
            resp = resp if isinstance(resp, dict) else {}
            ok, msg = resp.get("success", True) is not False, resp.get("message", "")
        except urllib.error.HTTPError as e:  # 400: "The group to be destroyed does not exist."
            ok, msg = False, e.read().decode(errors="replace")[:300]
        except _NET_ERRORS as e:
            ok, msg = False, str(e)
        if self._group == name:
            self._group = None
        if not quiet:
            print(
                f"SGLang {self.label}: weight-update group {name} of a previous launch: "
                f"{'destroyed' if ok else 'not destroyed'} ({' '.join(str(msg).split())})",
                file=sys.stderr,
                flush=True,
            )
        return ok or "does not exist" in str(msg)

    def update_weights(self, buckets, version: int) -> None:
        """A server's client holds no weight-update group: pushes go through
        :class:`~megatron_p3o.rollout.sglang.fleet.SGLangFleet` (``SGLangFleet.solo(engine)``
        for one server), which owns the group spanning its servers."""
        raise TypeError(
            f"{self.label}: SGLangEngine is one server's HTTP client; push weights through "
            "SGLangFleet (SGLangFleet.solo(engine) for a single server)"
        )

    def push_tensors(self, payloads: Sequence[str], version: int, last: bool) -> None:
        """One bucket as serialized tensors inside a session: payload r for server TP rank r."""
        if len(payloads) != self.cfg.tp_size:
            raise ValueError(
                f"{len(payloads)} tensor payloads for a server of tp_size {self.cfg.tp_size}"
            )
        self._post_checked("/update_weights_from_tensor", tensor_payload(payloads, version, last))

    def release_memory(self) -> None:
        """Colocated: free every memory region of the server (weights, KV cache, CUDA graphs:
        :data:`.protocol.MEMORY_TAGS`) for the trainer's update."""
        self._post_checked("/release_memory_occupation", release_payload())

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Colocated: take back ``tags`` (:data:`.protocol.RESUME_BEFORE_PUSH`, then
        :data:`.protocol.RESUME_AFTER_PUSH` once the weights are loaded)."""
        self._post_checked("/resume_memory_occupation", resume_payload(tags))
