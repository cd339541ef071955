"""Environments of ``bench_multiturn.py``, in a module of their own: an environment runs in a
worker process, which imports it by name (this module imports nothing heavy)."""

import random
import time

from megatron_p3o.env.types import StepResult


class LatencyTools:
    """Every turn is a tool call answered after U(0, ``hi``) s (``slow_p`` of the calls take
    ``slow_s`` s); the episode ends after 1 to ``max_turns`` turns — all drawn from the
    episode's seed, so every loop compared sees the same latencies."""

    def __init__(self, max_turns=8, hi=0.5, slow_p=0.05, slow_s=3.0, reply="1+2=3"):
        self.max_turns, self.hi, self.slow_p, self.slow_s = max_turns, hi, slow_p, slow_s
        self.reply = reply

    def reset(self, item):
        self.rng = random.Random(item.seed)
        self.turns, self.n = self.rng.randint(1, self.max_turns), 0
        return None

    def step(self, turn):
        r = self.rng
        time.sleep(self.slow_s if r.random() < self.slow_p else r.uniform(0.0, self.hi))
        self.n += 1
        done = self.n >= self.turns
        return StepResult(None if done else self.reply, 0.0, done, tool_calls=1)


class Echo:
    """Answers every turn at once with a fixed observation; done after ``turns`` turns (the
    embedded comparison: the loop and the engine measured, not a tool)."""

    def __init__(self, turns=3, reply="7777"):
        self.turns, self.reply, self.n = turns, reply, 0

    def reset(self, item):
        self.n = 0
        return None

    def step(self, turn):
        self.n += 1
        done = self.n >= self.turns
        return StepResult(None if done else self.reply, 0.0, done)


class EchoOnLoop(Echo):
    """:class:`Echo` as an ``async def step`` environment: it runs on the rollout's event loop,
    no worker process (the engine and the loop measured without the isolation's IPC)."""

    async def step(self, turn):
        return Echo.step(self, turn)
