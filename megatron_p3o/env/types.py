"""The one structure the environment stage hands the rollout loop: what an environment says
after each model turn (:class:`StepResult`), and what it is reset from (:class:`EnvItem`).

Why text, not tokens: an environment speaks in text (a tool's output, a user's reply); the
rollout loop encodes each observation once, when it is appended, and never decodes and
re-encodes the history (``megatron_p3o.rollout.turns``). The model's turn reaches the
environment decoded, for the environment's own use only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable


@dataclass(frozen=True)
class EnvItem:
    """One trajectory's start: the data row's index, prompt text and answer, and a seed that
    fixes whatever the environment draws (a resumed run replays the same episode)."""

    index: int
    prompt: str
    answer: str
    seed: int


@dataclass(frozen=True)
class StepResult:
    """After one model turn.

    Attributes:
        observation: text appended for the model's next turn (a tool's output, a reply), or
            None when the episode ends without one.
        reward: this turn's reward; a trajectory's reward is the sum over its turns (an
            environment that rewards only the outcome returns 0 until the last turn).
        done: the episode is over.
        tool_calls: tools this turn called (metrics).
        tool_error: a tool of this turn failed; ``observation`` says how (metrics).
    """

    observation: Optional[str] = None
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_error: bool = False


@runtime_checkable
class Environment(Protocol):
    """One episode's state. A new instance per trajectory (``rollout.multi_turn.env`` names
    the class, ``env_args`` its keyword arguments).

    ``reset(item)`` → the first observation appended after the prompt (None: the prompt
    alone); ``step(turn)`` → :class:`StepResult` for the model's turn (text, stop token
    removed). A ``step`` that raises becomes an error observation; one that runs past
    ``rollout.multi_turn.tool_timeout_s`` ends the episode with one."""

    def reset(self, item: EnvItem) -> Optional[str]: ...

    def step(self, turn: str) -> StepResult: ...


def eval_items(path: str, prompt_key: str, rows, idx) -> list:
    """The multi-turn evaluation's start of each selected prompt: ``EnvItem(i, text, answer, i)``
    for ``i`` in ``idx`` (file order), ``rows`` from :func:`megatron_p3o.data.prompts.all_rows`
    (the answers). The row's index is its seed: every evaluation replays the same episode for
    the same prompt."""
    from megatron_p3o.data.prompts import prompt_texts

    texts = prompt_texts(path, prompt_key)
    return [EnvItem(i, texts[i], rows[i][1], i) for i in idx]
