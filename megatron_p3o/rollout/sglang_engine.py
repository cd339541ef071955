"""SGLang rollout engine: launch or attach to a server (or router), generate with behaviour
log-probs, and push weights: NCCL broadcast (``update_weights``), CUDA IPC when colocated
(``push_ipc``, payloads built by every colocated trainer rank) or a checkpoint on disk
(``update_weights_from_disk``).

Request and response fields follow SGLang's own server code (0.5.x, read from its wheel):
``POST /generate`` with ``input_ids``, ``sampling_params`` and ``return_logprob``; the response's
``meta_info.output_token_logprobs`` is a list of ``[logprob, token_id, text]`` and
``meta_info.finish_reason`` a dict with ``type`` ("stop" | "length" | "abort"). SGLang's
log-probs are log_softmax(logits / T) over the full vocabulary (not truncated by top-p/top-k) —
unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set, which a launched server never has.

Weight pushes follow SGLang 0.5.23's rules (``tests/unit/test_sglang_protocol.py`` checks every
route and field against that release's own source): per server, ``/pause_generation`` (retract:
in-flight requests wait, nothing samples a half-updated model) → ``/begin_weight_update`` → every
bucket (cache flush and ``weight_version`` on the last one only) → ``/end_weight_update`` (fp8
servers re-quantize here) → ``/continue_generation``. A server restarted by this client has lost
the trainer's weights: it is reloaded from the last disk push, or the run stops with a clear
error — samples are never tagged with a version the server does not hold.

Servers launched from a torchrun worker get an environment without torchrun's variables
(``TORCHELASTIC_USE_AGENT_STORE``, ``RANK``, ``MASTER_PORT``…: with them SGLang's own process
group never forms). Every request carries ``Authorization: Bearer $P3O_SGLANG_API_KEY`` when that
variable is set (the batch script makes one secret per job); the key is never in the recipe.

Everything that needs a GPU (launching, NCCL weight sync) is exercised by the tests marked
``sglang``; request building, response parsing, concurrency, retries, the session order and the
dead-server error are tested on CPU against loopback stand-in servers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from ..errors import UserError
from ..types import Sample, SamplingParams
from .engine import Bucket, RolloutEngine


class EngineUnavailableError(UserError, RuntimeError):
    """The SGLang server does not answer (after the configured restarts and retries)."""


class EngineResponseError(UserError, ValueError):
    """A response that cannot be a valid sample (aborted, non-finite log-probs, length mismatch)."""


API_KEY_ENV = "P3O_SGLANG_API_KEY"  # the per-job secret of servers and router (never in a recipe)

# what torchrun puts in a worker's environment; a server launched from a worker must not see it
_TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)  # fmt: skip


def server_env(base: Optional[dict] = None, gpus: Optional[str] = None) -> dict:
    """The environment of a launched server: the caller's without torchrun's variables, with
    ``SGLANG_RETURN_ORIGINAL_LOGPROB=false`` (ℓb at the sampling temperature) and the GPUs."""
    env = {k: v for k, v in (os.environ if base is None else base).items()}
    for k in _TORCHRUN_ENV:
        env.pop(k, None)
    for k in [k for k in env if k.startswith("TORCHELASTIC_")]:
        env.pop(k)
    env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


@dataclass(frozen=True)
class SGLangConfig:
    """Attributes:
    url: attach to a running server or sglang router (no launch) when set.
    model_path: HF directory the launched server loads.
    dtype: serving dtype ("bfloat16", "float16", "auto").
    quantization: e.g. "fp8" (weights) or None.
    kv_cache_dtype: "fp8_e4m3" or None (= model dtype); "fp8_e5m2" is refused (it forces the
            triton attention backend).
    mem_fraction_static: GPU memory fraction for weights + KV cache.
    tp_size: tensor parallel size of the server.
    host / port: where a launched server listens.
    gpus: CUDA_VISIBLE_DEVICES for the launched server (e.g. "4,5,6,7").
    startup_timeout_s: wait for /health after launch.
    request_timeout_s: per HTTP request.
    max_concurrency: concurrent /generate requests.
    max_restarts: restarts of a launched server that died (then a clear error).
    max_retries: retries of one request after a connection failure.
    deterministic: ``--enable-deterministic-inference`` (also set by ``rollout.deterministic``).
    routed_experts: ``(layers, top-k)`` of an MoE model: launch with
        ``--enable-return-routed-experts``, send ``return_routed_experts`` and decode
        ``meta_info.routed_experts`` (base64 int32, ``[P + C − 1, layers, k]`` in SGLang 0.5.23)
        into ``Sample.routed_experts``; set by the backend for MoE models. GPU-unverified.
    extra_args: more ``sglang.launch_server`` arguments.
    """

    url: Optional[str] = None
    model_path: str = ""
    dtype: str = "bfloat16"
    quantization: Optional[str] = None
    kv_cache_dtype: Optional[str] = None
    mem_fraction_static: float = 0.8
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    gpus: Optional[str] = None
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    max_concurrency: int = 64
    max_restarts: int = 2
    max_retries: int = 3
    deterministic: bool = False
    routed_experts: Optional[Tuple[int, int]] = None
    extra_args: Tuple[str, ...] = field(default_factory=tuple)


def server_args(cfg: SGLangConfig) -> List[str]:
    """The serving arguments (dtype, memory, quantization, KV-cache dtype, extras) — the part of
    the command a cluster script shares between servers that differ in GPUs and port."""
    args = ["--dtype", cfg.dtype, "--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.quantization:
        args += ["--quantization", cfg.quantization]
    if cfg.kv_cache_dtype:
        args += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    if cfg.deterministic:
        args += ["--enable-deterministic-inference"]
    if cfg.routed_experts:
        args += ["--enable-return-routed-experts"]
    return args + list(cfg.extra_args)


def launch_command(cfg: SGLangConfig) -> List[str]:
    """``python -m sglang.launch_server ...`` for ``cfg``."""
    if not cfg.model_path:
        raise ValueError("rollout.sglang.model_path is required to launch a server (or set url)")
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        cfg.model_path,
        "--tp-size",
        str(cfg.tp_size),
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--skip-tokenizer-init",
        *server_args(cfg),
    ]  # _launch adds --api-key (kept out of this printable command)


def generate_payload(
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    seed: Optional[int],
    routed_experts: bool = False,
) -> dict:
    """The ``/generate`` body for one completion of one prompt (with ``routed_experts``: the
    experts of every token from the first prompt token on, ``routed_experts_start_len`` 0)."""
    sp = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_new_tokens": sampling.max_new_tokens,
    }
    if sampling.top_k > 0:
        sp["top_k"] = sampling.top_k
    if sampling.stop_token_ids:
        sp["stop_token_ids"] = list(sampling.stop_token_ids)
    if seed is not None:
        sp["sampling_seed"] = int(seed)
    body = {
        "input_ids": list(map(int, prompt_ids)),
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": -1,  # output tokens only
    }
    if routed_experts:
        body.update(return_routed_experts=True, routed_experts_start_len=0)
    return body


def decode_routed_experts(meta: dict, n_tokens: int, shape: Tuple[int, int], rid) -> torch.Tensor:
    """``meta_info.routed_experts`` (base64 of int32) → ``[n_tokens, layers, k]`` int16."""
    import base64

    import numpy as np

    raw = meta.get("routed_experts")
    if raw is None:
        raise EngineResponseError(
            f"SGLang request {rid}: no meta_info.routed_experts (is the server launched with "
            "--enable-return-routed-experts?)"
        )
    a = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    layers, k = shape
    if a.size != n_tokens * layers * k:
        raise EngineResponseError(
            f"SGLang request {rid}: routed_experts holds {a.size} values, expected "
            f"{n_tokens} tokens × {layers} layers × top-{k}"
        )
    return torch.from_numpy(a.reshape(n_tokens, layers, k).astype(np.int16))


def parse_generate_response(
    resp: dict,
    prompt_ids: Sequence[int],
    group_id: int,
    fallback_version: Optional[int] = None,
    routed_experts: Optional[Tuple[int, int]] = None,
) -> Sample:
    """One SGLang ``/generate`` response → :class:`Sample` (refuses aborted / non-finite ones);
    ``routed_experts`` = (layers, k) decodes the recorded experts (MoE)."""
    meta = resp.get("meta_info") or {}
    rid = meta.get("id", "?")
    fin = meta.get("finish_reason")
    kind = fin.get("type") if isinstance(fin, dict) else fin
    if kind not in ("stop", "length"):
        raise EngineResponseError(
            f"SGLang request {rid} (prompt group {group_id}) finished with "
            f"{fin!r}; expected stop or length"
        )
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise EngineResponseError(
            f"SGLang request {rid}: no output_token_logprobs (was return_logprob sent?)"
        )
    logprobs = [float(t[0]) if t[0] is not None else math.nan for t in triples]
    ids = [int(t[1]) for t in triples]
    out_ids = resp.get("output_ids")
    if out_ids is not None and list(out_ids) != ids:
        raise EngineResponseError(
            f"SGLang request {rid}: output_ids and output_token_logprobs "
            f"disagree ({len(out_ids)} vs {len(ids)} tokens)"
        )
    bad = [i for i, x in enumerate(logprobs) if not math.isfinite(x)]
    if bad:
        raise EngineResponseError(
            f"SGLang request {rid} (prompt group {group_id}): non-finite "
            f"behaviour log-prob at completion token {bad[0]}"
        )
    version = meta.get("weight_version", fallback_version)
    try:
        version = int(version)
    except (TypeError, ValueError):
        # "default": a server that never received the trainer's weights (or a restarted one)
        raise EngineResponseError(
            f"SGLang request {rid}: the server reports weight_version {version!r}, not a version "
            "the trainer pushed; its samples cannot be attributed to a policy"
        ) from None
    routes = None
    if routed_experts is not None and ids:
        routes = decode_routed_experts(meta, len(prompt_ids) + len(ids) - 1, routed_experts, rid)
    return Sample(
        prompt_ids=list(prompt_ids),
        completion_ids=ids,
        logprobs=logprobs,
        finish_reason=kind,
        weight_version=version,
        group_id=group_id,
        meta={"rid": rid},
        routed_experts=routes,
    )


class SGLangEngine(RolloutEngine):
    name = "sglang"

    def __init__(self, cfg: SGLangConfig):
        self.cfg = cfg
        self.url = (cfg.url or f"http://{cfg.host}:{cfg.port}").rstrip("/")
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0
        self.weight_version = 0
        self._nccl = None  # (process group, group name) for update_weights_from_distributed
        self._last_disk: Optional[Tuple[str, int]] = None  # (path, version) of the last disk push

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "SGLangEngine":
        if self.cfg.url is None:
            self._launch()
        self.wait_healthy(self.cfg.startup_timeout_s)
        return self

    def _launch(self) -> None:
        cmd = launch_command(self.cfg)
        if os.environ.get(API_KEY_ENV):
            cmd += ["--api-key", os.environ[API_KEY_ENV]]
        self.proc = subprocess.Popen(cmd, env=server_env(gpus=self.cfg.gpus))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EngineUnavailableError(
                    f"SGLang server exited with code {self.proc.returncode} "
                    f"during start-up ({' '.join(launch_command(self.cfg))})"
                )
            try:
                self._request("GET", "/health", None, timeout=5)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                last = e
                time.sleep(0.5)
        raise EngineUnavailableError(
            f"SGLang server at {self.url} not healthy after {timeout_s:.0f}s: {last}"
        )

    def health(self) -> dict:
        try:
            self._request("GET", "/health", None, timeout=5)
            ok = True
        except (urllib.error.URLError, ConnectionError, OSError):
            ok = False
        return {
            "ok": ok,
            "weight_version": self.weight_version,
            "url": self.url,
            "restarts": self.restarts,
        }

    # -- HTTP ---------------------------------------------------------------------------------
    def _request(
        self, method: str, path: str, body: Optional[dict], timeout: Optional[float] = None
    ):
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if os.environ.get(API_KEY_ENV):
            headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout or self.cfg.request_timeout_s) as r:
            raw = r.read()
        return json.loads(raw) if raw else {}

    def _post_with_recovery(self, path: str, body: dict):
        """POST; on a connection failure restart a dead launched server (bounded) and retry."""
        err = None
        for _ in range(self.cfg.max_retries + 1):
            try:
                return self._request("POST", path, body)
            except urllib.error.HTTPError as e:  # the server answered: not a liveness problem
                detail = e.read().decode(errors="replace")[:500]
                raise EngineResponseError(
                    f"SGLang {path} returned HTTP {e.code}: {detail}"
                ) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                err = e
                self._recover()
        raise EngineUnavailableError(
            f"SGLang server at {self.url} did not answer {path} after "
            f"{self.cfg.max_retries + 1} attempts: {err}"
        )

    def _recover(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            if self.restarts >= self.cfg.max_restarts:
                raise EngineUnavailableError(
                    f"SGLang server died (exit {self.proc.returncode}) and was restarted "
                    f"{self.restarts} times already (max_restarts={self.cfg.max_restarts})"
                )
            self.restarts += 1
            self._launch()
            self.wait_healthy(self.cfg.startup_timeout_s)
            self._restore_weights()
        else:
            time.sleep(1.0)

    def _restore_weights(self) -> None:
        """A relaunched server holds the base weights of ``model_path``: reload the trainer's
        last weights from the last disk push, or stop — never serve them as the current ones."""
        if self._last_disk is not None:
            path, version = self._last_disk
            self._post_checked("/update_weights_from_disk", disk_payload(path, version))
            return
        if self._nccl is not None or self.weight_version > 0:
            raise EngineUnavailableError(
                f"SGLang server at {self.url} died and was restarted with the base weights; the "
                f"trainer's weights (version {self.weight_version}) came over NCCL/IPC and cannot "
                "be replayed from here. Restart the job: it resumes from its last checkpoint "
                "(or use rollout.weight_sync=disk, which a restarted server reloads)"
            )

    # -- generation ---------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> List[Sample]:
        if n < 1:
            raise ValueError(f"generate: n={n} must be >= 1")
        jobs = [
            (g, list(p), None if sampling.seed is None else sampling.seed * 1_000_003 + g * n + j)
            for g, p in enumerate(prompts)
            for j in range(n)
        ]
        from rich.progress import Progress

        def one(job):
            g, p, seed = job
            shape = self.cfg.routed_experts
            body = generate_payload(p, sampling, seed, routed_experts=shape is not None)
            resp = self._post_with_recovery("/generate", body)
            return parse_generate_response(resp, p, g, routed_experts=shape)

        out: List[Sample] = []
        with (
            ThreadPoolExecutor(self.cfg.max_concurrency) as pool,
            Progress(transient=True, disable=not sys.stderr.isatty()) as bar,
        ):
            task = bar.add_task("rollout (sglang)", total=len(jobs))
            for s in pool.map(one, jobs):
                out.append(s)
                bar.advance(task)
        return out

    # -- weights ------------------------------------------------------------------------------
    def _post_checked(self, path: str, body: dict) -> dict:
        """POST and refuse ``success: false`` (SGLang answers weight routes that way)."""
        resp = self._post_with_recovery(path, body)
        if resp.get("success", True) is False:
            raise EngineResponseError(f"SGLang {path} failed: {resp.get('message')}")
        return resp

    @contextmanager
    def weight_update_session(self):
        """pause (retract) → begin → … → end → continue, for pushes of new weights."""
        self._post_checked("/pause_generation", {"mode": "retract"})
        try:
            self._post_checked("/begin_weight_update", {})
            try:
                yield self
            finally:
                self._post_checked("/end_weight_update", {})
        finally:
            self._post_checked("/continue_generation", {})

    def update_weights_from_disk(self, model_path: str, version: int) -> None:
        self._post_checked("/update_weights_from_disk", disk_payload(model_path, version))
        self.weight_version = version
        self._last_disk = (model_path, version)

    def init_weight_update_group(
        self, master_address: str, master_port: int, group_name: str = "p3o_weight_sync"
    ) -> None:
        """An NCCL group {trainer rank 0} ∪ {server ranks} for broadcasting weights (GPU only)."""
        world = 1 + self.cfg.tp_size
        body = init_group_payload(master_address, master_port, world, group_name)
        with ThreadPoolExecutor(1) as pool:  # both sides must join the rendezvous together
            fut = pool.submit(self._post_checked, "/init_weights_update_group", body)
            pg = weight_sync_group(master_address, master_port, world, group_name)
            fut.result()
        self._nccl = (pg, group_name)

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """One weight-update session: every bucket broadcast over the NCCL group."""
        with self.weight_update_session():
            for bucket, last in _with_last(buckets):
                self.push_bucket(bucket, version, last)
        self.weight_version = version

    def push_bucket(self, bucket: Bucket, version: int, last: bool) -> None:
        """One bucket inside a session: the server receives it while rank 0 broadcasts it."""
        if self._nccl is None:
            raise RuntimeError(
                "update_weights needs init_weight_update_group first (or use "
                "update_weights_from_disk)"
            )
        body = distributed_payload(bucket, self._nccl[1], version, last)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(self._post_checked, "/update_weights_from_distributed", body)
            self._broadcast([t for _, t in bucket])
            fut.result()

    def _broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        pg = self._nccl[0]
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        for t in tensors:
            # weight-sync group: trainer rank 0 sends each full tensor to every server rank
            pg.broadcast([t.cuda().contiguous()], opts).wait()

    def push_ipc(self, payloads: Sequence[str], version: int, last: bool) -> None:
        """One bucket by CUDA-IPC handle inside a session: payload r for server TP rank r
        (built by the trainer rank on that GPU, :mod:`megatron_p3o.weight_sync.ipc`)."""
        if len(payloads) != self.cfg.tp_size:
            raise ValueError(
                f"{len(payloads)} IPC payloads for a server of tp_size {self.cfg.tp_size}"
            )
        body = {"serialized_named_tensors": list(payloads), **_last_bucket_fields(version, last)}
        self._post_checked("/update_weights_from_tensor", body)

    def release_memory(self) -> None:
        """Colocated: free the server's weights and KV cache for the trainer's update."""
        self._post_checked("/release_memory_occupation", {})

    def resume_memory(self, tags: Sequence[str]) -> None:
        """Colocated: take back ``tags`` ("weights", then "kv_cache" once they are loaded)."""
        self._post_checked("/resume_memory_occupation", {"tags": list(tags)})


def _with_last(items: Iterable):
    """``(item, is_last)`` with one item of look-ahead (buckets arrive as a stream)."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for x in it:
        yield prev, False
        prev = x
    yield prev, True


def _last_bucket_fields(version: int, last: bool) -> dict:
    """The cache is flushed and the version set once, with the last bucket of a session."""
    return {"flush_cache": last, **({"weight_version": str(version)} if last else {})}


def disk_payload(model_path: str, version: int) -> dict:
    """``/update_weights_from_disk``: a safetensors directory every server can read."""
    return {"model_path": model_path, "weight_version": str(version), "flush_cache": True}


def init_group_payload(master_address: str, master_port: int, world: int, group_name: str) -> dict:
    """``/init_weights_update_group``: server ranks join as 1…tp_size (trainer rank 0)."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": 1,
        "world_size": world,
        "group_name": group_name,
        "backend": "nccl",
    }


def distributed_payload(bucket: Bucket, group_name: str, version: int, last: bool) -> dict:
    """``/update_weights_from_distributed`` for one bucket."""
    return {
        "names": [n for n, _ in bucket],
        "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        **_last_bucket_fields(version, last),
    }


def weight_sync_group(
    master_address: str, master_port: int, world: int, group_name: str, backend: str = "nccl"
):
    """The trainer's end (rank 0) of the weight-update group, made as SGLang makes its end
    (``init_custom_process_group``): a ``tcp://`` rendezvous, the store wrapped in
    ``PrefixStore(group_name)``, then torch's process-group helper, which adds its own
    ``group_name/`` prefix. Any other wrapping puts the NCCL unique id under a key the server
    never reads. Torch-private API: the one place it is used."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    url = f"tcp://{master_address}:{master_port}"
    store, rank, world = next(c10d.rendezvous(url, 0, world, timeout=timedelta(minutes=10)))
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timedelta(minutes=10),
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


class SGLangFleet(RolloutEngine):
    """Several SGLang servers: generation through one URL (an ``sglang_router`` in front of them,
    or a single server), weight updates sent to every worker directly (slime's arrangement: the
    router balances requests; each worker keeps its own NCCL weight-update group).

    ``router``: the generation engine; ``workers``: one engine per server (may be just the router's
    server itself when there is one).
    """

    name = "sglang"

    def __init__(self, router: SGLangEngine, workers: Sequence[SGLangEngine]):
        self.router, self.workers = router, list(workers)
        self.weight_version = 0

    def start(self) -> "SGLangFleet":
        for w in self.workers:
            if w is not self.router:
                w.wait_healthy(w.cfg.startup_timeout_s)
        self.router.start()
        return self

    def stop(self) -> None:
        self.router.stop()
        for w in self.workers:
            if w is not self.router:
                w.stop()

    def health(self) -> dict:
        hs = [w.health() for w in self.workers]
        return {
            "ok": all(h["ok"] for h in hs),
            "weight_version": self.weight_version,
            "workers": hs,
        }

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> List[Sample]:
        return self.router.generate(prompts, n, sampling)

    def init_weight_update_groups(self, master_address: str, first_port: int) -> None:
        """One NCCL group per worker ({trainer rank 0} ∪ that worker's ranks), on consecutive
        ports."""
        for i, w in enumerate(self.workers):
            w.init_weight_update_group(
                master_address, first_port + i, group_name=f"p3o_weight_sync_{i}"
            )

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Every worker pauses and opens a session; each bucket (streamed once from the
        trainer) goes to every worker in turn; then every worker closes and resumes."""
        with self.sessions():
            for bucket, last in _with_last(buckets):
                for w in self.workers:
                    w.push_bucket(bucket, version, last)
        for w in self.workers:
            w.weight_version = version
        self.weight_version = version

    @contextmanager
    def sessions(self):
        """A weight-update session on every worker (pause → begin … end → continue)."""
        with ExitStack() as stack:
            for w in self.workers:
                stack.enter_context(w.weight_update_session())
            yield self

    def push_ipc(self, payloads: Sequence[str], version: int, last: bool) -> None:
        for w in self.workers:
            w.push_ipc(payloads, version, last)

    def release_memory(self) -> None:
        for w in self.workers:
            w.release_memory()

    def resume_memory(self, tags: Sequence[str]) -> None:
        for w in self.workers:
            w.resume_memory(tags)

    def update_weights_from_disk(self, model_path: str, version: int) -> None:
        for w in self.workers:
            w.update_weights_from_disk(model_path, version)
        self.weight_version = version
