"""Stream tensors into and out of Megatron distributed checkpoints without building the model.

Why: a 70B model does not fit in one converter process, and conversion should need memory for
about one tensor. Writing: the model is built on the ``meta`` device (shapes only), Megatron's
own ``sharded_state_dict`` names every checkpoint chunk, and Megatron's ``dist_checkpointing.save``
runs with a save strategy whose planner materializes each chunk only when the writer asks for it
(one file per chunk, so nothing accumulates). Reading: per-layer ``dist_checkpointing.load`` calls
with ShardedTensors covering one layer at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from megatron_p3o.model.description import ModelDescription
from megatron_p3o.model.hf.mapping import (
    EXPERT_KEY,
    TensorMap,
    expert_canonical,
    split_layer,
    tensor_maps,
)
from megatron_p3o.runtime.errors import CheckpointError

P3O_META_FILE = "p3o_model.json"  # the model description and vocab padding, next to the weights

# (canonical Megatron name) -> full TP=1 tensor
TensorSource = Callable[[TensorMap], torch.Tensor]


def meta_dict(
    desc: ModelDescription,
    padded_vocab: int,
    divisible_by: int,
    dtype: torch.dtype,
    source: Optional[str] = None,
) -> dict:
    """The content of :data:`P3O_META_FILE`: what a reader needs besides the tensors (the model
    description, the padded vocabulary of the stored embedding, the weights' dtype). The
    converter and every training checkpoint write it, so both export the same way."""
    return {
        "description": desc.to_dict(),
        "padded_vocab_size": padded_vocab,
        "make_vocab_size_divisible_by": divisible_by,
        "params_dtype": str(dtype).replace("torch.", ""),
        "source": source,
    }


def write_meta(
    ckpt_dir: Path,
    desc: ModelDescription,
    padded_vocab: int,
    divisible_by: int,
    dtype: torch.dtype,
    source: Optional[str] = None,
) -> None:
    meta = meta_dict(desc, padded_vocab, divisible_by, dtype, source)
    (Path(ckpt_dir) / P3O_META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))


def read_meta(ckpt_dir: str | Path) -> dict:
    if not Path(ckpt_dir).is_dir():  # a typo is not "not a checkpoint": say what it is
        from megatron_p3o.runtime.errors import InputFileError

        what = "is a file, not a directory" if Path(ckpt_dir).exists() else "does not exist"
        raise InputFileError(f"checkpoint directory {ckpt_dir} {what}")
    p = Path(ckpt_dir) / P3O_META_FILE
    if not p.is_file():
        raise CheckpointError(
            f"{ckpt_dir}: no {P3O_META_FILE}; not a checkpoint written by megatron_p3o "
            "(convert it with checkpoints_convert.hf_to_megatron)"
        )
    try:  # a torn copy or a hand edit: one line naming the file, not a JSONDecodeError
        meta = json.loads(p.read_text())
        meta["description"] = ModelDescription.from_dict(meta["description"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{p}: unreadable ({type(e).__name__}: {e})") from None
    return meta


def _chunk_resolver(desc: ModelDescription, source: TensorSource, dtype: torch.dtype):
    by_name = {tm.mcore: tm for tm in tensor_maps(desc)}
    cache: Dict[str, torch.Tensor] = {}

    def resolve(key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        layered = key.startswith("decoder.layers.")
        expert = key.startswith("decoder.layers." + EXPERT_KEY)  # axes: layer, expert
        if expert:
            name = expert_canonical(key, offsets[0], offsets[1])
            offsets, sizes = offsets[2:], sizes[2:]
        elif layered:
            name = key.replace("decoder.layers.", f"decoder.layers.{offsets[0]}.", 1)
            offsets, sizes = offsets[1:], sizes[1:]
        else:
            name = key
        if name not in cache:
            cache.clear()  # chunks of one tensor arrive together (fc1: gate, then up)
            tm = by_name.get(name)
            if tm is None:
                raise KeyError(f"checkpoint chunk {key} has no HF mapping")
            cache[name] = source(tm).to(dtype)
        full = cache[name]
        idx = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        out = full[idx].contiguous()
        if expert:
            return out[None, None]
        return out.unsqueeze(0) if layered else out

    return resolve


def _streaming_strategy(resolve):
    """A Megatron save strategy that writes torch_dist checkpoints from lazily made chunks."""
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazyPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            chunk = write_item.tensor_data.chunk
            return resolve(write_item.index.fqn, list(chunk.offsets), list(chunk.sizes))

    class StreamingSave(SaveShardedStrategy):
        def __init__(self):
            super().__init__("torch_dist", 1)

        @property
        def can_handle_sharded_objects(self):
            return True

        def save(self, sharded_state_dict, checkpoint_dir):
            sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt = mcore_to_pyt_state_dict(sd, False)
            # one file per chunk and no read-ahead: the writer never holds two chunks at once
            writer = FileSystemWriter(
                str(checkpoint_dir),
                single_file_per_rank=False,
                thread_count=1,
                per_thread_copy_ahead=0,
            )
            dcp_save(
                pyt,
                storage_writer=writer,
                planner=LazyPlanner(flatten_state_dict=False, dedup_replicated_tensors=False),
            )

    return StreamingSave()


def build_meta_model(desc: ModelDescription, groups, dtype: torch.dtype, divisible_by: int):
    """The TP=1 GPTModel on the meta device: names and shapes, no memory."""
    from megatron_p3o.model.builder import BuildOptions, build_model

    opts = BuildOptions(
        params_dtype=dtype,
        make_vocab_size_divisible_by=divisible_by,
        seq_length=min(desc.max_position_embeddings, 4096),
        use_te=False,
    )
    with torch.device("meta"):
        (model,) = build_model(desc, groups, opts)
    return model


def write_checkpoint(
    desc: ModelDescription,
    groups,
    source: TensorSource,
    ckpt_dir: Path,
    dtype: torch.dtype,
    divisible_by: int,
) -> int:
    """Write a Megatron dist checkpoint (loadable at any TP/PP) from ``source``; returns chunks."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    model = build_meta_model(desc, groups, dtype, divisible_by)
    resolve = _chunk_resolver(desc, source, dtype)
    calls = {"n": 0}
    failure: list = []

    def counted(key, offsets, sizes):
        calls["n"] += 1
        try:
            return resolve(key, offsets, sizes)
        except Exception as e:
            failure.append(e)
            raise

    try:
        dist_checkpointing.save(
            {"model0": model.sharded_state_dict()},
            str(ckpt_dir),
            sharded_strategy=_streaming_strategy(counted),
        )
    except CheckpointException as e:  # a BaseException that wraps the real cause
        if failure:
            raise failure[0] from None
        raise RuntimeError(f"writing the checkpoint to {ckpt_dir} failed: {e}") from None
    write_meta(ckpt_dir, desc, model.padded_vocab_size, divisible_by, dtype)
    return calls["n"]


def read_checkpoint(
    ckpt_dir: str | Path, meta: Optional[dict] = None
) -> Iterator[Tuple[TensorMap, torch.Tensor]]:
    """Yield (TensorMap, full TP=1 tensor) from a dist checkpoint, one layer's tensors at a time;
    ``meta``: its :func:`read_meta` (default: the checkpoint's own)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    meta = meta or read_meta(ckpt_dir)
    desc: ModelDescription = meta["description"]
    dtype = getattr(torch, meta["params_dtype"])
    from megatron_p3o.model.hf.mapping import mcore_shape

    groups: Dict[Optional[int], list] = {}
    for tm in tensor_maps(desc):
        groups.setdefault(tm.layer, []).append(tm)
    order = [None] + list(range(desc.num_layers))
    for layer in order:
        tms = groups.get(layer, [])
        if not tms:
            continue
        request = {}
        for tm in tms:
            key, li = split_layer(tm.mcore)
            shape = mcore_shape(tm, desc, meta["padded_vocab_size"])
            buf = torch.empty(shape, dtype=dtype)
            if li is None:
                request[tm.mcore] = ShardedTensor.from_rank_offsets(key, buf, replica_id=0)
            elif tm.expert is not None:  # axes: layer, expert
                request[tm.mcore] = ShardedTensor.from_rank_offsets(
                    key, buf[None, None], (0, li, desc.num_layers),
                    (1, tm.expert, desc.num_experts), replica_id=0,
                )  # fmt: skip
            else:
                request[tm.mcore] = ShardedTensor.from_rank_offsets(
                    key, buf.unsqueeze(0), (0, li, desc.num_layers), replica_id=0
                )
        # one layer at a time: the request deliberately covers only part of each tensor
        loaded = dist_checkpointing.load(request, str(ckpt_dir), validate_access_integrity=False)
        for tm in tms:
            t = loaded[tm.mcore]
            if tm.expert is not None:
                t = t[0]
            yield tm, (t[0] if tm.layer is not None else t)
