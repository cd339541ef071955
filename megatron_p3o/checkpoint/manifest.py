"""Checkpoint manifests: every file of a checkpoint with its size and BLAKE2b digest, written
last (just before the atomic rename), and verified before a run resumes from it.

Why: the rename makes a save all-or-nothing, but files can still be torn or corrupted later
(a full or failing filesystem, a copy cut short, bit rot, a file deleted by hand). Resuming from
such a checkpoint either crashes deep inside ``dist_checkpointing`` or, worse, loads garbage.
With a manifest the run names the bad file in one line and falls back to the newest checkpoint
that verifies; the bad one is renamed ``<name>.damaged`` (kept for inspection, never deleted,
not counted by keep-last-N).

Each rank digests the files it wrote (its ``__<rank>_*.distcp`` shards and ``rank/<rank>.pt``),
rank 0 the shared ones; verification splits the entries over the ranks the same way, so a large
checkpoint is read once in total, not once per rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron_p3o.runtime.collectives import all_gather_objects

MANIFEST = "manifest.json"
DAMAGED_SUFFIX = ".damaged"
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
_RANK_FILE = re.compile(r"^rank/(\d+)\.pt$")
Entry = Tuple[int, str]  # (size, digest)


def digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _owner(rel: str) -> Optional[int]:
    """The rank that wrote ``rel`` (None: a shared file rank 0 accounts for)."""
    m = _SHARD.match(rel) or _RANK_FILE.match(rel)
    return int(m.group(1)) if m else None


def _files(ckpt: Path) -> List[str]:
    return sorted(
        str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def write_manifest(ckpt_dir: Path) -> None:
    """All ranks call this once every file of the (temporary) checkpoint is written; rank 0
    writes ``manifest.json`` last. Collective over the world (gloo objects)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    ckpt = Path(ckpt_dir)
    files = _files(ckpt)
    mine = {}
    for rel in files:
        owner = _owner(rel)
        if owner == rank or (rank == 0 and (owner is None or owner >= world)):
            p = ckpt / rel
            mine[rel] = (p.stat().st_size, digest(p))
    if dist.is_initialized():
        parts = all_gather_objects(mine, dist.group.WORLD, "each rank digested the files it "
                                   "wrote; rank 0 writes the one manifest")  # fmt: skip
    else:
        parts = [mine]
    if rank == 0:
        entries: Dict[str, Entry] = {}
        for p in parts:
            entries.update(p)
        missing = sorted(set(files) - set(entries))
        for rel in missing:  # written by a rank that saw no such file (shared filesystem lag)
            entries[rel] = ((ckpt / rel).stat().st_size, digest(ckpt / rel))
        tmp = ckpt / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps({"files": entries}, indent=0, sort_keys=True))
        os.replace(tmp, ckpt / MANIFEST)


def check(ckpt_dir: Path, part: int = 0, parts: int = 1) -> Optional[str]:
    """The first problem of this share (``part`` of ``parts``) of the checkpoint's files, as
    "file: what", or None. A checkpoint without a manifest (written before manifests existed)
    is checked for its metadata only."""
    ckpt = Path(ckpt_dir)
    man = ckpt / MANIFEST
    if not man.is_file():
        return None if (ckpt / "metadata.json").is_file() else "metadata.json: missing"
    try:
        entries = json.loads(man.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"{MANIFEST}: unreadable ({e})"
    for i, (rel, (size, dig)) in enumerate(sorted(entries.items())):
        if i % parts != part:
            continue
        p = ckpt / rel
        if not p.is_file():
            return f"{rel}: missing"
        have = p.stat().st_size
        if have != size:
            return f"{rel}: {have} bytes, the manifest says {size}"
        if digest(p) != dig:
            return f"{rel}: contents differ from the manifest (corrupted)"
    return None


def check_everywhere(ckpt_dir: Path) -> Optional[str]:
    """:func:`check` with the files split over the ranks; every rank gets the same answer
    (collective when distributed)."""
    if not dist.is_initialized():
        return check(ckpt_dir)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = check(ckpt_dir, rank, world)
    found = all_gather_objects(mine, dist.group.WORLD, "each rank verified its share of the "
                               "files; all must agree on the verdict")  # fmt: skip
    return next((f for f in found if f is not None), None)
