"""Megatron distributed checkpoints of the model, written atomically, loadable at any TP/PP.

Why: ``dist_checkpointing`` stores each tensor with its global shape and shard offsets, so a
checkpoint written at one layout loads at another (TP1 → TP2, PP2, VPP…). We add atomicity: every
rank writes into ``<dir>.tmp``; only after a barrier does rank 0 rename it into place, so an
interrupted save never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Sequence

import torch
import torch.distributed as dist

DESCRIPTION_FILE = "model_description.json"


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def sharded_model_state(chunks: Sequence[torch.nn.Module]) -> Dict[str, dict]:
    """``{"model0": ..., "model1": ...}``: each chunk's sharded state dict (global tensor keys)."""
    return {f"model{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _barrier():
    if dist.is_initialized():
        # World: every rank must have finished writing (or checking) before anyone moves on.
        dist.barrier()


def save_model_state(chunks: Sequence[torch.nn.Module], ckpt_dir: str | Path,
                     extra_files: Dict[str, dict] | None = None) -> Path:
    """Write the model's sharded state to ``ckpt_dir`` atomically (all ranks call this)."""
    from megatron.core import dist_checkpointing

    final = Path(ckpt_dir)
    tmp = final.with_name(final.name + ".tmp")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        if final.exists():
            raise FileExistsError(f"checkpoint directory {final} already exists; refusing to overwrite")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(sharded_model_state(chunks), str(tmp))
    if rank0:
        for name, payload in (extra_files or {}).items():
            (tmp / name).write_text(json.dumps(payload, indent=2, sort_keys=True))
    _barrier()
    if rank0:
        os.replace(tmp, final)
    _barrier()
    return final


def load_model_state(chunks: Sequence[torch.nn.Module], ckpt_dir: str | Path) -> None:
    """Load a checkpoint written at any layout into this layout's chunks (all ranks call this)."""
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not a Megatron distributed checkpoint (no metadata.json)")
    loaded = dist_checkpointing.load(sharded_model_state(chunks), str(ckpt_dir))
    for i, c in enumerate(chunks):
        _unwrap(c).load_state_dict(loaded[f"model{i}"], strict=True)
