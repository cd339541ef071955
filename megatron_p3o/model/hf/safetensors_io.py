"""Reading and writing HuggingFace checkpoint directories, one tensor at a time.

Why: conversion must stream (peak memory ≈ the largest tensor, not the model) and must fail with
a clear message on a missing shard, a wrong architecture or a wrong shape, and an interrupted
write must never leave a directory that looks complete (temp dir + rename).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_p3o.model.description import ModelDescription
from megatron_p3o.model.hf.mapping import MappingError, hf_shapes
from megatron_p3o.runtime.errors import InputFileError, OutputExistsError, UserError

WEIGHTS_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"
# everything a tokenizer / generation setup may need, copied verbatim on export
_AUX_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".tiktoken", ".py")
_NOT_AUX = {WEIGHTS_INDEX, "config.json"}


def _description(hf_dir: Path) -> ModelDescription:
    """The model description from ``config.json``; a file that is not JSON (or lacks a key
    every architecture has) is one line naming it, not a JSONDecodeError traceback."""
    try:
        return ModelDescription.from_hf_dir(hf_dir)
    except UserError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise InputFileError(
            f"{hf_dir / 'config.json'}: not a usable HF config ({type(e).__name__}: {e})"
        ) from None


def _weight_map(index: Path) -> Dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise InputFileError(
            f"{index}: not a safetensors index with a weight_map ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(weight_map, dict):
        raise InputFileError(f"{index}: weight_map is not a mapping of tensor -> file")
    return weight_map


@contextmanager
def _open(path: Path):
    """``safe_open`` whose failures (a truncated or corrupt file: ``SafetensorError``, which a
    later read can raise too) are one line naming the file."""
    try:
        with safe_open(path, framework="pt") as h:
            yield h
    except SafetensorError as e:
        raise InputFileError(f"{path}: not a readable safetensors file ({e})") from None


class HFCheckpointReader:
    """Lazily reads tensors of an HF directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            what = "is a file, not a directory" if self.dir.exists() else "does not exist"
            raise InputFileError(f"HF model directory {self.dir} {what}")
        self.description = _description(self.dir)
        index = self.dir / WEIGHTS_INDEX
        if index.is_file():
            weight_map = _weight_map(index)
        elif (self.dir / SINGLE_WEIGHTS).is_file():
            with _open(self.dir / SINGLE_WEIGHTS) as f:
                weight_map = {k: SINGLE_WEIGHTS for k in f.keys()}
        else:
            raise InputFileError(f"{self.dir}: neither {WEIGHTS_INDEX} nor {SINGLE_WEIGHTS} found")
        self.weight_map: Dict[str, str] = weight_map
        for fname in sorted(set(weight_map.values())):
            if not (self.dir / fname).is_file():
                missing = [k for k, v in weight_map.items() if v == fname][:3]
                raise InputFileError(
                    f"{self.dir}: shard file {fname} listed in {WEIGHTS_INDEX} is missing "
                    f"(holds e.g. {missing})"
                )

    def shape(self, name: str):
        with _open(self.dir / self.weight_map[name]) as h:
            return tuple(h.get_slice(name).get_shape())

    def dtype(self) -> torch.dtype:
        """The checkpoint's dtype, read from the safetensors header (no tensor is loaded)."""
        name = "model.embed_tokens.weight"
        if name not in self.weight_map:
            return torch.float32
        with _open(self.dir / self.weight_map[name]) as h:
            code = h.get_slice(name).get_dtype()
        return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(
            code, torch.float32
        )

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise MappingError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        # open per tensor and copy out: no file mapping outlives the tensor it served, so the
        # resident set stays about one tensor (a long-lived mapping keeps every page it touched)
        with _open(self.dir / self.weight_map[name]) as h:
            return h.get_tensor(name).clone()

    def validate(self) -> None:
        """Every tensor the architecture needs exists with the right shape (nothing loaded)."""
        desc = self.description
        want = hf_shapes(desc)
        for name, shape in want.items():
            if name not in self.weight_map:
                raise MappingError(f"{self.dir}: tensor {name} ({desc.architecture}) is missing")
            got = self.shape(name)
            if got != tuple(shape):
                raise MappingError(
                    f"{self.dir}: {name}: shape {got}, expected {tuple(shape)} (from config.json)"
                )
        extra = sorted(set(self.weight_map) - set(want) - {"lm_head.weight"})
        extra = [n for n in extra if not n.endswith("rotary_emb.inv_freq")]
        if extra:
            raise MappingError(f"{self.dir}: tensors not part of {desc.architecture}: {extra[:5]}")


def atomic_dir(out: str | Path):
    """Context manager: yields a temp dir next to ``out``; renamed to ``out`` on success only."""
    return _AtomicDir(Path(out))


class _AtomicDir:
    def __init__(self, out: Path):
        self.out = out

    def __enter__(self) -> Path:
        if self.out.exists():
            raise OutputExistsError(
                f"output directory {self.out} already exists; refusing to overwrite"
            )
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out.with_name(f".{self.out.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            os.replace(self.tmp, self.out)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


class HFShardedWriter:
    """Writes tensors into ``model-0000i-of-0000N.safetensors`` shards plus the index."""

    def __init__(self, out_dir: Path, max_shard_bytes: int = 2 * 2**30):
        self.dir, self.max = Path(out_dir), max_shard_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list = []  # (tmp name, tensor names)
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        fname = f"shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.dir / fname), metadata={"format": "pt"})
        self.files.append((fname, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.files)
        weight_map = {}
        for i, (tmp_name, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / tmp_name, self.dir / final)
            weight_map.update({k: final for k in names})
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.dir / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))


def copy_aux_files(src: Optional[Path], dst: Path) -> list:
    """Copy tokenizer / generation files (not weights, not config.json) from ``src``."""
    copied = []
    if src is None or not Path(src).is_dir():
        return copied
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and p.suffix in _AUX_SUFFIXES and p.name not in _NOT_AUX:
            shutil.copy2(p, dst / p.name)
            copied.append(p.name)
    return copied


def load_tokenizer(hf_dir: str | Path, what: str = "model.checkpoint"):
    """``AutoTokenizer.from_pretrained(hf_dir)``, with a missing directory or tokenizer files as
    one line naming the directory: transformers takes a missing path for a hub repo id and
    raises a 70-line OSError, and missing files for a slow-tokenizer conversion (sentencepiece)."""
    from transformers import AutoTokenizer

    d = Path(hf_dir)
    if not d.is_dir():
        raise InputFileError(f"{what}: tokenizer directory {d} does not exist")
    try:
        return AutoTokenizer.from_pretrained(d)
    except (OSError, ValueError) as e:
        raise InputFileError(
            f"{what}: no usable tokenizer in {d} (tokenizer.json / tokenizer_config.json; "
            f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]})"
        ) from None
