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
the other expert-parallel ranks of its EP groups send theirs to it (TP rank 0 to TP rank 0), and it
forwards them like its own.
"""

from __future__ import annotations

from typing import Iterator, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_p3o.model.description import ModelDescription
from megatron_p3o.runtime.collectives import (
    all_gather_objects,
    recv,
    recv_objects,
    send,
    send_objects,
)
from megatron_p3o.runtime.parallel import ParallelGroups
from megatron_p3o.weight_sync.export import is_expert, iter_hf_tensors

STREAM_BUCKET_BYTES = 256 * 2**20  # a later stage's bytes per request of rank 0
_NEXT, _END = "next", None


def iter_hf_tensors_to_rank0(
    chunks: Sequence[torch.nn.Module],
    groups: ParallelGroups,
    desc: ModelDescription,
    bucket_bytes: int = STREAM_BUCKET_BYTES,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """On global rank 0: every (HF name, full tensor) of the model. Elsewhere: nothing (but every
    rank of the first DP/CP replica must iterate it: the TP gathers and sends are collectives)."""
    g = groups
    first = g.dp_rank == 0 and g.cp_rank == 0
    ep_peer = _ep_peer_of_first_replica(g) if g.layout.ep_enabled else False
    if ep_peer:  # another EP rank of a first-replica rank: send it this rank's experts
        dst = dist.get_global_rank(g.ep, 0)
        for name, t in iter_hf_tensors(chunks, g, desc):
            if g.tp_rank == 0 and is_expert(name):
                _send(name, t, dst, g.ep)  # EP group: this rank's experts, to the first replica
        if g.tp_rank == 0:
            send_objects([None], dst, g.ep, "end of this rank's experts")
        return
    if not first:
        return
    sender = g.tp_rank == 0
    if g.pp_rank == 0:
        for name, t in _with_ep_peers(iter_hf_tensors(chunks, g, desc), g):
            if g.rank == 0:
                yield name, t
    elif sender:
        _serve_stage(_with_ep_peers(iter_hf_tensors(chunks, g, desc), g), g, bucket_bytes)
    else:  # a TP peer of a later stage: its gathers pace themselves on the sender's
        for _ in iter_hf_tensors(chunks, g, desc):
            pass
    if g.rank == 0:
        for stage in range(1, g.layout.pp):
            yield from _pull_stage(dist.get_global_rank(g.pp, stage), g.pp)


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


def _receive(src: int, group) -> Iterator[Tuple[str, torch.Tensor]]:
    """Tensors from ``src`` (name and shape first) until its end marker."""
    while True:
        meta = [None]
        recv_objects(meta, src, group, "the next tensor's name and shape (None: the end)")
        if meta[0] is None:
            return
        name, shape, dtype = meta[0]
        dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        buf = torch.empty(shape, dtype=dtype, device=dev)
        recv(buf, src, group, "the tensor itself")
        yield name, buf


def _ep_peer_of_first_replica(g: ParallelGroups) -> bool:
    """This rank is a non-zero EP rank whose EP group's rank 0 is in the first DP/CP replica
    (all ranks call this: one object gather over the EP group)."""
    flags = all_gather_objects(
        g.dp_rank == 0 and g.cp_rank == 0,
        g.ep,
        "which EP members belong to the first replica (it pushes)",
    )
    return g.ep_rank != 0 and bool(flags[0])


def _with_ep_peers(tensors, g: ParallelGroups):
    """A first-replica rank's tensors, then (TP rank 0) its EP peers' experts."""
    yield from tensors
    if g.layout.ep_enabled and g.tp_rank == 0 and g.ep_rank == 0:
        for peer in range(1, g.layout.ep):
            # EP group: the experts this replica lacks, from the rank that holds them.
            yield from _receive(dist.get_global_rank(g.ep, peer), g.ep)
