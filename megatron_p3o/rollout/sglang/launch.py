"""Launching SGLang servers and routers: interpreter, environment, flags, process groups, logs.

Why a module of its own: a launched server runs in *another* Python environment (SGLang pins
torch 2.14.1 and transformers 5.19; ``tools/sglang_env.sh`` makes it), so the trainer starts it
with that environment's interpreter (``rollout.sglang.python``, default ``$SGLANG_PYTHON``) and
never with ``sys.executable``. Every launched process gets a process group of its own (stopped as
a whole: SGLang forks scheduler and detokenizer processes), an environment without torchrun's
variables (with them SGLang's own process group never forms), and a log file its output reaches
through a filter that replaces the API key (SGLang prints its ``server_args``, key included).
The key itself is passed through a mode-0600 ``--config`` file, not argv, so ``ps`` does not show
it; the router (sglang-router 0.3.2) reads it from argv only.

CPU servers (``device: cpu``, or ``auto`` on a machine without CUDA): ``SGLANG_USE_CPU_ENGINE=1``,
``--device cpu``, the ``libcuda.so.1`` stand-in that ``tools/sglang_env.sh`` builds next to the
interpreter's environment on ``LD_LIBRARY_PATH``, and ``--max-total-tokens`` (else the KV cache
takes most of the RAM), and ``--sleep-on-idle`` (an idle CPU scheduler busy-polls one core at
100%, which took half of a 2-core trainer: 10 s instead of 0.5 s per step). What SGLang 0.5.23
refuses on CPU is refused here, at config time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Literal, Optional, Sequence, Tuple

from megatron_p3o.runtime.errors import UserError
from megatron_p3o.runtime.ports import free_port

PYTHON_ENV = "SGLANG_PYTHON"  # the SGLang environment's interpreter (tools/sglang_env.sh)
API_KEY_ENV = "P3O_SGLANG_API_KEY"  # the per-job secret of servers and router (never in a recipe)
REDACTED = "<redacted>"
CPU_STUB_DIR = "p3o-cpu"  # under the SGLang venv: libcuda.so.1 (tools/sglang_env.sh)

# what torchrun puts in a worker's environment; a server launched from a worker must not see it
_TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)  # fmt: skip


class SGLangSetupError(UserError, ValueError):
    """A launch setting SGLang cannot honour here (interpreter, device flags)."""


@dataclass(frozen=True)
class LaunchSettings:
    """How a server is launched (the part of ``rollout.sglang`` this module reads).

    Attributes:
        model_path: HF directory the launched server loads.
        python: the SGLang environment's interpreter (default ``$SGLANG_PYTHON``; the trainer's
            own environment has no sglang).
        device: "auto" (cuda when the trainer sees a GPU, else cpu), "cuda" or "cpu".
        dtype: serving dtype ("bfloat16", "float16", "float32", "auto").
        quantization: "fp8" or None. "fp8": ``model_path`` must be a 128×128 block-FP8
            checkpoint (``checkpoints_convert.megatron_to_hf --quantize fp8``) and the trainer
            quantizes every push the same way (:mod:`megatron_p3o.weight_sync.fp8`); SGLang's
            online quantization of a bf16 checkpoint would drop the weight loaders pushes need.
        kv_cache_dtype: "fp8_e4m3" or None (= model dtype); "fp8_e5m2" is refused (it forces the
            triton attention backend).
        mem_fraction_static: GPU memory fraction for weights + KV cache.
        max_total_tokens: KV-cache size in tokens (None: SGLang's choice from the memory
            fraction; CPU servers default to 65536, else the cache takes most of the RAM).
        tp_size: tensor parallel size of the server.
        host / port: where a launched server listens (server i of ``servers`` at port + i).
        gpus: CUDA_VISIBLE_DEVICES for the launched server (e.g. "4,5,6,7").
        startup_timeout_s: wait for /health after launch (the process must stay alive).
        deterministic: ``--enable-deterministic-inference`` (also set by
            ``rollout.deterministic``); GPU only.
        routed_experts: ``(layers, top-k)`` of an MoE model under ``rollout.routing_replay: r3``:
            launch with ``--enable-return-routed-experts`` and decode each token's experts;
            set by the backend, GPU only.
        memory_saver: ``--enable-memory-saver`` (set by the backend for
            ``weight_sync: colocated``: without it /release_memory_occupation frees nothing).
        ld_preload: ``LD_PRELOAD`` of launched servers only (e.g. one ``libnccl.so.2`` for the
            trainer's and the servers' NCCL, cluster.md); the NCCL probe of the SGLang
            environment runs with it too.
        extra_args: more ``sglang.launch_server`` arguments.
        log_dir: where server logs and pid files go ("" = ``<run dir>/sglang``).
    """

    model_path: str = ""
    python: Optional[str] = None
    device: Literal["auto", "cuda", "cpu"] = "auto"
    dtype: str = "bfloat16"
    quantization: Optional[str] = None
    kv_cache_dtype: Optional[str] = None
    mem_fraction_static: float = 0.8
    max_total_tokens: Optional[int] = None
    tp_size: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    gpus: Optional[str] = None
    startup_timeout_s: float = 900.0
    deterministic: bool = False
    routed_experts: Optional[Tuple[int, int]] = None
    memory_saver: bool = False
    ld_preload: Optional[str] = None
    extra_args: Tuple[str, ...] = field(default_factory=tuple)
    log_dir: str = ""


def resolve_device(cfg: LaunchSettings) -> str:
    if cfg.device != "auto":
        return cfg.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# flags SGLang 0.5.23 cannot serve on CPU, with the setting that asks for them and why
_CPU_REFUSED = {
    "--enable-deterministic-inference": (
        "rollout.deterministic / rollout.sglang.deterministic",
        "SGLang 0.5.23 refuses deterministic inference on CPU at start-up; the CPU "
        "zero-mismatch control is rollout.sglang.dtype=float32 (or the embedded engine at fp32)",
    ),
    "--enable-return-routed-experts": (
        "rollout.routing_replay=r3",
        "SGLang 0.5.23's routed-experts capture calls torch.cuda.cudart() at start-up and "
        "dies on CPU; use routing_replay=off with a CPU server",
    ),
}


def check_device_flags(cfg: LaunchSettings) -> None:
    """Refuse, at config time, what the server's device cannot do (one line naming the flag)."""
    if resolve_device(cfg) != "cpu":
        return
    for flag in server_args(cfg):
        if flag in _CPU_REFUSED:
            key, why = _CPU_REFUSED[flag]
            raise SGLangSetupError(f"{key} ({flag}) with a CPU SGLang server: {why}")


def colocated_fraction(fraction: float, total_bytes: int, free_bytes: int) -> float:
    """The ``--mem-fraction-static`` that gives a colocated server the pool the plan counts,
    ``fraction`` × the whole GPU (``train --dry-run``), launched next to a trainer that already
    holds ``total − free`` bytes. SGLang 0.5.23 sizes weights + KV cache as the fraction × the
    memory *free when it starts* (``kv_cache_configurator._profile_available_bytes``:
    free − free_at_start·(1 − f)), so the recipe's fraction alone gave ≈ f·free — with 55 GiB
    of 80 held and f = 0.3, weights + KV were asked to fit in 7.5 GiB. One line when the
    planned pool does not fit in what is free (issue 63, item 2)."""
    planned = fraction * total_bytes
    if planned > 0.98 * free_bytes:
        gib = 2**30
        raise SGLangSetupError(
            f"rollout.sglang.mem_fraction_static={fraction}: a colocated server's planned "
            f"{planned / gib:.1f} GiB (the fraction of {total_bytes / gib:.0f} GiB) does not fit "
            f"in the {free_bytes / gib:.1f} GiB the trainer left free on the GPU; lower it "
            "(train --dry-run prints the trainer's resident memory)"
        )
    return round(planned / free_bytes, 4)


def resolve_python(cfg: LaunchSettings) -> str:
    """The SGLang environment's interpreter: ``rollout.sglang.python``, else ``$SGLANG_PYTHON``."""
    py = cfg.python or os.environ.get(PYTHON_ENV)
    if not py:
        raise SGLangSetupError(
            f"launching an SGLang server needs its environment's interpreter: set "
            f"rollout.sglang.python or ${PYTHON_ENV} (bash tools/sglang_env.sh makes "
            ".venv-sglang); the trainer's own Python has no sglang"
        )
    if not os.access(py, os.X_OK):
        raise SGLangSetupError(f"rollout.sglang.python / ${PYTHON_ENV}: {py} is not executable")
    return py


def cpu_stub_dir(python: str) -> Path:
    """The ``libcuda.so.1`` stand-in of the SGLang venv ``python`` belongs to."""
    d = Path(python).parent.parent / CPU_STUB_DIR  # venv/bin/python → venv/p3o-cpu
    if not (d / "libcuda.so.1").is_file():
        raise SGLangSetupError(
            f"a CPU SGLang server needs the libcuda.so.1 stand-in in {d} (bash "
            "tools/sglang_env.sh builds it)"
        )
    return d


def server_env(
    base: Optional[dict] = None,
    gpus: Optional[str] = None,
    cpu_libdir=None,
    ld_preload: Optional[str] = None,
) -> dict:
    """The environment of a launched server: the caller's without torchrun's variables, with
    ``SGLANG_RETURN_ORIGINAL_LOGPROB=false`` (ℓb at the sampling temperature), the GPUs and
    ``ld_preload`` (``rollout.sglang.ld_preload``); on CPU, SGLang's CPU engine and the
    ``libcuda.so.1`` stand-in."""
    env = {k: v for k, v in (os.environ if base is None else base).items()}
    for k in _TORCHRUN_ENV:
        env.pop(k, None)
    for k in [k for k in env if k.startswith("TORCHELASTIC_")]:
        env.pop(k)
    env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if ld_preload:
        env["LD_PRELOAD"] = ld_preload
    if cpu_libdir is not None:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(cpu_libdir), *filter(None, [env.get("LD_LIBRARY_PATH")])]
        )
    return env


def server_args(cfg: LaunchSettings) -> List[str]:
    """The serving arguments (device, dtype, memory, quantization, KV-cache dtype, extras) — the
    part of the command a cluster script shares between servers that differ in GPUs and port."""
    device = resolve_device(cfg)
    args = ["--dtype", cfg.dtype]
    if device == "cpu":
        args += ["--device", "cpu", "--max-total-tokens", str(cfg.max_total_tokens or 65536)]
        args += ["--sleep-on-idle"]  # else the idle scheduler spins a core the trainer needs
    else:
        args += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
        if cfg.max_total_tokens:
            args += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.quantization:
        args += ["--quantization", cfg.quantization]
    if cfg.kv_cache_dtype:
        args += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    if cfg.deterministic:
        args += ["--enable-deterministic-inference"]
    if cfg.routed_experts:
        args += ["--enable-return-routed-experts"]
    if cfg.memory_saver:
        args += ["--enable-memory-saver"]
    return args + list(cfg.extra_args)


def launch_command(cfg: LaunchSettings, port: Optional[int] = None, python: str = "") -> List[str]:
    """``<sglang python> -m sglang.launch_server ...`` for ``cfg`` (the API key is not in it)."""
    if not cfg.model_path:
        raise SGLangSetupError(
            "rollout.sglang.model_path is required to launch a server (or set rollout.sglang.url)"
        )
    check_served_checkpoint(cfg)
    return [
        python or resolve_python(cfg),
        "-m", "sglang.launch_server",
        "--model-path", cfg.model_path,
        "--tp-size", str(cfg.tp_size),
        "--host", cfg.host,
        "--port", str(cfg.port if port is None else port),
        "--skip-tokenizer-init",
        *server_args(cfg),
    ]  # fmt: skip


def check_served_checkpoint(cfg: LaunchSettings) -> None:
    """``quantization: fp8`` needs a block-FP8 checkpoint to serve, and a block-FP8 checkpoint
    needs ``quantization: fp8`` (its pushes must be quantized): one line naming the file."""
    from megatron_p3o.weight_sync.fp8 import is_fp8_block_config

    path = Path(cfg.model_path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        if cfg.quantization != "fp8":
            return  # the server says what is wrong with it
        raise SGLangSetupError(f"rollout.sglang.model_path: cannot read {path}: {e}") from None
    if cfg.quantization != "fp8":
        if is_fp8_block_config(hf):
            raise SGLangSetupError(
                f"rollout.sglang.model_path: {path} is a block-FP8 checkpoint; set "
                "rollout.sglang.quantization=fp8 (the trainer then quantizes its pushes) or "
                "serve an unquantized one"
            )
        return
    if not is_fp8_block_config(hf):
        raise SGLangSetupError(
            f"rollout.sglang.quantization=fp8: {path} has no 128x128 block-FP8 "
            "quantization_config; SGLang's online FP8 quantization of a bf16 checkpoint drops "
            "the weight loaders, so every weight push would fail. Serve an FP8 checkpoint: "
            "python -m checkpoints_convert.megatron_to_hf --ckpt CKPT --out DIR --quantize fp8"
        )


# sglang-router 0.3.2 takes its key from argv only (where ``ps`` shows it to every user of the
# node); this launcher parses the same arguments with the router's own parser and sets the key
# from the environment (readable by the job's user only), then starts the router as its CLI does.
_ROUTER_LAUNCHER = (
    "import os, sys\n"
    "from sglang_router.launch_router import launch_router, parse_router_args\n"
    "args = parse_router_args(sys.argv[1:])\n"
    f"args.api_key = os.environ.pop({API_KEY_ENV!r}, None) or None\n"
    "launch_router(args)\n"
)


def router_command(
    python: str,
    host: str,
    port: int,
    workers: Sequence[str],
    prometheus_port: int = 0,
    sticky: bool = False,
) -> List[str]:
    """sglang-router in front of ``workers``; its API key (enforced on /generate) comes from
    ``$P3O_SGLANG_API_KEY`` in its environment, never from argv. ``sticky``: its ``manual``
    policy — requests with one routing key (``x-smg-routing-key``) go to one server, a new key
    to the least loaded (multi-turn trajectories: every turn where its prefix is cached)."""
    policy = ["--policy", "manual", "--assignment-mode", "min_load"] if sticky else []
    return [
        python, "-c", _ROUTER_LAUNCHER, "--host", host, "--port", str(port),
        "--worker-urls", *workers, "--prometheus-port", str(prometheus_port or free_port(host)),
        *policy,
    ]  # fmt: skip


class ServerProcess:
    """One launched process (server or router) in a process group of its own; its output goes
    through a filter that replaces ``secrets`` into ``log_path``; its pid into ``<log>.pid``."""

    def __init__(self, cmd: Sequence[str], env: dict, log_path: Path, secrets: Sequence[str] = ()):
        self.cmd, self.env, self.log_path = list(cmd), env, Path(log_path)
        self.secrets = [s.encode() for s in secrets if s]
        self.proc: Optional[subprocess.Popen] = None
        self._pump: Optional[threading.Thread] = None
        self._tail: deque = deque(maxlen=40)
        self._private: Optional[tempfile.TemporaryDirectory] = None

    @property
    def printable(self) -> str:
        return " ".join(REDACTED if a.encode() in self.secrets else a for a in self.cmd)

    def start(self, config: Optional[dict] = None) -> "ServerProcess":
        """Start; ``config`` (e.g. the API key) reaches SGLang as a private ``--config`` file."""
        cmd = list(self.cmd)
        if config:
            import yaml

            self._private = tempfile.TemporaryDirectory(prefix="p3o-sglang-")
            path = Path(self._private.name) / "secret.yaml"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(config, f)
            cmd += ["--config", str(path)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _stop_previous(self.log_path.with_suffix(".pid"))
        self.proc = subprocess.Popen(
            cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.log_path.with_suffix(".pid").write_text(f"{self.proc.pid}\n")
        self._pump = threading.Thread(target=self._copy_output, daemon=True)
        self._pump.start()
        return self

    def _copy_output(self) -> None:
        with open(self.log_path, "ab") as log:
            for line in iter(self.proc.stdout.readline, b""):
                for s in self.secrets:
                    line = line.replace(s, REDACTED.encode())
                log.write(line)
                log.flush()
                self._tail.append(line.decode(errors="replace").rstrip())

    def forget_config(self) -> None:
        """The server has read its ``--config`` file (it is healthy): delete the file."""
        if self._private is not None:
            self._private.cleanup()
            self._private = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def tail(self, n: int = 15) -> str:
        """The last ``n`` lines of output (already redacted), for error messages."""
        if self._pump is not None and not self.alive():
            self._pump.join(timeout=2)
        return " | ".join(list(self._tail)[-n:])

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to the whole process group, then SIGKILL after ``timeout_s``."""
        if self.proc is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=timeout_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            _reap_group(self.proc.pid, timeout_s)
            if self._pump is not None:
                self._pump.join(timeout=5)
        self.forget_config()


def _stop_previous(pid_file: Path) -> None:
    """A server this run launched before whose trainer died (kill -9, a node fault) outlives it:
    blocked in a weight broadcast until NCCL's timeout, or holding its port and GPU memory.
    Its process group is killed before the new launch, in one line; a pid that is no longer
    an SGLang process (reused after a reboot) is left alone."""
    try:
        pid = int(pid_file.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except (OSError, ValueError, IndexError):
        return
    if b"sglang" not in cmdline:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    print(f"SGLang: the server this run launched before (pid {pid}, {pid_file.name}) was still "
          "running, its trainer gone: stopped before the new launch", file=sys.stderr,
          flush=True)  # fmt: skip


def _reap_group(pgid: int, timeout_s: float) -> None:
    """Children may outlive the leader (SGLang's scheduler): SIGKILL what is left of the group."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
