"""SGLang rollout engine: launch or attach to a server (or router), generate with behaviour
log-probs, and push weights: NCCL broadcast (``update_weights``), CUDA IPC when colocated
(``update_weights_colocated``) or a checkpoint on disk (``update_weights_from_disk``).

Request and response fields follow SGLang's own server code (0.5.x, read from its wheel):
``POST /generate`` with ``input_ids``, ``sampling_params`` and ``return_logprob``; the response's
``meta_info.output_token_logprobs`` is a list of ``[logprob, token_id, text]`` and
``meta_info.finish_reason`` a dict with ``type`` ("stop" | "length" | "abort"). SGLang's
log-probs are log_softmax(logits / T) over the full vocabulary (not truncated by top-p/top-k) —
unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set, which a launched server never has.

Everything that needs a GPU (launching, NCCL weight sync) is exercised by ``tools/gpu_check.sh``
and the tests marked ``sglang``; request building, response parsing, concurrency, retries and the
dead-server error are tested on CPU against a loopback stand-in server.
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


@dataclass(frozen=True)
class SGLangConfig:
    """Attributes:
    url: attach to a running server or sglang router (no launch) when set.
    model_path: HF directory the launched server loads.
    dtype: serving dtype ("bfloat16", "float16", "auto").
    quantization: e.g. "fp8" (weights) or None.
    kv_cache_dtype: e.g. "fp8_e5m2" or None (= model dtype).
    mem_fraction_static: GPU memory fraction for weights + KV cache.
    tp_size: tensor parallel size of the server.
    host / port: where a launched server listens.
    gpus: CUDA_VISIBLE_DEVICES for the launched server (e.g. "4,5,6,7").
    startup_timeout_s: wait for /health after launch.
    request_timeout_s: per HTTP request.
    max_concurrency: concurrent /generate requests.
    max_restarts: restarts of a launched server that died (then a clear error).
    max_retries: retries of one request after a connection failure.
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
    extra_args: Tuple[str, ...] = field(default_factory=tuple)


def server_args(cfg: SGLangConfig) -> List[str]:
    """The serving arguments (dtype, memory, quantization, KV-cache dtype, extras) — the part of
    the command a cluster script shares between servers that differ in GPUs and port."""
    args = ["--dtype", cfg.dtype, "--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.quantization:
        args += ["--quantization", cfg.quantization]
    if cfg.kv_cache_dtype:
        args += ["--kv-cache-dtype", cfg.kv_cache_dtype]
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
    ]


def generate_payload(
    prompt_ids: Sequence[int], sampling: SamplingParams, seed: Optional[int]
) -> dict:
    """The ``/generate`` body for one completion of one prompt."""
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
    return {
        "input_ids": list(map(int, prompt_ids)),
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": -1,
    }  # output tokens only


def parse_generate_response(
    resp: dict, prompt_ids: Sequence[int], group_id: int, fallback_version: int
) -> Sample:
    """One SGLang ``/generate`` response → :class:`Sample` (refuses aborted / non-finite ones)."""
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
    version = meta.get("weight_version")
    try:
        version = int(version)
    except (TypeError, ValueError):
        version = fallback_version
    return Sample(
        prompt_ids=list(prompt_ids),
        completion_ids=ids,
        logprobs=logprobs,
        finish_reason=kind,
        weight_version=version,
        group_id=group_id,
        meta={"rid": rid},
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

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "SGLangEngine":
        if self.cfg.url is None:
            self._launch()
        self.wait_healthy(self.cfg.startup_timeout_s)
        return self

    def _launch(self) -> None:
        env = dict(os.environ)
        env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"  # ℓb must be at the sampling temperature
        if self.cfg.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cfg.gpus
        self.proc = subprocess.Popen(launch_command(self.cfg), env=env)

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
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
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
        else:
            time.sleep(1.0)

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
            resp = self._post_with_recovery("/generate", generate_payload(p, sampling, seed))
            return parse_generate_response(resp, p, g, self.weight_version)

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
    def update_weights_from_disk(self, model_path: str, version: int) -> None:
        resp = self._post_with_recovery(
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": str(version), "flush_cache": True},
        )
        if not resp.get("success", False):
            raise EngineResponseError(f"update_weights_from_disk failed: {resp.get('message')}")
        self.weight_version = version

    def init_weight_update_group(
        self, master_address: str, master_port: int, group_name: str = "p3o_weight_sync"
    ) -> None:
        """An NCCL group {trainer rank 0} ∪ {server ranks} for broadcasting weights (GPU only)."""
        world = 1 + self.cfg.tp_size
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": 1,
            "world_size": world,
            "group_name": group_name,
            "backend": "nccl",
        }
        with ThreadPoolExecutor(1) as pool:  # both sides must join the rendezvous together
            fut = pool.submit(self._post_with_recovery, "/init_weights_update_group", body)
            store = torch.distributed.TCPStore(master_address, master_port, world, is_master=True)
            pg = torch.distributed.ProcessGroupNCCL(
                torch.distributed.PrefixStore(group_name, store), 0, world
            )
            resp = fut.result()
        if not resp.get("success", False):
            raise EngineResponseError(f"init_weights_update_group failed: {resp.get('message')}")
        self._nccl = (pg, group_name, store)

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Broadcast each bucket over the NCCL group while the server receives it."""
        if self._nccl is None:
            raise RuntimeError(
                "update_weights needs init_weight_update_group first (or use "
                "update_weights_from_disk)"
            )
        pg, group_name, _ = self._nccl
        buckets = list(buckets)
        for i, bucket in enumerate(buckets):
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": group_name,
                "flush_cache": i == len(buckets) - 1,
                "weight_version": str(version),
            }
            with ThreadPoolExecutor(1) as pool:
                fut = pool.submit(
                    self._post_with_recovery, "/update_weights_from_distributed", body
                )
                opts = torch.distributed.BroadcastOptions()
                opts.rootRank = 0
                for _, t in bucket:
                    # weight-sync group: trainer rank 0 sends each full tensor to every server rank
                    pg.broadcast([t.cuda().contiguous()], opts).wait()
                resp = fut.result()
            if not resp.get("success", False):
                raise EngineResponseError(
                    f"update_weights_from_distributed failed: {resp.get('message')}"
                )
        self.weight_version = version

    def update_weights_colocated(self, buckets: Iterable[Bucket], version: int) -> None:
        """Colocated trainer and server on the same GPUs: hand CUDA tensors over by IPC handle
        (``/update_weights_from_tensor``; one serialized copy per server TP rank)."""
        from sglang.srt.utils import MultiprocessingSerializer  # GPU clusters only

        buckets = list(buckets)
        for i, bucket in enumerate(buckets):
            named = [(n, t.cuda().contiguous()) for n, t in bucket]
            blob = MultiprocessingSerializer.serialize(named, output_str=True)
            resp = self._post_with_recovery(
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [blob] * self.cfg.tp_size,
                    "flush_cache": i == len(buckets) - 1,
                    "weight_version": str(version),
                },
            )
            if not resp.get("success", False):
                raise EngineResponseError(
                    f"update_weights_from_tensor failed: {resp.get('message')}"
                )
        self.weight_version = version


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
        self.router.weight_version = self.weight_version  # fallback when a response has no version
        return self.router.generate(prompts, n, sampling)

    def init_weight_update_groups(self, master_address: str, first_port: int) -> None:
        """One NCCL group per worker ({trainer rank 0} ∪ that worker's ranks), on consecutive
        ports."""
        for i, w in enumerate(self.workers):
            w.init_weight_update_group(
                master_address, first_port + i, group_name=f"p3o_weight_sync_{i}"
            )

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        for bucket in buckets:  # each bucket once from the trainer, to every worker in turn
            for w in self.workers:
                w.update_weights([bucket], version)
        self.weight_version = version

    def update_weights_colocated(self, buckets: Iterable[Bucket], version: int) -> None:
        for bucket in buckets:
            for w in self.workers:
                w.update_weights_colocated([bucket], version)
        self.weight_version = version

    def update_weights_from_disk(self, model_path: str, version: int) -> None:
        for w in self.workers:
            w.update_weights_from_disk(model_path, version)
        self.weight_version = version
