"""Stream the full HF-named weights to global rank 0, stage after stage, without gathering the
model anywhere else (the push to a single SGLang server/router).

Why: the embedded engines need the weights on every rank (each rank has its own engine), but a
central server needs them once, on the one rank that talks to it. Each pipeline stage of the
first DP replica (DP = CP = 0) iterates its own layers (TP shards gathered inside the stage by
``iter_hf_tensors``); stage 0 yields straight to rank 0; later stages send bucket by bucket over
the pipeline group, each bucket only when rank 0 asks for it (a handshake: rank 0 asks for a
stage's next bucket when it takes the current one), so that at most one bucket per stage is in
flight. Without it later stages ran through their whole stage while rank 0 was still pushing
stage 0: on NCCL their sends do not block, and their TP peers queued every TP all-gather of the
stage meanwhile (the gathers now also wait for each other on the host,
:func:`.export._gather_tp`). Other DP/CP replicas hold the same weights and take no part —
except under expert parallelism, where the first replica holds only its share of the experts:
each EP rank's owner (expert-TP rank 0 of the first expert-data-parallel replica, which is not
always a dense TP rank 0) sends its experts to its EP group's rank 0, the stage's sender, after
the dense pass, and the sender forwards them like its own.
"""

from __future__ import annotations

from typing import Iterator, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_p3o.model.description import ModelDescription
from megatron_p3o.runtime.collectives import (
    recv,
    recv_objects,
    send,
    send_objects,
)
from megatron_p3o.runtime.parallel import ParallelGroups
from megatron_p3o.weight_sync.export import iter_hf_tensors

STREAM_BUCKET_BYTES = 256 * 2**20  # a later stage's bytes per request of rank 0
EXPERT_WAIT_S = 600.0  # a stage's sender waits this long for an EP rank's next expert (gloo)
_NEXT, _END = "next", None


def iter_hf_tensors_to_rank0(
    chunks: Sequence[torch.nn.Module],
    groups: ParallelGroups,
    desc: ModelDescription,
    bucket_bytes: int = STREAM_BUCKET_BYTES,
    wait_s: float = EXPERT_WAIT_S,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """On global rank 0: every (HF name, full tensor) of the model. Elsewhere: nothing (but every
    rank that holds a part must iterate it: the TP gathers and sends are collectives).

    Two passes per stage. The dense parameters: the first DP/CP replica's TP group gathers them,
    its TP rank 0 (the stage's sender) forwards them. The routed experts: the first expert-data-
    parallel replica's expert-TP groups gather them, and each EP rank's owner (expert-TP rank 0:
    :attr:`ParallelGroups.owns_experts`; *not* the dense TP rank 0 — at TP 2, EP 2, expert-TP 1
    the dense TP rank 1 holds experts E/2…E−1) sends them to its EP group's rank 0, the stage's
    sender. ``wait_s``: how long the sender waits for an EP rank's next expert before it stops
    with an error that names the rank (gloo; NCCL's own watchdog elsewhere)."""
    g = groups
    first = g.dp_rank == 0 and g.cp_rank == 0
    moe = desc.is_moe
    expert_walker = moe and g.expt_dp_rank == 0  # its expert-TP group gathers the experts
    sender = first and g.tp_rank == 0  # the stage's sender is EP rank 0 of its EP group
    if sender and moe and g.ep_rank != 0:
        raise RuntimeError(f"rank {g.rank}: a stage's sender at EP rank {g.ep_rank} (expected 0)")
    if not sender:
        if first:  # a TP peer of a sender: its dense gathers pace themselves on the sender's
            for _ in iter_hf_tensors(chunks, g, desc, part="dense"):
                pass
        if expert_walker:
            experts = iter_hf_tensors(chunks, g, desc, part="experts")
            if g.owns_experts:  # EP rank > 0: its experts, to the stage's sender
                _send_all(experts, dist.get_global_rank(g.ep, 0), g.ep)
            else:
                for _ in experts:
                    pass
        return
    tensors = _stage_tensors(chunks, g, desc, wait_s)
    if g.pp_rank == 0:
        for name, t in tensors:
            if g.rank == 0:
                yield name, t
    else:
        _serve_stage(tensors, g, bucket_bytes)
    if g.rank == 0:
        for stage in range(1, g.layout.pp):
            yield from _pull_stage(dist.get_global_rank(g.pp, stage), g.pp)


def _stage_tensors(chunks, g: ParallelGroups, desc: ModelDescription, wait_s: float):
    """A stage's sender: its dense tensors, its own experts, then (EP) each EP rank's experts."""
    yield from iter_hf_tensors(chunks, g, desc, part="dense")
    if not desc.is_moe:
        return
    yield from iter_hf_tensors(chunks, g, desc, part="experts")
    for peer in range(1, g.layout.ep):
        # EP group: the experts this rank lacks, from the rank of the group that owns them
        yield from _receive(dist.get_global_rank(g.ep, peer), g.ep, wait_s)


def _serve_stage(tensors, g: ParallelGroups, bucket_bytes: int) -> None:
    """A later stage's sender: for each request of rank 0, its next bucket (gathered only now),
    then the end marker."""
    src = dist.get_global_rank(g.pp, 0)
    tensors = iter(tensors)
    while True:
        ask = [None]
        recv_objects(ask, src, g.pp, "rank 0 asks this stage for its next bucket")
        bucket, size = [], 0
        for name, t in tensors:
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                break
        metas = [(n, tuple(t.shape), t.dtype) for n, t in bucket]
        send_objects([metas or _END], src, g.pp, "the bucket's names, shapes, dtypes (or: done)")
        for _, t in bucket:
            send(t.contiguous(), src, g.pp, "the bucket's tensors, to rank 0, which pushes them")
        if not bucket:
            return


def _pull_stage(src: int, group) -> Iterator[Tuple[str, torch.Tensor]]:
    """Rank 0: a later stage's tensors, bucket by bucket; the next bucket is asked for as soon as
    one arrives (one bucket in flight while this one is pushed)."""
    send_objects([_NEXT], src, group, "the first request to this stage")
    while True:
        metas = [None]
        recv_objects(metas, src, group, "the stage's next bucket: names, shapes, dtypes")
        if metas[0] is _END:
            return
        dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        bucket = []
        for name, shape, dtype in metas[0]:
            buf = torch.empty(shape, dtype=dtype, device=dev)
            recv(buf, src, group, "one tensor of the stage's bucket")
            bucket.append((name, buf))
        send_objects([_NEXT], src, group, "ask for the next bucket while this one is pushed")
        yield from bucket
        del bucket


def _send(name: str, t: torch.Tensor, dst: int, group) -> None:
    send_objects([(name, tuple(t.shape), t.dtype)], dst, group, "the tensor's name and shape")
    send(t.contiguous(), dst, group, "the tensor itself")


def _send_all(tensors, dst: int, group) -> None:
    for name, t in tensors:
        _send(name, t, dst, group)  # EP group: this rank's experts, to the stage's sender
    send_objects([None], dst, group, "end of this rank's experts")


def _receive(src: int, group, wait_s: float = EXPERT_WAIT_S) -> Iterator[Tuple[str, torch.Tensor]]:
    """Tensors from ``src`` (name and shape first) until its end marker; an error naming
    ``src`` if no announcement comes within ``wait_s``."""
    while True:
        meta = [None]
        why = f"the next expert tensor's name and shape from global rank {src} (None: the end)"
        recv_objects(meta, src, group, why, timeout_s=wait_s)
        if meta[0] is None:
            return
        name, shape, dtype = meta[0]
        dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        buf = torch.empty(shape, dtype=dtype, device=dev)
        recv(buf, src, group, "the tensor itself")
        yield name, buf
