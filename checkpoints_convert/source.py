"""Which checkpoint an export or a verification reads, and where its model description and
tokenizer come from.

Why: users export what they trained, not only what they converted. ``--ckpt`` takes

* a run directory (``runs/NAME``, the trainer's ``run.dir``/``run.name``): its newest checkpoint
  that verifies against its manifest (``latest`` first, then older ``step_N``; a damaged one is
  named and skipped, never renamed: an export only reads);
* a training checkpoint (``runs/NAME/checkpoints/step_N``): it carries ``p3o_model.json`` and
  ``hf/`` (config and tokenizer) since the trainer writes them; one written before that is read
  with the description and tokenizer of the checkpoint its recipe (``config.json``) started
  from, in the recipe's ``model.params_dtype``;
* a converted checkpoint (``checkpoints_convert.hf_to_megatron``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from megatron_p3o.runtime.errors import CheckpointError, InputFileError

RECIPE_FILE = "config.json"  # the trainer's resolved recipe inside each training checkpoint
HF_SUBDIR = "hf"  # config.json + tokenizer files, inside the checkpoint


@dataclass
class ExportSource:
    """Attributes: ckpt (the dist checkpoint read), meta (its :func:`read_meta`), hf_dir (HF
    config and tokenizer), notes (what was chosen and why, one line each)."""

    ckpt: Path
    meta: dict
    hf_dir: Path
    notes: List[str]


def newest_verified(run_dir: Path, notes: List[str]) -> Path:
    """The checkpoint a run would resume from (``latest`` if it verifies, else the newest that
    does), read-only; one error naming every damaged one when none verifies."""
    from megatron_p3o.checkpoint.manifest import check
    from megatron_p3o.checkpoint.state import checkpoint_candidates

    root = run_dir / "checkpoints"
    problems = []
    for ck in checkpoint_candidates(root):
        bad = "missing" if not ck.is_dir() else check(ck)
        if bad is None:
            if problems:
                notes.append(f"{'; '.join(problems)}: using {ck.name}")
            else:
                notes.append(f"{run_dir}: newest verified checkpoint {ck.name}")
            return ck
        problems.append(f"{ck.name} is damaged ({bad})")
    if problems:
        raise CheckpointError(f"no checkpoint under {root} verifies: " + "; ".join(problems))
    raise CheckpointError(f"{run_dir} is a run directory without a checkpoint under {root}")


def _from_recipe(ck: Path, notes: List[str]) -> Optional[tuple]:
    """(meta, hf dir) of a training checkpoint written before it carried them: from the
    checkpoint its recipe started from."""
    from megatron_p3o.model.builder import padded_vocab_size
    from megatron_p3o.model.hf.dist_stream import P3O_META_FILE, read_meta

    recipe = ck / RECIPE_FILE
    if not recipe.is_file():
        return None
    try:
        model = json.loads(recipe.read_text())["model"]
        base = Path(model["checkpoint"])
    except (ValueError, KeyError, TypeError):
        return None
    if not (base / P3O_META_FILE).is_file():
        raise CheckpointError(
            f"{ck} has no {P3O_META_FILE} (written before checkpoints carried it) and the "
            f"checkpoint its recipe started from, model.checkpoint={str(base)!r}, is gone: run "
            "from the directory the run was started in, or pass --hf-config"
        )
    meta = read_meta(base)
    meta["params_dtype"] = model.get("params_dtype", meta["params_dtype"])
    div = int(meta["make_vocab_size_divisible_by"])
    meta["padded_vocab_size"] = padded_vocab_size(meta["description"].vocab_size, 1, div)
    notes.append(f"{ck.name}: model description and tokenizer from model.checkpoint={base}")
    return meta, base / HF_SUBDIR


def resolve(path: str | Path) -> ExportSource:
    """The :class:`ExportSource` of ``--ckpt PATH`` (see the module docstring)."""
    from megatron_p3o.model.hf.dist_stream import P3O_META_FILE, read_meta

    p = Path(path)
    if not p.exists():
        raise InputFileError(f"--ckpt {p}: no such directory")
    if not p.is_dir():
        raise InputFileError(f"--ckpt {p} is a file; give a checkpoint or run directory")
    notes: List[str] = []
    ck = newest_verified(p, notes) if (p / "checkpoints").is_dir() else p
    if not (ck / "metadata.json").is_file():
        from megatron_p3o.checkpoint.state import _step_dirs

        steps = _step_dirs(ck)
        hint = f" (it holds {steps[-1].name}: pass that or its run directory)" if steps else ""
        raise CheckpointError(
            f"{ck} is not a Megatron distributed checkpoint (no metadata.json){hint}"
        )
    if (ck / P3O_META_FILE).is_file():
        return ExportSource(ck, read_meta(ck), ck / HF_SUBDIR, notes)
    found = _from_recipe(ck, notes)
    if found is None:
        raise CheckpointError(
            f"{ck}: no {P3O_META_FILE} and no trainer recipe ({RECIPE_FILE}); not a checkpoint "
            "written by megatron_p3o (convert an HF model with checkpoints_convert.hf_to_megatron)"
        )
    return ExportSource(ck, found[0], found[1], notes)
