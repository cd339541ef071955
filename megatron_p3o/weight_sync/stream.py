"""Stream the full HF-named weights to global rank 0, stage after stage, without gathering the
model anywhere else (the push to a single SGLang server/router).

Why: the embedded engines need the weights on every rank (each rank has its own engine), but a
central server needs them once, on the one rank that talks to it. Each pipeline stage of the
first DP replica (DP = CP = 0) iterates its own layers (TP shards gathered inside the stage by
``iter_hf_tensors``); stage 0 yields straight to rank 0, later stages send tensor by tensor over
the pipeline group. Other DP/CP replicas hold the same weights and take no part — except under
expert parallelism, where the first replica holds only its share of the experts: the other
expert-parallel ranks of its EP groups send theirs to it (TP rank 0 to TP rank 0), and it
forwards them like its own.
"""

from __future__ import annotations

from typing import Iterator, Sequence, Tuple

import torch
import torch.distributed as dist

from ..model.description import ModelDescription
from ..parallel import ParallelGroups
from .export import is_expert, iter_hf_tensors


def iter_hf_tensors_to_rank0(
    chunks: Sequence[torch.nn.Module], groups: ParallelGroups, desc: ModelDescription
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
            dist.send_object_list([None], dst=dst, group=g.ep)
        return
    if not first:
        return
    sender = g.tp_rank == 0
    if g.pp_rank == 0:
        for name, t in _with_ep_peers(iter_hf_tensors(chunks, g, desc), g):
            if g.rank == 0:
                yield name, t
    else:
        dst = dist.get_global_rank(g.pp, 0)
        for name, t in _with_ep_peers(iter_hf_tensors(chunks, g, desc), g):
            if sender:
                # PP group: stage k's tensor (its name and shape first) to the first stage of this
                # pipeline — global rank 0 — which pushes it to the server.
                _send(name, t, dst, g.pp)
        if sender:
            dist.send_object_list([None], dst=dst, group=g.pp)  # end of this stage
    if g.rank == 0:
        for stage in range(1, g.layout.pp):
            yield from _receive(dist.get_global_rank(g.pp, stage), g.pp)


def _send(name: str, t: torch.Tensor, dst: int, group) -> None:
    dist.send_object_list([(name, tuple(t.shape), t.dtype)], dst=dst, group=group)
    dist.send(t.contiguous(), dst=dst, group=group)


def _receive(src: int, group) -> Iterator[Tuple[str, torch.Tensor]]:
    """Tensors from ``src`` (name and shape first) until its end marker."""
    while True:
        meta = [None]
        dist.recv_object_list(meta, src=src, group=group)
        if meta[0] is None:
            return
        name, shape, dtype = meta[0]
        dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        buf = torch.empty(shape, dtype=dtype, device=dev)
        dist.recv(buf, src=src, group=group)
        yield name, buf


def _ep_peer_of_first_replica(g: ParallelGroups) -> bool:
    """This rank is a non-zero EP rank whose EP group's rank 0 is in the first DP/CP replica
    (all ranks call this: one object gather over the EP group)."""
    flags: list = [None] * g.layout.ep
    # EP group: which members belong to the first replica (the one that pushes).
    dist.all_gather_object(flags, g.dp_rank == 0 and g.cp_rank == 0, group=g.ep)
    return g.ep_rank != 0 and bool(flags[0])


def _with_ep_peers(tensors, g: ParallelGroups):
    """A first-replica rank's tensors, then (TP rank 0) its EP peers' experts."""
    yield from tensors
    if g.layout.ep_enabled and g.tp_rank == 0 and g.ep_rank == 0:
        for peer in range(1, g.layout.ep):
            # EP group: the experts this replica lacks, from the rank that holds them.
            yield from _receive(dist.get_global_rank(g.ep, peer), g.ep)
