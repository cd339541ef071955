"""The multi-turn section of a recipe (``rollout.multi_turn``), and the environment it names.

Why here: the environment stage owns what configures it; the rollout stage nests this dataclass
(``RolloutConfig.multi_turn``) and runs the loop (``megatron_p3o.rollout.turns``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict

from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.runtime.fields import check_ranges


@dataclass(frozen=True)
class MultiTurnConfig:
    """Attributes:
    env: the environment class, ``"module:Class"`` (:class:`~.types.Environment`; bundled:
        ``megatron_p3o.env.calc_env:CalculatorEnv``).
    env_args: keyword arguments of the class (one instance per trajectory).
    max_turns: model turns per episode; one that is still going after them ends
        ``truncated``.
    max_total_tokens: tokens after the prompt, the model's and the environment's together
        (each turn's ``max_new_tokens`` is clamped to what is left; an observation that does not
        fit is cut); ``model.seq_length`` must hold the prompt plus this.
    tool_timeout_s: how long one ``step`` of the environment may take; past it the episode
        ends ``tool_error`` with an error observation.
    observation_role: the chat-template role observations are wrapped in (``tool``; ``user``
        for a template without a tool role); no chat template: appended as plain text.
    """

    env: str = ""
    env_args: Dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_total_tokens: int = 256
    tool_timeout_s: float = 10.0
    observation_role: str = "tool"

    RANGES: ClassVar[Dict[str, str]] = {
        "max_turns": ">= 1",
        "max_total_tokens": ">= 1",
        "tool_timeout_s": "> 0",
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES, "rollout.multi_turn")
        if ":" not in self.env:
            raise ConfigError(
                f"rollout.multi_turn.env={self.env!r} must be 'module:Class' (bundled: "
                "megatron_p3o.env.calc_env:CalculatorEnv)"
            )


def env_factory(cfg: MultiTurnConfig) -> Callable[[], Any]:
    """A function making one environment per trajectory; the class is imported and one
    instance made now, so a wrong name or argument is one error at the start."""
    mod, name = cfg.env.split(":", 1)
    key = "rollout.multi_turn.env"
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={cfg.env!r} cannot be imported: {e}") from None
    args = dict(cfg.env_args)
    try:
        probe = cls(**args)
    except TypeError as e:
        raise ConfigError(f"rollout.multi_turn.env_args={args}: {cls.__name__}: {e}") from None
    for method in ("reset", "step"):
        if not callable(getattr(probe, method, None)):
            raise ConfigError(f"{key}={cfg.env!r} has no {method}() method")
    return lambda: cls(**args)
