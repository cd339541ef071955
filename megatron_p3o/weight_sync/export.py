"""Live export: full HF-named tensors from a TP/PP-sharded Megatron model, in byte buckets.

Why: the rollout engine (SGLang or the embedded one) holds an HF-layout model; after each
optimizer step (or every L steps) the trainer pushes its weights there. TP shards are gathered
over the TP group; each pipeline stage yields only its own layers (global layer numbers), so the
stages can push in parallel. Names, fusions and padding follow :mod:`megatron_p3o.model.hf.mapping`,
the same table the checkpoint converters use.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, List, Literal, Sequence, Tuple

import torch

from megatron_p3o.model.description import ModelDescription
from megatron_p3o.model.hf.mapping import (
    TensorMap,
    canonical_name,
    parse_moe_hf_name,
    tensor_maps,
    to_hf,
)
from megatron_p3o.runtime.collectives import all_gather_into
from megatron_p3o.runtime.mcore_compat import unwrap
from megatron_p3o.runtime.parallel import ParallelGroups

_LOCAL_LAYER = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.")


def _gather_tp(local: torch.Tensor, tm: TensorMap, groups: ParallelGroups) -> torch.Tensor:
    """The TP=1 tensor from this rank's shard (a routed expert's: over the expert-TP group)."""
    expert = tm.expert is not None
    tp = groups.layout.etp if expert else groups.layout.tp
    if tm.tp_dim is None or tp == 1:
        return local.detach()
    parts = [torch.empty_like(local) for _ in range(tp)]
    all_gather_into(
        parts,
        local.detach().contiguous(),
        groups.expt_tp if expert else groups.tp,
        "every TP (expert-TP) rank holds one slice; the engine needs it whole",
    )
    if local.is_cuda:  # the host waits for the gather: a rank cannot queue the next ones
        torch.cuda.current_stream().synchronize()  # ahead of its peers (nor their buffers)
    if tm.kind == "fc1":  # each shard is [gate_r; up_r]
        halves = [p.chunk(2, 0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(parts, tm.tp_dim)


Part = Literal["all", "dense", "experts"]


def _stage_params(
    chunks: Sequence[torch.nn.Module], groups: ParallelGroups, desc: ModelDescription, part: Part
) -> Iterator[Tuple[TensorMap, torch.nn.Parameter]]:
    """(table entry, live parameter) of this pipeline stage, in export order; ``part``: every
    parameter, the dense ones (TP-sharded, held by every DP replica) or the routed experts'
    (expert-TP-sharded, held by one EP rank's expert-data-parallel replicas)."""
    by_name: Dict[str, TensorMap] = {tm.mcore: tm for tm in tensor_maps(desc)}
    first_expert = groups.ep_rank * (desc.num_experts // groups.layout.ep) if desc.is_moe else 0
    for chunk in chunks:
        model = unwrap(chunk)
        numbers = {}
        for i, layer in enumerate(getattr(model.decoder, "layers", [])):
            numbers[i] = layer.layer_number - 1  # global, 0-based
        for name, param in model.named_parameters():
            if desc.tie_word_embeddings and name.startswith("output_layer."):
                continue
            m = _LOCAL_LAYER.match(name)
            if m:
                local = int(m.group(1))
                name = canonical_name(name, numbers[local] - local, first_expert, moe=desc.is_moe)
            else:
                name = canonical_name(name, moe=desc.is_moe)
            tm = by_name.get(name)
            if tm is None:
                raise KeyError(f"parameter {name} has no HF mapping for {desc.architecture}")
            if part == "all" or (part == "experts") == (tm.expert is not None):
                yield tm, param


def iter_hf_tensors(
    chunks: Sequence[torch.nn.Module],
    groups: ParallelGroups,
    desc: ModelDescription,
    part: Part = "all",
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the parameters this pipeline stage holds.

    Every TP rank of the stage must iterate (the gathers are collectives: over the TP group for
    dense parameters, over the expert-TP group for routed experts); every rank then holds the
    same full tensors. Tied output layers are skipped (the embedding is exported). Under expert
    parallelism a rank yields only its own experts (global expert numbers; see
    :func:`is_expert`).
    """
    for tm, param in _stage_params(chunks, groups, desc, part):
        full = _gather_tp(param, tm, groups)
        yield from to_hf(tm, full, desc).items()


def hf_layout(
    chunks: Sequence[torch.nn.Module],
    groups: ParallelGroups,
    desc: ModelDescription,
    part: Part = "all",
) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    """(HF name, shape, dtype) of what :func:`iter_hf_tensors` yields here, in its order,
    without a collective or a copy (meta tensors through the same mapping)."""
    out = []
    for tm, param in _stage_params(chunks, groups, desc, part):
        shape = list(param.shape)
        if tm.tp_dim is not None:
            shape[tm.tp_dim] *= groups.layout.etp if tm.expert is not None else groups.layout.tp
        meta = torch.empty(shape, dtype=param.dtype, device="meta")
        out += [(n, tuple(t.shape), t.dtype) for n, t in to_hf(tm, meta, desc).items()]
    return out


def is_expert(hf_name: str) -> bool:
    """An HF tensor of one routed expert (held by one expert-parallel rank)."""
    moe = parse_moe_hf_name(hf_name)
    return moe is not None and moe[1] is not None


def iter_hf_buckets(
    tensors: Iterator[Tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (a larger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: List[Tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors:
        if dtype is not None:
            t = t.to(dtype)
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket
