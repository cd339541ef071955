"""The bundled tool environment: a calculator the model may call before it answers
(``megatron_p3o.data.tasks.tool_calc``; ``recipes/tiny_cpu_tools.yaml``).

A turn of the form ``<calc>EXPRESSION</calc>`` calls the calculator
(:mod:`megatron_p3o.env.calculator`, which never runs ``eval``); its value, or ``error: …``, is
the observation. Any other turn is the answer: reward 1 if it is the expected value (the task's
``reward``), and the episode ends. Calls beyond ``max_tool_calls`` are answered with an error
and end the episode without reward. The reward comes only at the end (a trajectory's reward is
the sum of its turns' rewards).
"""

from __future__ import annotations

import re
import time
from typing import Optional

from megatron_p3o.env.calculator import CalculatorError, calculate, format_number
from megatron_p3o.env.types import EnvItem, StepResult

CALL = re.compile(r"\s*<calc>(.*?)</calc>\s*", re.S)


class CalculatorEnv:
    """Attributes (``rollout.multi_turn.env_args``): max_tool_calls — calls allowed per
    episode; delay_s — seconds the tool sleeps per call (tests of the tool timeout); fail —
    the tool raises on every call (tests of a failing tool)."""

    def __init__(self, max_tool_calls: int = 2, delay_s: float = 0.0, fail: bool = False):
        self.max_tool_calls, self.delay_s, self.fail = int(max_tool_calls), delay_s, fail
        self.answer, self.calls = "", 0

    def reset(self, item: EnvItem) -> Optional[str]:
        self.answer, self.calls = item.answer, 0
        return None

    def step(self, turn: str) -> StepResult:
        m = CALL.fullmatch(turn)
        if m is None:
            from megatron_p3o.data.tasks.tool_calc import reward

            return StepResult(reward=reward(turn, self.answer), done=True)
        self.calls += 1
        if self.calls > self.max_tool_calls:
            return StepResult(
                observation=f"error: more than {self.max_tool_calls} calculator calls",
                done=True,
                tool_calls=1,
                tool_error=True,
            )
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("the calculator is broken (fail=True)")
        try:
            value = format_number(calculate(m.group(1)))
        except CalculatorError as e:
            return StepResult(observation=f"error: {e}", tool_calls=1, tool_error=True)
        return StepResult(observation=value, tool_calls=1)
