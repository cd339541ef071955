"""Resolve ``reward.kind`` to a function ``(completion_text, answer) -> float`` and score samples.

A reward function that raises or returns a non-finite value stops the run with an error naming
the sample (its index, prompt group and the offending value) — not a crash deep in the loss.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Literal, Optional, Sequence

from megatron_p3o.reward.overlong import OverlongConfig
from megatron_p3o.runtime.errors import UserError

RewardFn = Callable[[str, str], float]


@dataclass(frozen=True)
class RewardConfig:
    """Attributes: kind (math_verify, exact_match, python, reasoning_gym: the task dataset's own
    ``score_answer``, for ``data.task``), function ("module:callable") and
    overlong (DAPO's soft over-long penalty added to the reward; None = off)."""

    kind: Literal["math_verify", "exact_match", "python", "reasoning_gym"] = "math_verify"
    function: str = ""
    overlong: Optional[OverlongConfig] = None


class RewardError(UserError, ValueError):
    pass


def build_reward(kind: str, function: str = "") -> RewardFn:
    """``math_verify``, ``exact_match``, ``reasoning_gym`` or ``python``
    (``function = "module:callable"``)."""
    if kind == "math_verify":
        from megatron_p3o.reward.math_answer import math_verify_reward

        return math_verify_reward
    if kind == "exact_match":
        from megatron_p3o.reward.exact_match import exact_match_reward

        return exact_match_reward
    if kind == "reasoning_gym":
        from megatron_p3o.reward.reasoning_gym import reasoning_gym_reward

        return reasoning_gym_reward
    if kind == "python":
        if ":" not in function:
            raise RewardError(f"reward.function={function!r} must be 'module:callable'")
        mod, name = function.split(":", 1)
        try:
            fn = getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError) as e:
            raise RewardError(f"reward.function={function!r} cannot be imported: {e}") from None
        if not callable(fn):
            raise RewardError(f"reward.function={function!r} is not callable")
        return fn
    raise RewardError(
        f"reward.kind={kind!r}; choose math_verify, exact_match, reasoning_gym or python"
    )


def decode_completions(decode: Callable[[List[int]], str], completions) -> List[str]:
    """The text of each completion for the reward, each distinct one decoded once (the n samples
    of a prompt often repeat on short answers): the same strings."""
    seen: Dict[tuple, str] = {}
    texts = []
    for ids in completions:
        key = tuple(ids)
        if key not in seen:
            seen[key] = decode(ids)
        texts.append(seen[key])
    return texts


def score_samples(
    fn: RewardFn, completions: Sequence[str], answers: Sequence[str], group_ids: Sequence[int]
) -> List[float]:
    out = []
    for i, (c, a, g) in enumerate(zip(completions, answers, group_ids)):
        try:
            r = float(fn(c, a))
        except Exception as e:  # noqa: BLE001 - re-raised with the sample named
            raise RewardError(
                f"reward function failed on sample {i} (prompt group {g}): {type(e).__name__}: {e}"
            ) from e
        if not math.isfinite(r):
            raise RewardError(f"reward function returned {r} for sample {i} (prompt group {g})")
        out.append(r)
    return out
