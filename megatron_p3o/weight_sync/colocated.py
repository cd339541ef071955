"""The colocated push's buckets, built on the trainer ranks that serve them, with tensor
collectives (no rank ever holds the whole model).

Why: a colocated server of TP size T shares the GPUs of trainer ranks 0…T−1 (the receivers);
server rank r reads CUDA-IPC handles of tensors on its own GPU, so trainer rank r needs each
bucket on its GPU, one bucket at a time. Gathering the full model on every rank put ≈ 61 GB of
Qwen3-30B-A3B on every GPU next to the training state; announcing and broadcasting tensor by
tensor over the whole world took two world-wide rounds per tensor (≈ 19k per push of that
model at EP 1).

How: a :class:`ColocatedPlan`, made once per run from one object all-gather, lists what each
rank speaks for — the dense tensors of its stage (TP rank 0 of the first DP/CP replica) or the
routed experts of its EP rank (:attr:`~megatron_p3o.runtime.parallel.ParallelGroups.owns_experts`:
expert-TP rank 0 of the first expert-data-parallel replica, which is not always a dense TP rank
0) — with names, shapes and dtypes read off the parameters (meta tensors: no collective), and
cuts each owner's tensors into buckets. Every rank then walks the plan in the same order: the
owner's TP (or expert-TP) group gathers the bucket's tensors (:func:`.export.iter_hf_tensors`),
and the owner broadcasts them as one flat byte buffer to the receivers, over a process group of
just those ranks (made once per run). One collective round per bucket, on the ranks that need
it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_p3o.model.hf.mapping import parse_moe_hf_name
from megatron_p3o.runtime.collectives import all_gather_objects, broadcast
from megatron_p3o.weight_sync.export import hf_layout, iter_hf_tensors

NamedTensors = List[Tuple[str, torch.Tensor]]
Meta = Tuple[str, Tuple[int, ...], torch.dtype]
_ALIGN = 16  # bytes: each tensor's offset in a flat bucket (any dtype can be viewed there)


def _nbytes(meta: Meta) -> int:
    n = meta[2].itemsize
    for d in meta[1]:
        n *= d
    return n


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Segment:
    """One owner's tensors of one part, cut into buckets.

    owner: the global rank that speaks for them; part: "dense" or "experts"; walkers: the
    global ranks that gather them with it (its TP or expert-TP group); buckets: each bucket's
    (name, shape, dtype); group_ranks: the broadcast's ranks (the owner and the receivers),
    empty when the owner is the only receiver."""

    owner: int
    part: str
    walkers: Tuple[int, ...]
    buckets: Tuple[Tuple[Meta, ...], ...]
    group_ranks: Tuple[int, ...]


class ColocatedPlan:
    """Who sends what to the receivers, fixed for a run (the model's shapes do not change)."""

    def __init__(self, segments: List[Segment], receivers: Sequence[int], groups: dict):
        self.segments, self.receivers, self._groups = segments, tuple(receivers), groups

    @classmethod
    def build(cls, weights, objects, receivers: Sequence[int], bucket_bytes: int):
        """Collective over ``objects`` (a gloo group of every rank): one all-gather of every
        rank's owned (name, shape, dtype) lists, then one new process group per distinct set of
        broadcast ranks (every rank creates them, in the same order)."""
        g, desc = weights.groups, weights.desc
        first = g.dp_rank == 0 and g.cp_rank == 0
        mine = {"rank": g.rank}
        if first and g.tp_rank == 0:
            mine["dense"] = hf_layout(weights.chunks, g, desc, part="dense")
            mine["dense_walkers"] = tuple(dist.get_process_group_ranks(g.tp))
        if desc.is_moe and g.owns_experts:
            mine["experts"] = hf_layout(weights.chunks, g, desc, part="experts")
            mine["expert_walkers"] = tuple(dist.get_process_group_ranks(g.expt_tp))
        infos = all_gather_objects(mine, objects, "what each rank speaks for in a colocated "
                                   "push: names, shapes, dtypes (once per run)")  # fmt: skip
        if desc.is_moe:
            _check_experts(infos, desc)
        rec = set(receivers)
        segments = []
        for part in ("dense", "experts"):
            for info in infos:
                if part not in info:
                    continue
                walkers = info["dense_walkers" if part == "dense" else "expert_walkers"]
                # every receiver takes the owner's bytes, its TP peers too: one source of truth
                # for what TP ranks each hold a copy of (norms, routers)
                members = sorted({info["rank"]} | rec)
                segments.append(
                    Segment(
                        owner=info["rank"],
                        part=part,
                        walkers=walkers,
                        buckets=_cut(info[part], bucket_bytes),
                        group_ranks=tuple(members) if len(members) > 1 else (),
                    )
                )
        made: Dict[Tuple[int, ...], object] = {}
        for seg in segments:  # the same order on every rank: new_group is collective
            if seg.group_ranks and seg.group_ranks not in made:
                made[seg.group_ranks] = dist.new_group(list(seg.group_ranks))
        return cls(segments, receivers, made)

    @property
    def rounds(self) -> int:
        """Broadcasts one push takes (the TP gathers inside a stage come on top)."""
        return sum(len(s.buckets) for s in self.segments if s.group_ranks)

    def buckets(
        self,
        weights,
        transform: Optional[Callable[[NamedTensors], NamedTensors]] = None,
    ) -> Iterator[Optional[NamedTensors]]:
        """Every rank iterates (collective); one item per bucket of the plan on every rank: the
        bucket's ``(HF name, tensor on this rank's device)`` on the receivers (``transform``
        applied there: block FP8, :func:`~.fp8.quantize_named`), None elsewhere."""
        g = weights.groups
        receive = g.rank in self.receivers
        params = {p.untyped_storage().data_ptr() for c in weights.chunks for p in c.parameters()}
        for seg in self.segments:
            walk = g.rank in seg.walkers
            mine = (
                iter(iter_hf_tensors(weights.chunks, g, weights.desc, seg.part)) if walk else None
            )
            for metas in seg.buckets:
                local = _take(mine, metas, g.rank, params) if walk else None
                named = local if receive and walk else None  # the owner (no one else to send)
                if g.rank in seg.group_ranks:
                    group = self._groups[seg.group_ranks]
                    named = _broadcast_bucket(local, metas, seg.owner, group, g.device)
                if not receive:
                    yield None
                    continue
                yield transform(named) if transform is not None else named
            if walk and next(mine, None) is not None:
                raise RuntimeError(
                    f"rank {g.rank}: {seg.part} tensors beyond the colocated plan of rank "
                    f"{seg.owner} (the model changed after the plan was made)"
                )


def _cut(metas: List[Meta], bucket_bytes: int) -> Tuple[Tuple[Meta, ...], ...]:
    out, cur, size = [], [], 0
    for m in metas:
        cur.append(m)
        size += _padded(_nbytes(m))
        if size >= bucket_bytes:
            out.append(tuple(cur))
            cur, size = [], 0
    if cur:
        out.append(tuple(cur))
    return tuple(out)


def _take(mine: Iterator, metas: Sequence[Meta], rank: int, params=frozenset()) -> NamedTensors:
    """The walk's next ``len(metas)`` tensors, checked against the plan; a tensor that is a
    parameter's own storage (TP = 1, same dtype: the export's view, ``.contiguous()`` copies
    nothing) is copied — shared over CUDA IPC, torch keeps a sent-data record per never-freed
    storage, and past its event limit every share synchronises (issue 63, item 3)."""
    got = []
    for name, shape, dtype in metas:
        item = next(mine, None)
        if item is None or item[0] != name or tuple(item[1].shape) != shape:
            have = None if item is None else (item[0], tuple(item[1].shape))
            raise RuntimeError(
                f"rank {rank}: the colocated plan expects {name} {shape} next, the model gives "
                f"{have}"
            )
        t = item[1].detach().to(dtype).contiguous()
        if t.untyped_storage().data_ptr() in params:
            t = t.clone()
        got.append((name, t))
    return got


def _broadcast_bucket(local, metas, owner: int, group, device) -> NamedTensors:
    """The owner's bucket on every rank of ``group``, as one flat byte buffer."""
    sizes = [_nbytes(m) for m in metas]
    total = sum(_padded(n) for n in sizes)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += _padded(n)
    if local is not None and dist.get_rank() == owner:
        for (_, t), off, n in zip(local, offsets, sizes):
            flat[off : off + n].copy_(t.reshape(-1).view(torch.uint8))
    broadcast(flat, owner, group, "one bucket of the colocated push, from the rank that holds "
              "it to the server's GPUs that did not gather it")  # fmt: skip
    if local is not None and dist.get_rank() == owner:
        return local
    return [
        (name, flat[off : off + n].view(dtype).view(shape))
        for (name, shape, dtype), off, n in zip(metas, offsets, sizes)
    ]


def _check_experts(infos: List[dict], desc) -> None:
    """Every routed expert of every layer spoken for exactly once: a missing owner would leave
    the server's copy of those experts as whatever the memory held after a release."""
    seen: Dict[Tuple[int, str], List[int]] = defaultdict(list)
    for info in infos:
        for name, _, _ in info.get("experts", ()):
            layer, expert, role = parse_moe_hf_name(name)
            seen[(layer, role)].append(expert)
    want = list(range(desc.num_experts))
    for layer in range(desc.num_layers):
        for role in ("gate", "up", "down"):
            got = sorted(seen.get((layer, role), []))
            if got != want:
                missing = sorted(set(want) - set(got))
                raise RuntimeError(
                    f"colocated push: layer {layer} {role} experts {missing or got} are spoken "
                    "for by no rank (or by several)"
                )


def push_buffer_bytes(bucket_bytes: int, largest_tensor_bytes: int) -> int:
    """Peak bytes of a colocated push on a receiving rank, besides the training state: the
    bucket being pushed, the one being built, and (on the rank that owns it) its flat copy for
    the broadcast — each up to ``bucket_bytes`` plus one more tensor."""
    return 3 * (bucket_bytes + largest_tensor_bytes)
