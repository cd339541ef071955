"""Exclusive wall-clock time per phase of a training step, by wrapping the functions that run it
(standard library only: the TRL venv imports it too).

Each wrapped call pushes a phase and pops it when it returns; the time between two events goes to
the innermost open phase, so the phases of a step add up to the step. A phase's name may depend
on what encloses it (the model's forward inside the ESS pre-pass is the pre-pass's).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from typing import Callable, Dict, List, Union

Name = Union[str, Callable[[List[str]], str]]


class PhaseClock:
    def __init__(self):
        self.stack: List[str] = []
        self.seconds: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)
        self.last = time.perf_counter()

    def _switch(self) -> None:
        now = time.perf_counter()
        if self.stack:
            self.seconds[self.stack[-1]] += now - self.last
        self.last = now

    def push(self, name: Name) -> None:
        self._switch()
        label = name(self.stack) if callable(name) else name
        self.stack.append(label)
        self.calls[label] += 1

    def pop(self) -> None:
        self._switch()
        self.stack.pop()

    def wrap(self, owner, attr: str, name: Name) -> None:
        """``owner.attr`` (a function, method or bound method) timed as phase ``name``."""
        fn = getattr(owner, attr)
        clock = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            clock.push(name)
            try:
                return fn(*args, **kwargs)
            finally:
                clock.pop()

        setattr(owner, attr, timed)

    def take(self) -> Dict[str, float]:
        """The seconds per phase since the last call (open phases included), then reset."""
        self._switch()
        out = dict(self.seconds)
        self.seconds.clear()
        return out


def inside(*names: str) -> Callable[[str, str], Name]:
    """``inside("pre-pass")("forward", "pre-pass: forward")``: a phase named after whether one
    of ``names`` is open."""

    def name(plain: str, nested: str) -> Name:
        return lambda stack: nested if any(n in stack for n in names) else plain

    return name
