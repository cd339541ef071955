"""Moving weights into SGLang servers: the weight-update process group and tensor payloads.

Two transports besides the disk (``/update_weights_from_disk``, see ``central``):

- **distributed**: ``/init_weights_update_group`` makes one group {trainer rank 0} ∪ {every
  server's ranks}; each bucket is announced to every server by
  ``/update_weights_from_distributed`` (names, dtypes, shapes) while rank 0 broadcasts its
  tensors once. The group's backend is a setting: ``nccl`` on GPUs, ``gloo`` for CPU servers
  (NCCL refuses CPU tensors; it also cannot carry float8). Under gloo no tensor is moved to a
  GPU.
- **tensor**: ``/update_weights_from_tensor`` with one payload per server TP rank, made by
  :func:`megatron_p3o.weight_sync.ipc.serialize_named_tensors` (CUDA-IPC handles for CUDA
  tensors, plain pickled data for CPU tensors: a CPU server killed itself on the IPC format).
"""

from __future__ import annotations

import os
import queue
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Literal, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class WeightSettings:
    """How pushes reach a server (the part of ``rollout.sglang`` this module reads).

    Attributes:
        sync_backend: the distributed weight-update group's backend: "auto" (nccl when the
            trainer has CUDA, else gloo), "nccl" or "gloo" (CPU servers; GPU clusters whose
            trainer and SGLang environments bring different NCCL versions).
    """

    sync_backend: Literal["auto", "nccl", "gloo"] = "auto"


def resolve_backend(cfg: WeightSettings) -> str:
    if cfg.sync_backend != "auto":
        return cfg.sync_backend
    return "nccl" if torch.cuda.is_available() else "gloo"


_NCCL_PROBE = "import torch; print('.'.join(map(str, torch.cuda.nccl.version())))"


def trainer_nccl_version() -> Optional[str]:
    """The NCCL this process's torch uses (what an LD_PRELOAD put in its place, if any)."""
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):  # a CPU build of torch has no NCCL
        return None


def server_nccl_version(python: str, env: Optional[dict] = None) -> Optional[str]:
    """The NCCL the SGLang environment's torch uses (``python``: its interpreter; no GPU
    needed); None when it cannot say."""
    import subprocess

    try:
        r = subprocess.run(
            [python, "-c", _NCCL_PROBE], capture_output=True, text=True, env=env, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = r.stdout.strip().splitlines()
    return out[-1] if r.returncode == 0 and out else None


def check_nccl_versions(trainer: Optional[str], server: Optional[str], python: str) -> None:
    """NCCL refuses a communicator whose ranks run different versions (at the first
    broadcast, after the whole launch): refuse ``sync_backend: nccl`` up front."""
    from megatron_p3o.rollout.sglang.launch import SGLangSetupError

    if trainer is None or server is None or trainer == server:
        return
    lib = Path(python).parent.parent / "lib"
    raise SGLangSetupError(
        f"weight_sync=distributed over NCCL: the trainer's NCCL is {trainer}, the SGLang "
        f"environment's ({python}) is {server}; NCCL refuses a group of mixed versions. Use one "
        "image for both, or LD_PRELOAD one libnccl.so.2 into both (e.g. "
        f"{lib}/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2), or "
        "rollout.weight_sync=disk"
    )


GROUP_PREFIX = "p3o_ws"
GROUP_JOIN_TIMEOUT_S = 300.0  # every member of a weight-update group has joined within this


def group_name(env: Optional[dict] = None) -> str:
    """The weight-update group's name for this launch: job, restart count and a nonce.

    Why per launch: the server keeps a group after the trainer that formed it is gone, and
    torch refuses a second group of the same name (``The specified group name has already been
    created``), so a trainer restarted against servers that outlived it (``p3o.sbatch``'s
    ``--max-restarts``) could never rejoin under a fixed name. The job id is ``SLURM_JOB_ID``
    (else torchrun's run id), the restart count torchrun's ``TORCHELASTIC_RESTART_COUNT`` (else
    ``SLURM_RESTART_COUNT``); the nonce keeps two launches of one job apart in any case."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "local"
    job = re.sub(r"[^A-Za-z0-9]", "", job)[:24] or "local"
    restart = env.get("TORCHELASTIC_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT") or "0"
    restart = re.sub(r"[^0-9]", "", restart) or "0"
    return f"{GROUP_PREFIX}_{job}_r{restart}_{secrets.token_hex(4)}"


def host_store(master_address: str, master_port: int, world: int, timeout_s: float = 600.0):
    """The weight-update group's rendezvous store, hosted here (rank 0). It does not wait for the
    servers to connect (torch's default would block right here, before any server has been
    asked to join): the port is bound, or refused, at once."""
    from datetime import timedelta

    return torch.distributed.TCPStore(
        master_address,
        master_port,
        world,
        True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class GroupSetupError(RuntimeError):
    """A weight-update group could not be formed (one line: who failed, and why)."""


def race(jobs: Sequence[Tuple[str, Callable[[], object]]], timeout_s: float, what: str) -> List:
    """Run ``jobs`` (``(who, fn)``) at once, each in a daemon thread; their results in order.

    The first failure is raised at once as one line naming who failed, without waiting for the
    others: a member that cannot join leaves the rest blocked in the rendezvous (the trainer's
    end until its store timeout, 10 minutes; a server's until SGLang's 30), and waiting for them
    is the silent hang of a refused group. Daemon threads: a process exiting on the error is not
    held back by a member still blocked in torch's C++ rendezvous (it releases the GIL)."""
    done: "queue.Queue" = queue.Queue()
    for i, (_who, fn) in enumerate(jobs):

        def run(i=i, fn=fn):
            try:
                done.put((i, True, fn()))
            except BaseException as e:  # noqa: BLE001 - reported by the waiting thread
                done.put((i, False, e))

        threading.Thread(target=run, name=f"p3o-group-{i}", daemon=True).start()
    out: List = [None] * len(jobs)
    pending = set(range(len(jobs)))
    deadline = time.monotonic() + timeout_s
    while pending:
        try:
            i, ok, value = done.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            who = ", ".join(jobs[i][0] for i in sorted(pending))
            raise GroupSetupError(
                f"{what}: {who} did not join within {timeout_s:.0f}s (is the master address "
                "reachable from every server?)"
            ) from None
        pending.discard(i)
        if not ok:
            msg = " ".join(str(value).split()) or type(value).__name__
            raise GroupSetupError(f"{what}: {jobs[i][0]} failed: {msg}") from None
        out[i] = value
    return out


def weight_sync_group(
    master_address: str,
    master_port: int,
    world: int,
    group_name: str,
    backend: str = "nccl",
    store=None,
):
    """The trainer's end (rank 0) of the weight-update group, made as SGLang makes its end
    (``init_custom_process_group``): the ``tcp://`` rendezvous's store (hosted here, rank 0),
    wrapped in ``PrefixStore(group_name)``, then torch's process-group helper, which adds its
    own ``group_name/`` prefix. Any other wrapping puts the NCCL unique id under a key the server
    never reads. The store is made directly, not by ``rendezvous("tcp://…")``: under torchrun
    (``TORCHELASTIC_USE_AGENT_STORE``) that would join the agent's store instead of hosting one
    at ``master_port``, and the server, which connects there, would wait forever.
    ``store``: one :func:`host_store` made beforehand (so that a taken port fails before any
    server is asked to join). Torch-private API: the one place it is used."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(minutes=10)
    if store is None:
        store = host_store(master_address, master_port, world, timeout.total_seconds())
    store = c10d.PrefixStore(group_name, store)
    rank = 0
    pg, _ = c10d._new_process_group_helper(
        world,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    return pg


def broadcast(pg, tensors: Sequence[torch.Tensor], backend: str) -> None:
    """Rank 0 of the weight-update group sends each full tensor to every server rank: on the
    GPU for NCCL, from host memory for gloo."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    for t in tensors:
        t = t.cuda() if backend == "nccl" else t.cpu()
        # weight-update group: trainer rank 0 → every server rank, one tensor at a time
        pg.broadcast([t.contiguous()], opts).wait()
