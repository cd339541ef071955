"""Start one SGLang server or the router of a recipe the way the trainer would, for a batch
script that places them on other nodes (``tools/slurm/p3o.sbatch``)::

    python -m megatron_p3o.cli.serve server RECIPE --port P --log FILE [--set k=v ...]
    python -m megatron_p3o.cli.serve router RECIPE --port P --log FILE \\
        --workers URL [URL ...] [--set k=v ...]

Why not ``sglang.launch_server`` in the script: the same command the trainer builds
(:func:`megatron_p3o.rollout.sglang.launch.launch_command`: the SGLang environment's interpreter,
the recipe's serving flags, the FP8-checkpoint check) and the same process handling
(:class:`megatron_p3o.rollout.sglang.launch.ServerProcess`):
the job's API key (``$P3O_SGLANG_API_KEY``) reaches the server in a mode-0600 ``--config`` file
and the router through its environment, never argv; both processes' output is written to
``FILE`` with the key replaced. Runs in the trainer's environment, in the foreground, until the
server exits (its exit status) or this process is terminated (the server's process group with
it). GPUs: ``CUDA_VISIBLE_DEVICES`` of the caller.

In cli/, not beside the launcher in rollout/sglang/: it reads the whole recipe as the trainer
does (:func:`megatron_p3o.config.loading.load_config`, every cross-section check), and config/
imports rollout/, which therefore never imports config/ back.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path


def main(argv=None) -> int:
    from megatron_p3o.config.loading import load_config
    from megatron_p3o.rollout.sglang.launch import (
        API_KEY_ENV,
        ServerProcess,
        cpu_stub_dir,
        launch_command,
        resolve_device,
        resolve_python,
        router_command,
        server_env,
    )

    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).rstrip(":"))
    ap.add_argument("what", choices=["server", "router"])
    ap.add_argument("recipe")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--log", required=True, help="log file (the API key is redacted)")
    ap.add_argument("--workers", nargs="*", default=[], help="router: the servers' URLs")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    cfg = load_config(a.recipe, a.set)
    sg = replace(cfg.rollout.sglang, host=a.host, gpus=None)
    if cfg.rollout.weight_sync == "colocated":
        sg = replace(sg, memory_saver=True)
    python = resolve_python(sg)
    key = os.environ.get(API_KEY_ENV)
    if a.what == "server":
        cpu = cpu_stub_dir(python) if resolve_device(sg) == "cpu" else None
        cmd, env = (
            launch_command(sg, a.port, python),
            server_env(cpu_libdir=cpu, ld_preload=sg.ld_preload),
        )
        config = {"api-key": key} if key else None
    else:
        if not a.workers:
            raise SystemExit("serve router: --workers URL [URL ...] is required")
        cmd, env, config = router_command(python, a.host, a.port, a.workers), server_env(), None
    proc = ServerProcess(cmd, env, Path(a.log), secrets=[key] if key else []).start(config)

    def _stop(signum, frame):
        proc.stop()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    healthy = False
    while True:
        try:
            rc = proc.proc.wait(timeout=5)
            break
        except subprocess.TimeoutExpired:  # still running: the key file goes once it is healthy
            if config and not healthy and _healthy(a.port):
                proc.forget_config()
                healthy = True
    proc.stop()
    return rc


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "megatron_p3o.cli.serve")
