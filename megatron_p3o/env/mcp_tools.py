"""Tools served over MCP (the Model Context Protocol), for agents: the servers a recipe names
(``rollout.multi_turn.mcp_servers``) are connected once per rollout; their tools become OpenAI
tool schemas (:attr:`MCPToolbox.schemas`, what an agent passes as ``tools`` so the chat template
renders them) and calls go through :meth:`MCPToolbox.call`, bounded by
``rollout.multi_turn.tool_timeout_s``.

Why the SDK's client (``mcp``) and one connection per server per rollout: MCP servers are
stateful processes (stdio) or services (streamable HTTP); starting one per episode would cost a
process start per trajectory. A server is given as ``{command, args, env}`` (launched over stdio
by the SDK) or ``{url}`` (streamable HTTP).

Faults: a call past ``tool_timeout_s`` returns an error text to the model and, for a stdio
server, **kills** it (a hung server would hang every later call) — the SDK's shutdown closes its
stdin, then terminates its process tree — and the next call starts it again (calls in flight on
it at that moment get an error text too); an HTTP server cannot be killed from here: the call is
abandoned. A tool that reports an error (``is_error``) or raises is an error text. Nothing a
tool returns is more than text: the endpoint encodes it as text (no forged tokens).
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Dict, List, Optional, Tuple

from megatron_p3o.runtime.errors import ConfigError

KEY = "rollout.multi_turn.mcp_servers"


def _target(spec: dict, i: int):
    if not isinstance(spec, dict) or ("url" in spec) == ("command" in spec):
        raise ConfigError(f"{KEY}[{i}]={spec!r}: give either 'command' (stdio) or 'url' (HTTP)")
    if "url" in spec:
        return spec["url"]
    from mcp.client.stdio import StdioServerParameters

    return StdioServerParameters(command=spec["command"], args=list(spec.get("args", [])),
                                 env=spec.get("env"), cwd=spec.get("cwd"))  # fmt: skip


class MCPServerTools:
    """One MCP server's connection, owned by a task of its own (the SDK's cancel scopes must be
    entered and left in one task), restartable after a hang."""

    def __init__(self, spec: dict, index: int, timeout_s: float):
        self.spec, self.index, self.timeout_s = spec, index, timeout_s
        self.client = None
        self.tools: list = []
        self._owner: Optional[asyncio.Task] = None
        self._stop: Optional[asyncio.Event] = None
        self._lock = asyncio.Lock()
        self.restarts = 0

    async def _own(self, ready: asyncio.Future) -> None:
        from mcp import Client

        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(Client(_target(self.spec, self.index)))
                self.client = client
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - reported to the connecting call
            if not ready.done():
                ready.set_exception(e)
            elif not isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self.client = None

    async def connect(self) -> None:
        async with self._lock:
            if self.client is not None:
                return
            self._stop = asyncio.Event()
            ready = asyncio.get_running_loop().create_future()
            self._owner = asyncio.ensure_future(self._own(ready))
            try:
                await asyncio.wait_for(ready, max(self.timeout_s, 30.0))
            except Exception as e:
                await self.close()
                raise ConfigError(f"{KEY}[{self.index}]={self.spec!r}: cannot connect "
                                  f"({type(e).__name__}: {e})") from None  # fmt: skip
            if not self.tools:
                self.tools = list((await self.client.list_tools()).tools)

    async def close(self) -> None:
        """Leave the connection (a stdio server is stopped, its process tree killed)."""
        if self._stop is not None:
            self._stop.set()
        if self._owner is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._owner), 10.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - stopping anyway
                self._owner.cancel()
            self._owner = None
        self.client = None

    async def call(self, name: str, arguments: dict) -> Tuple[str, bool]:
        """(text, ok) of one call; never raises for what the tool does."""
        try:
            await self.connect()
            client = self.client
            r = await asyncio.wait_for(client.call_tool(name, arguments), self.timeout_s)
        except asyncio.TimeoutError:
            if "command" in self.spec:  # hung: kill it; the next call starts it again
                self.restarts += 1
                await self.close()
            return f"error: the tool {name} ran past {self.timeout_s:g} s", False
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a tool's or a transport's failure
            return f"error: {type(e).__name__}: {e}", False
        texts = [getattr(c, "text", None) for c in r.content]
        text = "\n".join(t for t in texts if t is not None)
        if not text and r.structured_content is not None:
            import json

            text = json.dumps(r.structured_content)
        return text, not r.is_error


class MCPToolbox:
    """Every MCP server of a recipe, for one rollout (an agent gets it as ``item["tools"]``)."""

    def __init__(self, specs: List[dict], timeout_s: float):
        self.servers = [MCPServerTools(s, i, timeout_s) for i, s in enumerate(specs)]
        self._by_name: Dict[str, MCPServerTools] = {}
        self.schemas: List[dict] = []

    async def start(self) -> None:
        self.schemas, self._by_name = [], {}
        for srv in self.servers:
            await srv.connect()
            for t in srv.tools:
                if t.name in self._by_name:
                    raise ConfigError(f"{KEY}: the tool name {t.name!r} is served twice")
                self._by_name[t.name] = srv
                self.schemas.append({"type": "function", "function": {
                    "name": t.name, "description": t.description or "",
                    "parameters": t.input_schema}})  # fmt: skip

    async def call(self, name: str, arguments: Optional[dict] = None) -> Tuple[str, bool]:
        """(text, ok): the tool's text output, or an error text (unknown tool, timeout,
        failure)."""
        srv = self._by_name.get(name)
        if srv is None:
            return f"error: no tool named {name!r}", False
        if not isinstance(arguments, dict):
            return f"error: the arguments of {name} are not an object", False
        return await srv.call(name, arguments)

    async def close(self) -> None:
        for srv in self.servers:
            await srv.close()
