"""Environments for multi-turn, tool-using rollouts: the interface a user implements, the
bundled calculator tool and the environment built on it (``docs/multiturn.md``)."""

from megatron_p3o.env.types import Environment, EnvItem, StepResult

__all__ = ["EnvItem", "Environment", "StepResult"]
