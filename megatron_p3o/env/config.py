"""The multi-turn section of a recipe (``rollout.multi_turn``), and the environment it names.

Why here: the environment stage owns what configures it; the rollout stage nests this dataclass
(``RolloutConfig.multi_turn``) and runs the loop (``megatron_p3o.rollout.turns``).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Literal, Optional

from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.runtime.fields import check_ranges


@dataclass(frozen=True)
class MultiTurnConfig:
    """Attributes:
    env: the environment class, ``"module:Class"`` (:class:`~.types.Environment`; bundled:
        ``megatron_p3o.env.calc_env:CalculatorEnv``); or, instead of it, ``agent``.
    agent: the user's agent, ``"module:function"``: an ``async def (client, item) -> reward``
        given an OpenAI client bound to its episode's session of the rollout's endpoint
        (``megatron_p3o.rollout.agents``; docs/agents.md); ``env``, ``env_args`` and
        ``memory_mb`` do not apply.
    tool_parser: how the endpoint reads tool calls from a model turn's text for the agent
        (``hermes``, ``qwen3_coder``, ``none``); the trained tokens are never changed by it.
    episode_timeout_s: how long an agent's episode may take (past it: cancelled, ``aborted``).
    mcp_servers: with ``agent``: MCP tool servers connected for each rollout, each
        ``{command, args, env}`` (stdio, launched) or ``{url}`` (streamable HTTP); the agent gets
        them as ``item["tools"]`` (:class:`~.mcp_tools.MCPToolbox`: OpenAI tool schemas and
        ``await call(name, arguments)``), each call bounded by ``tool_timeout_s``.
    max_prompt_tokens: with ``agent``: the longest conversation an agent may send to start a
        segment (its messages and tools rendered), in tokens; a longer one is refused (400).
        ``model.seq_length`` must hold it plus ``max_total_tokens``.
    env_args: keyword arguments of the class (one instance per trajectory).
    max_turns: model turns per episode; one that is still going after them ends
        ``truncated``.
    max_total_tokens: tokens after the prompt, the model's and the environment's together
        (each turn's ``max_new_tokens`` is clamped to what is left; an observation that does not
        fit is cut); ``model.seq_length`` must hold the prompt plus this.
    tool_timeout_s: how long one ``reset`` or ``step`` of the environment may take; past it
        its worker process is killed and the episode ends ``tool_error`` (a reset: ``aborted``).
    observation_role: the chat-template role observations are wrapped in (``tool``; ``user``
        for a template without a tool role); no chat template: appended as plain text.
    concurrency: trajectories in flight at once (each its own coroutine, environment worker
        and engine slot); the others wait for a place.
    memory_mb: address-space limit of each environment worker process (0: none); past it an
        allocation fails inside the step (an error observation).
    credit: how rewards reach tokens — ``trajectory`` (every policy token of a trajectory
        gets the advantage of its summed reward) or ``turn`` (each turn's tokens get the
        advantage of their reward-to-go, discounted by ``discount``:
        ``megatron_p3o.advantage.turns``).
    discount: γ of ``credit: turn`` (1: undiscounted reward-to-go).
    max_trajectory_staleness: a trajectory stops taking turns (``truncated``) once the engine's
        weights are more than this many versions newer than its oldest policy token (weights
        pushed while it was out); None: no bound.
    """

    env: str = ""
    agent: str = ""
    tool_parser: Literal["hermes", "qwen3_coder", "none"] = "none"
    episode_timeout_s: float = 600.0
    max_prompt_tokens: int = 512
    mcp_servers: List[Dict[str, Any]] = field(default_factory=list)
    env_args: Dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_total_tokens: int = 256
    tool_timeout_s: float = 10.0
    observation_role: str = "tool"
    concurrency: int = 256
    memory_mb: int = 4096
    credit: Literal["trajectory", "turn"] = "trajectory"
    discount: float = 1.0
    max_trajectory_staleness: Optional[int] = None

    RANGES: ClassVar[Dict[str, str]] = {
        "max_turns": ">= 1",
        "max_total_tokens": ">= 1",
        "tool_timeout_s": "> 0",
        "episode_timeout_s": "> 0",
        "max_prompt_tokens": ">= 1",
        "concurrency": ">= 1",
        "memory_mb": ">= 0",
        "discount": "in [0, 1]",
        "max_trajectory_staleness": ">= 0",
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES, "rollout.multi_turn")
        for i, spec in enumerate(self.mcp_servers):
            if not isinstance(spec, dict) or ("url" in spec) == ("command" in spec):
                raise ConfigError(
                    f"rollout.multi_turn.mcp_servers[{i}]={spec!r}: give either 'command' "
                    "(stdio) or 'url' (streamable HTTP)"
                )
        if self.mcp_servers and not self.agent:
            raise ConfigError(
                "rollout.multi_turn.mcp_servers needs an agent (the agent calls them)"
            )
        if self.agent:
            if self.env:
                raise ConfigError(
                    "rollout.multi_turn: env and agent are exclusive (an environment steps "
                    "each turn; an agent drives its episode itself): name one"
                )
            if ":" not in self.agent:
                raise ConfigError(
                    f"rollout.multi_turn.agent={self.agent!r} must be 'module:function'"
                )
            if self.credit == "turn":
                raise ConfigError(
                    "rollout.multi_turn.credit=turn needs per-turn rewards, which an agent (one "
                    "reward per episode) does not give: use credit: trajectory"
                )
            return
        if ":" not in self.env:
            raise ConfigError(
                f"rollout.multi_turn.env={self.env!r} must be 'module:Class' (bundled: "
                "megatron_p3o.env.calc_env:CalculatorEnv)"
            )


def env_host(cfg: MultiTurnConfig):
    """Where the environment's episodes run (:class:`~.workers.EnvHost`): the class is
    imported and one instance made now, so a wrong name or argument is one error at the
    start; ``async def step`` classes run on the rollout's event loop, others in worker
    processes."""
    from megatron_p3o.env.workers import EnvHost, EnvSpec

    cls = env_class(cfg)
    spec = EnvSpec(cfg.env, dict(cfg.env_args), cfg.memory_mb, 16 * cfg.max_total_tokens)
    return EnvHost(spec, on_loop=inspect.iscoroutinefunction(getattr(cls, "step", None)))


def env_class(cfg: MultiTurnConfig):
    """The environment class, imported and tried once (its errors name the keys)."""
    mod, name = cfg.env.split(":", 1)
    key = "rollout.multi_turn.env"
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={cfg.env!r} cannot be imported: {e}") from None
    args = dict(cfg.env_args)
    try:
        probe = cls(**args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"rollout.multi_turn.env_args={args}: {cls.__name__}: {e}") from None
    for method in ("reset", "step"):
        if not callable(getattr(probe, method, None)):
            raise ConfigError(f"{key}={cfg.env!r} has no {method}() method")
    return cls
