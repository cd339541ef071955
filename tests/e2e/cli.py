"""Where the repository is, the environment the CLI subprocesses run with, and the command-line
pieces several e2e tests share."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a test that started a world in the pytest process leaves torch.distributed's variables (and
# its store listening on MASTER_PORT): a CLI subprocess must pick its own
_WORLD = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
ENV = {k: v for k, v in os.environ.items() if k not in _WORLD}
ENV.update(PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))


def torchrun(nproc: int) -> list:
    """``torchrun --standalone`` (a free rendezvous port: no fixed ports) with ``nproc`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc)]  # fmt: skip


def sglang_disk_sets(url: str, sync_dir) -> list:
    """``--set`` items that send rollouts to the SGLang server at ``url``, weights via disk."""
    sets = {
        "rollout.engine": "sglang",
        "rollout.sglang.url": url,
        "rollout.weight_sync": "disk",
        "rollout.weight_sync_dir": sync_dir,
    }
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
