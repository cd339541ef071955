"""Stream the full HF-named weights to global rank 0, stage after stage, without gathering the
model anywhere else (the push to a single SGLang server/router).

Why: the embedded engines need the weights on every rank (each rank has its own engine), but a
central server needs them once, on the one rank that talks to it. Each pipeline stage of the
first DP replica (DP = CP = 0) iterates its own layers (TP shards gathered inside the stage by
``iter_hf_tensors``); stage 0 yields straight to rank 0, later stages send tensor by tensor over
the pipeline group. Other DP/CP replicas hold the same weights and take no part.
"""

from __future__ import annotations

from typing import Iterator, Sequence, Tuple

import torch
import torch.distributed as dist

from ..model.description import ModelDescription
from ..parallel import ParallelGroups
from .export import iter_hf_tensors


def iter_hf_tensors_to_rank0(
    chunks: Sequence[torch.nn.Module], groups: ParallelGroups, desc: ModelDescription
) -> Iterator[Tuple[str, torch.Tensor]]:
    """On global rank 0: every (HF name, full tensor) of the model. Elsewhere: nothing (but every
    rank of the first DP/CP replica must iterate it: the TP gathers and sends are collectives)."""
    g = groups
    if g.dp_rank != 0 or g.cp_rank != 0:
        return
    sender = g.tp_rank == 0
    if g.pp_rank == 0:
        for name, t in iter_hf_tensors(chunks, g, desc):
            if g.rank == 0:
                yield name, t
    else:
        dst = dist.get_global_rank(g.pp, 0)
        for name, t in iter_hf_tensors(chunks, g, desc):
            if sender:
                # PP group: stage k's tensor (its name and shape first) to the first stage of this
                # pipeline — global rank 0 — which pushes it to the server.
                dist.send_object_list([(name, tuple(t.shape), t.dtype)], dst=dst, group=g.pp)
                dist.send(t.contiguous(), dst=dst, group=g.pp)
        if sender:
            dist.send_object_list([None], dst=dst, group=g.pp)  # end of this stage
    if g.rank == 0:
        for stage in range(1, g.layout.pp):
            src = dist.get_global_rank(g.pp, stage)
            while True:
                meta = [None]
                dist.recv_object_list(meta, src=src, group=g.pp)
                if meta[0] is None:
                    break
                name, shape, dtype = meta[0]
                buf = torch.empty(
                    shape,
                    dtype=dtype,
                    device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu",
                )
                dist.recv(buf, src=src, group=g.pp)
                yield name, buf
