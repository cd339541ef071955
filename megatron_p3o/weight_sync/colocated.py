"""The colocated push's buckets, built on the trainer ranks that serve them, with tensor
collectives (no rank ever holds the whole model).

Why: a colocated server of TP size T shares the GPUs of trainer ranks 0…T−1; server rank r reads
CUDA-IPC handles of tensors on its own GPU, so trainer rank r needs each bucket on its GPU, one
bucket at a time. Gathering the full model on every rank (an object all-gather over PP and EP)
put ≈ 61 GB of Qwen3-30B-A3B on every GPU next to the training state, and pickled CUDA tensors
came back on the sender's device index.

How: every rank of the first DP/CP replica (and, under expert parallelism, the EP ranks that
hold the experts it lacks) walks its own stage's HF tensors (:func:`.export.iter_hf_tensors`:
TP shards gathered inside the stage) in lockstep, one tensor per step. At each step the rank that
owns each tensor (TP rank 0 of the first replica; for a routed expert, the EP rank holding it)
announces its name, shape and dtype over a gloo group, then broadcasts it over the default group;
receivers keep it on their own device, everyone else drops it. After a bucket's worth of bytes
the receivers hand the bucket out. Every rank runs the same steps, so the collectives line up.
Alive per rank: the tensor its stage gathered, and the bucket being built (the caller holds one
more: the bucket it is pushing).
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_p3o.runtime.collectives import all_gather_objects, broadcast
from megatron_p3o.weight_sync.export import is_expert, iter_hf_tensors
from megatron_p3o.weight_sync.stream import _ep_peer_of_first_replica

NamedTensors = List[Tuple[str, torch.Tensor]]


def iter_colocated_buckets(
    weights,
    objects,
    receivers: Sequence[int],
    bucket_bytes: int,
    transform: Optional[Callable[[NamedTensors], NamedTensors]] = None,
) -> Iterator[Optional[NamedTensors]]:
    """Every rank iterates (collective); one item per bucket on every rank: the bucket's
    ``(HF name, tensor on this rank's device)`` on ``receivers``, None elsewhere.

    ``weights``: a :class:`~.source.TrainerWeights`; ``objects``: a gloo group over every rank
    (the announcements); ``transform``: applied to each received tensor on the receivers (block
    FP8: :func:`~.fp8.quantize_named`)."""
    g = weights.groups
    first = g.dp_rank == 0 and g.cp_rank == 0
    ep_peer = _ep_peer_of_first_replica(g) if g.layout.ep_enabled else False
    walks = first or ep_peer
    mine = iter(iter_hf_tensors(weights.chunks, g, weights.desc)) if walks else iter(())
    receive = g.rank in set(receivers)
    bucket: NamedTensors = []
    size = 0
    while True:
        item = next(mine, None)
        owner = item is not None and g.tp_rank == 0 and (first or is_expert(item[0]))
        offer = (item[0], tuple(item[1].shape), item[1].dtype) if owner else None
        offers = all_gather_objects(offer, objects, "which tensors this step carries, and who "
                                    "holds them (every rank, gloo)")  # fmt: skip
        if all(o is None for o in offers):
            break
        for src, meta in enumerate(offers):
            if meta is None:
                continue
            name, shape, dtype = meta
            if src == g.rank:
                buf = item[1].detach().contiguous()
            else:
                buf = torch.empty(shape, dtype=dtype, device=g.device)
            broadcast(buf, src, g.world, "one full HF tensor from its holder to the ranks whose "
                      "GPUs serve the colocated server (the others drop it)")  # fmt: skip
            if receive:
                got = [(name, buf)]
                bucket += transform(got) if transform is not None else got
            size += buf.numel() * buf.element_size()
        item = None
        if size >= bucket_bytes:
            yield bucket if receive else None
            bucket, size = [], 0
    if size > 0:
        yield bucket if receive else None


def push_buffer_bytes(bucket_bytes: int, largest_tensor_bytes: int, step_bytes: int) -> int:
    """Peak bytes of a colocated push on a receiving rank, besides the training state: the
    bucket being pushed and the one being built (each up to ``bucket_bytes`` plus the last
    step's tensors, ``step_bytes``), and the tensor its own stage gathered."""
    return 2 * (bucket_bytes + step_bytes) + largest_tensor_bytes
