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

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence

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
    from .launch import SGLangSetupError

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


def weight_sync_group(
    master_address: str, master_port: int, world: int, group_name: str, backend: str = "nccl"
):
    """The trainer's end (rank 0) of the weight-update group, made as SGLang makes its end
    (``init_custom_process_group``): the ``tcp://`` rendezvous's store (hosted here, rank 0),
    wrapped in ``PrefixStore(group_name)``, then torch's process-group helper, which adds its
    own ``group_name/`` prefix. Any other wrapping puts the NCCL unique id under a key the server
    never reads. The store is made directly, not by ``rendezvous("tcp://…")``: under torchrun
    (``TORCHELASTIC_USE_AGENT_STORE``) that would join the agent's store instead of hosting one
    at ``master_port``, and the server, which connects there, would wait forever.
    Torch-private API: the one place it is used."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(minutes=10)
    store = torch.distributed.TCPStore(master_address, master_port, world, True, timeout=timeout)
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
