"""reasoning-gym's ``chain_sum`` in a scratchpad format a small character-level model can learn.

The problem is reasoning-gym's own entry (its ``metadata["expression"]``, e.g.
``"13 + 45 + 41 - 10"``); only its wording changes:

    prompt      13+45+41-10=
    completion  13+45=58;58+41=99;99-10=89;#89

one running sum per step, then ``#`` and the final answer, which the dataset's own
``score_answer`` scores (the reward reads it back:
:func:`megatron_p3o.reward.reasoning_gym.scratchpad_answer`). The completion of a 4–6-term
problem with 2–3-digit operands is 26–82 characters: long enough for train–rollout mismatch to
accumulate over a sequence.
"""

from __future__ import annotations

import re
from typing import List

CHARS = list("0123456789+-=;#")
_TERM = re.compile(r"([+-]?\d+)")


def _terms(expression: str) -> List[int]:
    """``"13 + 45 - 10"`` → ``[13, 45, -10]`` (the signed terms, in order)."""
    flat = expression.replace(" ", "")
    # a leading '-' belongs to the first term; every later sign is the operator before a term
    return [int(t) for t in _TERM.findall(flat)]


def scratchpad_prompt(entry: dict) -> str:
    return entry["metadata"]["expression"].replace(" ", "") + "="


def scratchpad_target(entry: dict) -> str:
    """The worked completion (no ``<eos>``): each partial sum, then ``#answer``."""
    terms = _terms(entry["metadata"]["expression"])
    acc, steps = terms[0], []
    for t in terms[1:]:
        op = "+" if t >= 0 else "-"
        nxt = acc + t
        steps.append(f"{acc}{op}{abs(t)}={nxt};")
        acc = nxt
    if str(acc) != str(entry["answer"]):
        raise ValueError(f"chain_sum scratchpad of {entry['metadata']['expression']!r} gave {acc}")
    return "".join(steps) + f"#{acc}"
