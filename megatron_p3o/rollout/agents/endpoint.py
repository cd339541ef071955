"""The OpenAI-compatible chat-completions endpoint a rollout's agents talk to.

Why an HTTP endpoint, not a Python call: the agents users bring are written against the OpenAI
API (plain ``openai``, the Agents SDK, their own harness); pointing their ``base_url`` here is
the whole integration (AReaL's proxy does the same). It runs on the rollout's event loop, in
the trainer's process, on 127.0.0.1 at a free port, for the length of one rollout; each episode
is one session with its own path, ``/s/<session>/v1`` (so a client bound to it needs no header
of ours):

- ``POST /s/<session>/v1/chat/completions`` — one engine turn (:class:`~.session.AgentSession`);
  a refused request is a 400 with OpenAI's error body (``{"error": {"message", "type"}}``);
- ``GET /s/<session>/v1/models`` — the one model name (clients that list models first).

Streaming is not supported (a request with ``stream: true`` is refused): an RL rollout needs the
whole turn before the agent acts on it.
"""

from __future__ import annotations

import json
import secrets
from typing import Awaitable, Callable, Dict

from megatron_p3o.rollout.agents.session import RequestError

MODEL = "p3o-policy"


class Endpoint:
    """``await start()`` then :meth:`open` a session per episode; ``await stop()``."""

    def __init__(self):
        self.handlers: Dict[str, Callable[[dict], Awaitable[dict]]] = {}
        self._runner = None
        self.port = 0

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/s/{sid}/v1/chat/completions", self._chat)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, handler: Callable[[dict], Awaitable[dict]]) -> str:
        """A new session answered by ``handler(body) -> completion``; its base URL."""
        sid = secrets.token_hex(8)
        self.handlers[sid] = handler
        return f"http://127.0.0.1:{self.port}/s/{sid}/v1"

    def close(self, base_url: str) -> None:
        self.handlers.pop(base_url.rstrip("/").split("/")[-2], None)

    @staticmethod
    def _error(status: int, msg: str):
        from aiohttp import web

        body = {"error": {"message": msg, "type": "invalid_request_error", "code": None}}
        return web.json_response(body, status=status)

    async def _chat(self, request):
        from aiohttp import web

        handler = self.handlers.get(request.match_info["sid"])
        if handler is None:
            return self._error(404, "no such session (its episode has ended)")
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return self._error(400, f"the request body is not JSON ({e})")
        if not isinstance(body, dict):
            return self._error(400, "the request body is not a JSON object")
        try:
            return web.json_response(await handler(body))
        except RequestError as e:
            return self._error(400, str(e))

    async def _models(self, request):
        from aiohttp import web

        if request.match_info["sid"] not in self.handlers:
            return self._error(404, "no such session (its episode has ended)")
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "p3o"}]}
        )
