"""The user's agent as a rollout's episodes: one coroutine per trajectory runs
``rollout.multi_turn.agent`` (an ``async def agent(client, item) -> reward``) with an OpenAI
client bound to that trajectory's session of the endpoint.

Why the agent gets a client, not tokens: agents are written against the OpenAI API; the
session (:mod:`.session`) turns each of its requests into one engine turn of the trajectory,
token in and token out, under the same budget, staleness bound, turn seeds and concurrency cap
as the environment loop (:class:`~megatron_p3o.rollout.turns.TurnLoop`).

Outcomes (``Sample.meta["status"]``):

- the agent returns a number: ``completed`` (``truncated`` if its budget or ``max_turns``
  ended the session first) with that reward;
- the agent raises after its session's budget ended (it got a 400 saying so): ``truncated``,
  reward 0;
- the agent raises otherwise, returns something that is not a number, or runs past
  ``rollout.multi_turn.episode_timeout_s`` (it is cancelled): ``aborted`` — not trained, out of
  its group's baseline, one warning line per rollout naming the agent, the item and the reason.

The agent runs on the rollout's event loop: it must ``await`` its I/O (a CPU-bound agent stalls
every other episode; run such work in a thread or a process of its own).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import time
from dataclasses import asdict, replace

from megatron_p3o.rollout.agents.endpoint import MODEL, Endpoint
from megatron_p3o.rollout.agents.session import AgentSession, RequestError
from megatron_p3o.rollout.agents.tool_parsers import tool_parser
from megatron_p3o.rollout.sglang.protocol import routing_key
from megatron_p3o.rollout.trajectory import turn_seed
from megatron_p3o.runtime.errors import ConfigError


def agent_function(spec: str):
    """``module:function``, an ``async def`` of ``(client, item)``; errors name the key."""
    key = "rollout.multi_turn.agent"
    mod, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{key}={spec!r} cannot be imported: {e}") from None
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{key}={spec!r} must be an 'async def' of (client, item)")
    return fn


def _needs(cfg) -> None:
    """The packages an agent rollout imports, checked when the loop is built (not at the first
    rollout): one line naming the key and the install."""
    wanted = ["openai", "aiohttp"] + (["mcp"] if cfg.mcp_servers else [])
    missing = [m for m in wanted if importlib.util.find_spec(m) is None]
    if missing:
        key = "rollout.multi_turn." + ("mcp_servers" if missing == ["mcp"] else "agent")
        raise ConfigError(
            f"{key} needs {', '.join(missing)}: pip install 'megatron-p3o[agents]' (from a "
            "checkout: pip install -e '.[agents]')"
        )


def _client(base_url: str, timeout_s: float):
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key="p3o-rollout", max_retries=0,
                              timeout=timeout_s)  # fmt: skip


class AgentEpisodes:
    """What :class:`~megatron_p3o.rollout.turns.TurnLoop` runs instead of an environment."""

    def __init__(self, cfg, tok, stop_ids):
        self.cfg, self.tok, self.stop_ids = cfg, tok, tuple(stop_ids)
        _needs(cfg)
        self.fn = agent_function(cfg.agent)
        self.parser = tool_parser(cfg.tool_parser)
        self.endpoint = None
        self.toolbox = None  # the recipe's MCP servers (item["tools"]), per rollout
        self.sessions = {}

    async def start(self) -> None:
        self.sessions = {}
        self.endpoint = Endpoint()
        await self.endpoint.start()
        if self.cfg.mcp_servers:
            from megatron_p3o.env.mcp_tools import MCPToolbox

            self.toolbox = MCPToolbox(self.cfg.mcp_servers, self.cfg.tool_timeout_s)
            await self.toolbox.start()

    async def stop(self) -> None:
        if self.toolbox is not None:
            await self.toolbox.close()
            self.toolbox = None
        if self.endpoint is not None:
            await self.endpoint.stop()
            self.endpoint = None

    async def episode(self, loop, server, t, item, sampling) -> None:
        """Trajectory ``t``'s episode (admitted by the caller)."""
        c = self.cfg
        session = AgentSession(t, self.tok, self.parser, c.max_turns, self.stop_ids,
                               c.max_prompt_tokens)  # fmt: skip
        self.sessions[t.index] = session
        ended = {"why": None}

        async def handler(body: dict) -> dict:
            seg = session.traj
            if seg.status is not None:
                raise RequestError(f"the episode has ended ({seg.status})", ended=True)
            seg, limit = session.prepare(body)
            why = self._refuse(session, server)
            budget = seg.turn_budget(min(sampling.max_new_tokens, limit or sampling.max_new_tokens),
                                     c.max_total_tokens, server.context_length)  # fmt: skip
            if why is None and budget <= 0:
                why = f"the episode's token budget (max_total_tokens={c.max_total_tokens}) is spent"
            if why is not None:
                seg.status = "truncated"
                ended["why"] = why
                raise RequestError(why, ended=True)
            sp = replace(sampling, max_new_tokens=budget,
                         seed=turn_seed(sampling.seed, t.index, session.turns))  # fmt: skip
            seg.inputs.append(len(seg.prompt) + len(seg.ids))
            t0 = time.monotonic()
            s = await server.generate(t.index, seg.prompt + seg.ids, sp, routing_key(seg.prompt))
            seg.engine_s += time.monotonic() - t0
            seg.take_turn(s, budget_left=budget == sampling.max_new_tokens and limit is None)
            if seg.status == "aborted":
                raise RequestError("the engine aborted the request", ended=True)
            return session.answer(seg, s, MODEL)

        base = self.endpoint.open(handler)
        client = _client(base, c.episode_timeout_s)
        t0 = time.monotonic()
        try:
            it = {**asdict(item), "tools": self.toolbox}
            got = await asyncio.wait_for(self.fn(client, it), c.episode_timeout_s)
            if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
                session.finish("aborted", 0.0, f"{c.agent} returned {got!r}, not a finite number")
            else:
                session.finish("completed", float(got))
        except asyncio.TimeoutError:
            session.finish("aborted", 0.0, f"{c.agent} ran past {c.episode_timeout_s:g} s")
        except Exception as e:  # noqa: BLE001 - the user's agent: its failure is its episode's
            if ended["why"] is not None or session.traj.status == "truncated":
                session.finish("truncated", 0.0)
            else:
                session.finish("aborted", 0.0, f"{c.agent} raised {type(e).__name__}: {e}")
        finally:
            t.env_s += time.monotonic() - t0 - sum(x.engine_s for x in session.segments)
            self.endpoint.close(base)
            await client.close()

    def _refuse(self, session, server):
        """Why the session may take no more turns (staleness), or None."""
        stale = self.cfg.max_trajectory_staleness
        olds = [v for v in (t.oldest_version() for t in session.segments) if v is not None]
        if stale is not None and olds and server.weight_version - min(olds) > stale:
            session.traj.stale = True
            return (f"the trajectory's oldest token is more than {stale} weight versions old "
                    "(max_trajectory_staleness)")  # fmt: skip
        return None

    def samples(self, trajs):
        """Every trajectory's samples (one per segment), in trajectory order."""
        out = []
        for t in trajs:
            s = self.sessions.get(t.index)
            out += s.samples() if s is not None else [t.sample()]
        return out
