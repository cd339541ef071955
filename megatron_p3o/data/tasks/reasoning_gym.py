"""reasoning-gym tasks as prompt data (``data.task: reasoning_gym:<name>``).

reasoning-gym (optional extra ``[tasks]``, pinned in the lock) generates procedural problems
with their own verifiers. A task here is the generator ``<name>`` with its config
(``data.task_args``), two disjoint splits drawn deterministically from ``data.task_seed``, and a
*format*: how an entry becomes a prompt (and, for the base-model makers, its worked completion).
How the final answer is read back from a completion before the dataset's own ``score_answer``
scores it is the reward's (:mod:`megatron_p3o.reward.reasoning_gym`, which also builds the
datasets this module draws from: reward/ is the lower folder).

The splits are written once as jsonl files (``prompt``, ``answer``) under
``{run.dir}/tasks/<name>-<hash>/`` and the run then reads them like any other prompt file, so
evaluation, DP sharding and the resumable cursor are the ones of :mod:`..rollout.prompts`. The
``answer`` column holds the entry itself (JSON: dataset, config, answer, metadata, format), so
the reward ``reward.kind: reasoning_gym`` needs nothing but the row.

Formats (each with its answer reader in ``reward.reasoning_gym.ANSWER_READERS``):
    ``question``: the entry's own question; the answer is the text of the last
        ``<answer>…</answer>`` in the completion, else the whole completion (stripped).
    ``chain_scratchpad``: ``chain_sum`` written for a character-level model
        (:mod:`.chain_sum`): prompt ``13+45+41-10=``, completion
        ``13+45=58;58+41=99;99-10=89;#89``; the answer is what follows the last ``#``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_p3o.reward.reasoning_gym import cached_dataset, import_reasoning_gym
from megatron_p3o.runtime.errors import DataError

PREFIX = "reasoning_gym:"
# held-out problems come from a seed this far from the training seed: reasoning-gym seeds entry
# i with Random(seed + i), so the two splits never share a generator stream
HELDOUT_SEED_OFFSET = 1_000_000_007


@dataclass(frozen=True)
class TaskFormat:
    prompt: Callable[[dict], str]
    target: Optional[Callable[[dict], str]] = None  # the SFT completion (base-model makers)


def _formats() -> Dict[str, TaskFormat]:
    """The formats by ``data.task_format`` name (the names of the reward's answer readers)."""
    from megatron_p3o.data.tasks import chain_sum

    return {
        "question": TaskFormat(lambda e: e["question"]),
        "chain_scratchpad": TaskFormat(chain_sum.scratchpad_prompt, chain_sum.scratchpad_target),
    }


def task_format(name: str) -> TaskFormat:
    formats = _formats()
    if name not in formats:
        raise DataError(f"data.task_format={name!r}; known: {sorted(formats)}")
    return formats[name]


def dataset_name(task: str) -> str:
    if not task.startswith(PREFIX) or not task[len(PREFIX) :]:
        raise DataError(f"data.task={task!r}: use 'reasoning_gym:<dataset name>'")
    name = task[len(PREFIX) :]
    known = import_reasoning_gym().factory.DATASETS
    if name not in known:
        import difflib

        near = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise DataError(f"data.task={task!r}: reasoning-gym has no dataset {name!r}{hint}")
    return name


def entries(name: str, args: Dict[str, Any], seed: int, size: int) -> List[dict]:
    """``size`` entries of generator ``name`` (config ``args``) from ``seed``, in order."""
    ds = cached_dataset(name, json.dumps(args, sort_keys=True), seed, size)
    return [ds[i] for i in range(size)]


def splits(
    name: str, args: Dict[str, Any], seed: int, n_train: int, n_heldout: int
) -> Tuple[List[dict], List[dict]]:
    """(train, held-out) entries: held-out from ``seed + HELDOUT_SEED_OFFSET``; any training
    entry whose question is also a held-out question is dropped (small problem spaces repeat)."""
    held = entries(name, args, seed + HELDOUT_SEED_OFFSET, n_heldout)
    seen = {e["question"] for e in held}
    train = [e for e in entries(name, args, seed, n_train) if e["question"] not in seen]
    return train, held


def encode_answer(name: str, args: Dict[str, Any], entry: dict, fmt: str) -> str:
    """The ``answer`` column: everything the reward needs to score a completion of ``entry``
    (:func:`~megatron_p3o.reward.reasoning_gym.reasoning_gym_reward` reads it)."""
    return json.dumps(
        {
            "dataset": name,
            "config": args,
            "answer": entry["answer"],
            "metadata": entry.get("metadata", {}),
            "format": fmt,
        },
        sort_keys=True,
        default=str,
    )


def _write_jsonl(rows: List[dict], path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)  # atomic: every rank may write the same file, none reads it half-made


def split_paths(
    task: str,
    args: Dict[str, Any],
    fmt: str,
    seed: int,
    n_train: int,
    n_heldout: int,
    root: Path,
) -> Tuple[Path, Path]:
    """Where :func:`materialize` writes the task's (train.jsonl, heldout.jsonl); writes nothing."""
    import importlib.metadata

    name = dataset_name(task)
    task_format(fmt)
    key = json.dumps(
        [name, args, fmt, seed, n_train, n_heldout, importlib.metadata.version("reasoning-gym")],
        sort_keys=True,
    )
    out = Path(root) / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return out / "train.jsonl", out / "heldout.jsonl"


def materialize(
    task: str,
    args: Dict[str, Any],
    fmt: str,
    seed: int,
    n_train: int,
    n_heldout: int,
    root: Path,
) -> Tuple[Path, Path]:
    """The task's (train.jsonl, heldout.jsonl), written under ``root`` unless already there.

    The directory name hashes everything the rows depend on (reasoning-gym's version too), so a
    changed argument never reads stale rows.
    """
    name = dataset_name(task)
    train_p, held_p = split_paths(task, args, fmt, seed, n_train, n_heldout, root)
    out = train_p.parent
    if train_p.is_file() and held_p.is_file():
        return train_p, held_p
    train, held = splits(name, args, seed, n_train, n_heldout)
    if not train:
        raise DataError(f"data.task={task!r}: no training problems left after removing held-out")
    make = task_format(fmt).prompt
    out.mkdir(parents=True, exist_ok=True)
    for rows, path in ((train, train_p), (held, held_p)):
        _write_jsonl(
            [{"prompt": make(e), "answer": encode_answer(name, args, e, fmt)} for e in rows], path
        )
    return train_p, held_p
