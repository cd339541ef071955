"""Megatron distributed checkpoints of the model, written atomically, loadable at any TP/PP.

Why: ``dist_checkpointing`` stores each tensor with its global shape and shard offsets, so a
checkpoint written at one layout loads at another (TP1 → TP2, PP2, VPP…). We add atomicity: every
rank writes into ``<dir>.tmp``; only after a barrier does rank 0 rename it into place, so an
interrupted save never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Dict, List, Sequence

import torch
import torch.distributed as dist

from megatron_p3o.checkpoint.manifest import DAMAGED_SUFFIX, check_everywhere, write_manifest
from megatron_p3o.runtime import mcore_compat
from megatron_p3o.runtime.collectives import barrier
from megatron_p3o.runtime.errors import CheckpointError, OutputExistsError
from megatron_p3o.runtime.fields import check_ranges


@dataclass(frozen=True)
class CheckpointConfig:
    """Attributes: every (optimizer steps; 0 = only at the end), keep_last."""

    every: int = 50
    keep_last: int = 2

    RANGES: ClassVar[Dict[str, str]] = {"every": ">= 0", "keep_last": ">= 0"}

    def __post_init__(self):
        check_ranges(self, self.RANGES, "checkpoint")


DESCRIPTION_FILE = "model_description.json"


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def sharded_model_state(chunks: Sequence[torch.nn.Module], prefix: str = "") -> Dict[str, dict]:
    """``{"model0": ..., "model1": ...}``: each chunk's sharded state dict (global tensor keys,
    ``prefix`` before each: a second model in the same checkpoint, e.g. ``reference.``)."""
    name = prefix.rstrip(".") or "model"
    return {
        f"{name}{i}": _unwrap(c).sharded_state_dict(prefix=prefix) for i, c in enumerate(chunks)
    }


def _barrier():
    if dist.is_initialized():
        barrier(dist.group.WORLD, "every rank finished writing (or checking) the checkpoint")


def save_model_state(
    chunks: Sequence[torch.nn.Module],
    ckpt_dir: str | Path,
    extra_files: Dict[str, dict] | None = None,
    state: Dict | None = None,
    rank_payload: object = None,
    copy_dirs: Dict[str, Path] | None = None,
) -> Path:
    """Write a checkpoint to ``ckpt_dir`` atomically (all ranks call this).

    ``state``: more entries for the same dist checkpoint (sharded optimizer state, or plain
    objects such as the scheduler, stored once in common.pt). ``rank_payload``: a per-rank
    object (RNG states) written as ``rank/<global rank>.pt``. ``extra_files``: JSON files.
    ``copy_dirs``: directories copied in under the given names (the HF config and tokenizer,
    so that the checkpoint exports on its own); all of them are covered by the manifest.
    """
    from megatron.core import dist_checkpointing

    final = Path(ckpt_dir)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        if final.exists():
            raise OutputExistsError(
                f"checkpoint directory {final} already exists; refusing to overwrite"
            )
        shutil.rmtree(tmp, ignore_errors=True)
        # empty: Megatron warns "Overwriting old incomplete / corrupted checkpoint" on any content
        tmp.mkdir(parents=True)
    _barrier()
    sd = sharded_model_state(chunks) if state is None else state
    dist_checkpointing.save(sd, str(tmp))
    if rank_payload is not None:
        if rank == 0:
            (tmp / "rank").mkdir()
        _barrier()
    if rank_payload is not None:
        torch.save(rank_payload, tmp / "rank" / f"{rank}.pt")
    if rank == 0:
        for name, payload in (extra_files or {}).items():
            (tmp / name).write_text(json.dumps(payload, indent=2, sort_keys=True))
        for name, src in (copy_dirs or {}).items():
            shutil.copytree(src, tmp / name)
    _barrier()
    write_manifest(tmp)  # last: every file with its size and digest (see manifest)
    if rank == 0:
        os.replace(tmp, final)
    _barrier()
    return final


# Transformer Engine layers carry an ``_extra_state`` (FP8 scaling metadata) that the local spec,
# and so the converter's checkpoints, do not have: the only keys a load may find absent.
EXTRA_STATE = "_extra_state"


def load_sharded(request: dict, ckpt_dir: Path) -> dict:
    """``dist_checkpointing.load`` that tolerates a model's TE ``_extra_state`` missing from the
    checkpoint (a TE model loading a local-spec checkpoint); anything else missing, or a
    checkpoint of another model, is a :class:`CheckpointError`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling

    try:
        # "unexpected" = requested by the model but absent from the checkpoint
        loaded, _, absent = dist_checkpointing.load(
            request, str(ckpt_dir), strict=StrictHandling.RETURN_UNEXPECTED
        )
    except CheckpointingException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{ckpt_dir} does not match the model being loaded (another model or layout "
            f"description?): {first[:300]}"
        ) from e
    lacking = sorted(k for k in absent if EXTRA_STATE not in k)
    if lacking:
        raise CheckpointError(
            f"{ckpt_dir} lacks {len(lacking)} tensors the model needs, e.g. {lacking[:3]}"
        )
    return loaded


def load_into(chunk: torch.nn.Module, state: dict, ckpt_dir: Path) -> None:
    """``load_state_dict`` where only TE ``_extra_state`` entries may be absent (they keep the
    freshly initialised FP8 metadata)."""
    missing, unexpected = _unwrap(chunk).load_state_dict(state, strict=False)
    bad = [k for k in missing if not k.endswith(EXTRA_STATE)] + list(unexpected)
    if bad:
        raise CheckpointError(f"{ckpt_dir}: state does not fit the model: {bad[:3]}")


def load_model_state(
    chunks: Sequence[torch.nn.Module], ckpt_dir: str | Path, prefix: str = ""
) -> None:
    """Load a checkpoint written at any layout into this layout's chunks (all ranks call this);
    ``prefix``: the model saved under it (see :func:`sharded_model_state`)."""

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a Megatron distributed checkpoint (no metadata.json)"
        )
    request = sharded_model_state(chunks, prefix)
    loaded = load_sharded(request, ckpt_dir)
    for key, c in zip(request, chunks):
        state = {k[len(prefix) :]: v for k, v in loaded[key].items()}
        load_into(c, state, ckpt_dir)


# -- training checkpoints: model + optimizer + scheduler + trainer state + per-rank RNG --------

LATEST = "latest"
_STEP_DIR = re.compile(r"step_\d+")


def _rng_state() -> dict:
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(st: dict) -> None:
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    get_cuda_rng_tracker().set_states(st["tracker"])


def save_training_checkpoint(
    run_dir: str | Path,
    step: int,
    chunks,
    optimizer,
    scheduler,
    trainer_state: dict,
    keep_last: int = 2,
    extra: Dict | None = None,
    files: Dict[str, dict] | None = None,
    copy_dirs: Dict[str, Path] | None = None,
) -> Path:
    """``run_dir/checkpoints/step_NNNNNN`` (atomic), then the ``latest`` pointer (atomic), then
    pruning to the newest ``keep_last``. An interrupted save leaves ``latest`` on the previous
    one. ``extra``: more sharded entries (the reference model's weights, the R2PO head);
    ``files``: JSON files to keep in it (the recipe, the model description);
    ``copy_dirs``: directories to copy in (the HF config and tokenizer)."""
    root = Path(run_dir) / "checkpoints"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    model_sd = sharded_model_state(chunks)
    state = {
        **model_sd,
        "optimizer": mcore_compat.optimizer_sharded_state(optimizer, model_sd),
        "scheduler": scheduler.state_dict(),
        "trainer": dict(trainer_state, step=step),
        **(extra or {}),
    }
    try:
        final = save_model_state(
            chunks, root / f"step_{step:06d}", extra_files=files, state=state,
            rank_payload=_rng_state(), copy_dirs=copy_dirs,
        )  # fmt: skip
    except _WRITE_ERRORS as e:  # e.g. a full disk (torch DCP re-raises it on every rank)
        raise _save_failed(root, step, e) from None
    if rank == 0:
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(final.name)
        os.replace(tmp, root / LATEST)
        done = _step_dirs(root)  # complete ones: not .tmp, not .damaged (kept, not counted)
        for old in done[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _write_errors() -> tuple:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    return (OSError, RuntimeError, CheckpointException)


_WRITE_ERRORS = _write_errors()


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _save_failed(root: Path, step: int, err: BaseException) -> CheckpointError:
    """The one-line error of a failed save, after removing its partial ``.tmp`` directory (the
    previous checkpoint and ``latest`` were never touched)."""
    tmp = root / f"step_{step:06d}.tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    partial = _dir_bytes(tmp) if tmp.is_dir() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    done = _step_dirs(root)
    need = _dir_bytes(done[-1]) if done else partial
    free = shutil.disk_usage(root).free
    prev = f"{done[-1].name} and {LATEST} are intact" if done else "no earlier checkpoint"
    failures = getattr(err, "failures", None)  # torch DCP: {rank: the exception it raised}
    if failures:
        err = next(iter(failures.values()))
        err = getattr(err, "__cause__", None) or err
    why = str(err).splitlines()[0] if str(err) else type(err).__name__
    return CheckpointError(
        f"saving checkpoint step_{step:06d} in {root} failed ({why}); it needs about {need} "
        f"bytes and {free} are free there; {prev}"
    )


def _step_dirs(root: Path):
    """``step_NNNNNN`` directories under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name))


def checkpoint_candidates(root: Path) -> List[Path]:
    """The checkpoints under ``root`` in the order a resume tries them: ``latest``'s target
    (which may be missing), then every ``step_N`` directory, newest first."""
    pointer = root / LATEST
    latest = root / pointer.read_text().strip() if pointer.is_file() else None
    candidates = [latest] if latest is not None else []
    return candidates + [p for p in reversed(_step_dirs(root)) if p != latest]


def resumable_checkpoint(run_dir: str | Path, say=print) -> Path | None:
    """The checkpoint to resume from: ``latest`` if it verifies against its manifest, else the
    newest one that does (``say`` tells, in one line, which file was bad). A bad one is renamed
    ``<name>.damaged`` — kept, no longer counted by keep-last-N. None when there is none; one
    clear error when none verifies. All ranks call this (the digests are split over them)."""
    root = Path(run_dir) / "checkpoints"
    candidates = checkpoint_candidates(root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    problems = []
    for ck in candidates:
        bad = "missing" if not ck.is_dir() else check_everywhere(ck)
        if bad is None:
            if problems:
                say(f"checkpoint {problems[0]}; resuming from {ck.name} instead (the damaged "
                    f"one is kept as <name>{DAMAGED_SUFFIX})")  # fmt: skip
            return ck
        problems.append(f"{ck.name} is damaged ({bad})")
        if ck.is_dir():
            _barrier()
            if rank == 0:
                ck.rename(_free_name(ck.with_name(ck.name + DAMAGED_SUFFIX)))
            _barrier()
    if problems:
        raise CheckpointError(f"no checkpoint under {root} verifies: " + "; ".join(problems))
    return None


def _free_name(p: Path) -> Path:
    n, q = 1, p
    while q.exists():
        n += 1
        q = p.with_name(f"{p.name}{n}")
    return q


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    p = Path(run_dir) / "checkpoints" / LATEST
    if not p.is_file():
        return None
    ckpt = p.parent / p.read_text().strip()
    if not (ckpt / "metadata.json").is_file():
        raise CheckpointError(f"{p} points at {ckpt}, which is not a complete checkpoint")
    return ckpt


def finished_checkpoint(run_dir: str | Path, steps: int, evaluated: bool) -> Path | None:
    """The checkpoint of a finished run: ``latest`` is at ``steps`` or beyond, verifies against
    its manifest (a damaged one is not "finished": the resume falls back and trains again) and,
    when the run evaluates (``evaluated``), ``eval.jsonl`` holds its held-out accuracy at that
    step (a run stopped between its last save and its final evaluation is not finished). Else
    None. Every rank reads the whole checkpoint (no collective: no process group exists yet,
    and the ranks must agree)."""
    from megatron_p3o.checkpoint.manifest import check

    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not _STEP_DIR.fullmatch(name) or int(name[len("step_") :]) < steps:
        return None
    step = int(name[len("step_") :])
    if not (pointer.parent / name).is_dir() or check(pointer.parent / name) is not None:
        return None
    if evaluated:
        log = Path(run_dir) / "eval.jsonl"
        rows = [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []
        if not any(r.get("step") == step and "eval/heldout_accuracy" in r for r in rows):
            return None
    return pointer.parent / name


def load_training_checkpoint(ckpt: Path, chunks, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG; returns the trainer state."""
    from megatron.core import dist_checkpointing

    model_sd = sharded_model_state(chunks)
    request = {
        **model_sd,
        "optimizer": mcore_compat.optimizer_sharded_state(optimizer, model_sd, is_loading=True),
    }
    loaded = load_sharded(request, ckpt)
    for i, c in enumerate(chunks):
        load_into(c, loaded[f"model{i}"], Path(ckpt))
    optimizer.load_state_dict(loaded["optimizer"])
    mcore_compat.after_optimizer_load(optimizer)
    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    scheduler.load_state_dict(common["scheduler"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = Path(ckpt) / "rank" / f"{rank}.pt"
    if rng.is_file():  # a different world size cannot restore per-rank RNG: keep the fresh seeds
        _set_rng_state(torch.load(rng, weights_only=False))
    return dict(common["trainer"])
