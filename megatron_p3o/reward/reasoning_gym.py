"""``reward.kind: reasoning_gym``: a completion scored by the reasoning-gym dataset's own
``score_answer`` (partial credit where it gives it), the final answer read from the completion
by the row's format.

The task side (:mod:`megatron_p3o.data.tasks.reasoning_gym`, ``data.task: reasoning_gym:<name>``)
draws the problems and writes each row's ``answer`` column (dataset, config, answer, metadata,
format: its ``encode_answer``); this module reads it back. Why the pieces both sides need live
here and the task imports them: the registry resolves every ``reward.kind`` inside reward/, and a
folder that imports another is never imported back by it (docs/layout.md), so reasoning-gym's
dataset (whose entries the task draws and whose ``score_answer`` the reward calls) and the
answer readers of each format sit in the lower folder.

Answer readers, by ``data.task_format``:
    ``question``: the text of the last ``<answer>…</answer>`` in the completion, else the whole
        completion (stripped).
    ``chain_scratchpad``: what follows the last ``#``
        (:mod:`megatron_p3o.data.tasks.chain_sum`'s ``13+45=58;58+41=99;#99``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Callable, Dict, Optional

from megatron_p3o.runtime.errors import DataError


def import_reasoning_gym():
    """The ``reasoning_gym`` module (optional extra ``[tasks]``), or one line saying how to
    install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(
            "data.task=reasoning_gym:... needs reasoning-gym: pip install -c constraints-cpu.txt "
            "-e '.[tasks]'"
        ) from None
    return reasoning_gym


@lru_cache(maxsize=16)
def cached_dataset(name: str, args_json: str, seed: int, size: int):
    """reasoning-gym's dataset ``name`` (config ``args_json``, sorted JSON) of ``size`` entries
    from ``seed``, built once per key; a config it refuses is one :class:`DataError`."""
    args = json.loads(args_json)
    try:
        return import_reasoning_gym().create_dataset(name, seed=seed, size=size, **args)
    except (TypeError, AssertionError, ValueError) as e:
        raise DataError(
            f"data.task_args for reasoning_gym:{name}: {type(e).__name__}: {e}"
        ) from None


def answer_tag(text: str) -> Optional[str]:
    """``question`` format: the last ``<answer>…</answer>``'s text, else the whole text."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end if end >= 0 else None)
    if start >= 0 and end > start:
        return text[start + len("<answer>") : end].strip()
    return text.strip()


def scratchpad_answer(completion: str) -> Optional[str]:
    """``chain_scratchpad`` format: what follows the last ``#`` (spaces dropped: the character
    tokenizer decodes with a space between tokens); None when there is no ``#``."""
    flat = completion.replace(" ", "")
    i = flat.rfind("#")
    return flat[i + 1 :] if i >= 0 else None


# data.task_format -> how its final answer is read from a completion (the task's formats,
# data/tasks/reasoning_gym.py, carry the same names)
ANSWER_READERS: Dict[str, Callable[[str], Optional[str]]] = {
    "question": answer_tag,
    "chain_scratchpad": scratchpad_answer,
}


def answer_reader(fmt: str) -> Callable[[str], Optional[str]]:
    if fmt not in ANSWER_READERS:
        raise DataError(f"data.task_format={fmt!r}; known: {sorted(ANSWER_READERS)}")
    return ANSWER_READERS[fmt]


def reasoning_gym_reward(completion: str, answer: str) -> float:
    """``reward.kind: reasoning_gym``: the dataset's own ``score_answer`` on the answer read
    from ``completion`` by the row's format. ``answer`` is a row's ``encode_answer``
    (:mod:`megatron_p3o.data.tasks.reasoning_gym`)."""
    try:
        row = json.loads(answer)
        name, fmt = row["dataset"], row["format"]
    except (ValueError, KeyError, TypeError):
        raise DataError(
            f"reward.kind=reasoning_gym: the answer {answer[:80]!r} is not a reasoning_gym row "
            "(data.task=reasoning_gym:... writes them)"
        ) from None
    score = cached_dataset(name, json.dumps(row["config"], sort_keys=True), 0, 1).score_answer
    extracted = answer_reader(fmt)(completion)
    return float(score(extracted, {"answer": row["answer"], "metadata": row["metadata"]}))
