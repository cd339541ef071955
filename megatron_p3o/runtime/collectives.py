"""Every collective the package runs, named by what it does, on a group the caller names, with
the reason for that group as an argument.

Why: a raw ``dist.all_reduce(t)`` silently runs on the world group, and a comment saying which
group was meant drifts from the code. Here the group has no default (the world is passed as
``groups.world``, by name), and ``why`` travels with the call: a hang or a mismatched call
order can be traced with ``P3O_TRACE_COLLECTIVES=1``, which logs each call's op, group size and
reason on every rank before it enters the collective (``tests/unit/test_layout.py`` refuses a
``torch.distributed`` collective anywhere else in the package).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
_TRACE = os.environ.get("P3O_TRACE_COLLECTIVES") == "1"


def _trace(op: str, group, why: str) -> None:
    if _TRACE:
        size = dist.get_world_size(group) if group is not None else "?"
        log.warning("rank %d: %s over %s ranks: %s", dist.get_rank(), op, size, why)


def all_sum(t: torch.Tensor, group, why: str) -> torch.Tensor:
    """In place: the sum of ``t`` over ``group``."""
    _trace("all_sum", group, why)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_max(t: torch.Tensor, group, why: str) -> torch.Tensor:
    """In place: the element-wise maximum of ``t`` over ``group``."""
    _trace("all_max", group, why)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def all_max_start(t: torch.Tensor, group, why: str):
    """In place, started: the element-wise maximum of ``t`` over ``group`` once the returned
    handle's ``wait()`` returns (work may go on meanwhile; ``t`` is not to be touched before)."""
    _trace("all_max (async)", group, why)
    return dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)


def all_gather_into(parts: List[torch.Tensor], t: torch.Tensor, group, why: str) -> list:
    """``parts[r]`` = rank r's ``t`` (``parts`` preallocated, one per rank of ``group``)."""
    _trace("all_gather", group, why)
    dist.all_gather(parts, t, group=group)
    return parts


def all_gather_flat(out: torch.Tensor, t: torch.Tensor, group, why: str) -> torch.Tensor:
    """``out`` = every rank's ``t`` concatenated along dim 0 (rank order of ``group``)."""
    _trace("all_gather_flat", group, why)
    dist.all_gather_into_tensor(out, t, group=group)
    return out


def reduce_scatter_flat(out: torch.Tensor, t: torch.Tensor, group, why: str) -> torch.Tensor:
    """``out`` = this rank's dim-0 slice of the sum of ``t`` over ``group``."""
    _trace("reduce_scatter_flat", group, why)
    dist.reduce_scatter_tensor(out, t, group=group)
    return out


def all_gather_objects(obj: Any, group, why: str) -> list:
    """Every rank's picklable ``obj``, in rank order of ``group``."""
    _trace("all_gather_objects", group, why)
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_objects(obj: Any, dst: int, group, why: str) -> Optional[list]:
    """Every rank's ``obj`` on global rank ``dst`` (None elsewhere)."""
    _trace("gather_objects", group, why)
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def scatter_objects(objs: Optional[Sequence[Any]], src: int, group, why: str) -> Any:
    """Rank r of ``group`` receives ``objs[r]`` from global rank ``src``."""
    _trace("scatter_objects", group, why)
    got: List[Any] = [None]
    dist.scatter_object_list(got, list(objs) if objs is not None else None, src=src, group=group)
    return got[0]


def broadcast(t: torch.Tensor, src: int, group, why: str) -> torch.Tensor:
    """In place: global rank ``src``'s ``t`` on every rank of ``group``."""
    _trace("broadcast", group, why)
    dist.broadcast(t, src=src, group=group)
    return t


def broadcast_objects(objs: list, src: int, group, why: str) -> list:
    """In place: global rank ``src``'s list of picklable objects on every rank of ``group``."""
    _trace("broadcast_objects", group, why)
    dist.broadcast_object_list(objs, src=src, group=group)
    return objs


def barrier(group, why: str) -> None:
    """Every rank of ``group`` has arrived."""
    _trace("barrier", group, why)
    dist.barrier(group=group)


def send(t: torch.Tensor, dst: int, group, why: str) -> None:
    _trace("send", group, why)
    dist.send(t, dst=dst, group=group)


def recv(buf: torch.Tensor, src: int, group, why: str) -> torch.Tensor:
    _trace("recv", group, why)
    dist.recv(buf, src=src, group=group)
    return buf


def _object_device(group) -> torch.device:
    """Where an object's bytes travel: the current GPU for NCCL, else the host."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_objects(objs: list, dst: int, group, why: str) -> None:
    """``objs`` (picklable) to global rank ``dst``: their byte count, then the bytes."""
    _trace("send_objects", group, why)
    data = torch.frombuffer(bytearray(pickle.dumps(objs)), dtype=torch.uint8)
    dev = _object_device(group)
    dist.send(torch.tensor([data.numel()], dtype=torch.long, device=dev), dst=dst, group=group)
    dist.send(data.to(dev), dst=dst, group=group)


def recv_objects(objs: list, src: int, group, why: str, timeout_s: Optional[float] = None) -> list:
    """In place: ``objs`` filled with what global rank ``src`` sent (:func:`send_objects`).

    ``timeout_s``: how long to wait for the announcement before an error that names ``src``
    and ``why`` (gloo; an NCCL wait is bounded by NCCL's own watchdog)."""
    _trace("recv_objects", group, why)
    dev = _object_device(group)
    size = torch.zeros(1, dtype=torch.long, device=dev)
    work = dist.irecv(size, src=src, group=group)
    if timeout_s is not None and dev.type == "cpu":
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if "imed out" not in str(e) and "imeout" not in str(e):
                raise
            raise CollectiveTimeout(
                f"rank {dist.get_rank()}: no message from global rank {src} within "
                f"{timeout_s:g} s ({why})"
            ) from None
    else:
        work.wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.recv(data, src=src, group=group)
    got = pickle.loads(data.cpu().numpy().tobytes())
    objs[: len(got)] = got
    return objs


class CollectiveTimeout(RuntimeError):
    """A bounded wait ran out: the message names the rank that did not answer."""
