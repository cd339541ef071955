"""An environment of the OpenEnv standard, served by its own server, as a rollout environment.

OpenEnv (``openenv-core``, Meta/PyTorch) serves an environment as a FastAPI app; a client holds
one WebSocket session per episode at ``<url>/ws`` and sends JSON messages ``{"type": "reset",
"data": {...}}``, ``{"type": "step", "data": <action>}`` and ``{"type": "close"}``; the server
answers ``{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}`` or
``{"type": "error", "data": {"message", "code"}}`` (``openenv.core.env_client.EnvClient``, the
SDK's own client, speaks the same messages). The server and the SDK live in their own virtual
environment (``tools/openenv_env.sh``; the SDK's requirements conflict with the trainer's
pins), the trainer speaks the protocol over ``aiohttp`` and imports nothing of OpenEnv.

Mapping text to the standard's typed actions and back, by keys (``env_args``):
``action_key`` is the action field that carries the model's turn (text, stop token removed;
``action`` adds fixed fields), ``observation_key`` the observation field shown to the model
(None: the observation's fields as JSON). The step's ``reward`` (None is 0) adds to the
trajectory's; ``done`` ends it. ``reset`` sends the episode's seed (``reset`` adds fields, such
as the prompt's answer under a key the environment reads: ``answer_key``).

An ``async def step`` environment: it runs on the rollout's event loop (its waits are the
server's), bounded by ``rollout.multi_turn.tool_timeout_s`` like every step; a server error or
a closed connection is the step's failure (the error observation); a session refused because
the server is at its ``max_concurrent_envs`` is waited for (:meth:`OpenEnvClient.reset`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, Optional

from megatron_p3o.env.types import EnvItem, StepResult


class OpenEnvError(RuntimeError):
    """The server answered with an error (``code``: its error code), or the session could not
    be held."""

    def __init__(self, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.code = code


class OpenEnvClient:
    """One episode of an OpenEnv environment at ``url`` (``http://host:port``).

    ``rollout.multi_turn.env: megatron_p3o.env.openenv_client:OpenEnvClient`` with
    ``env_args: {url: ..., action_key: message, observation_key: echoed_message}``."""

    def __init__(
        self,
        url: str,
        action_key: str = "message",
        observation_key: Optional[str] = None,
        action: Optional[Dict[str, Any]] = None,
        reset: Optional[Dict[str, Any]] = None,
        answer_key: Optional[str] = None,
        show_reset: bool = True,
        max_message_bytes: int = 1 << 20,
    ):
        if not str(url).startswith(("http://", "https://")):
            raise ValueError(f"env_args.url: {url!r} is not an http(s) URL of an OpenEnv server")
        self.url = str(url).rstrip("/")
        self.action_key, self.observation_key = action_key, observation_key
        self.action, self.reset_args = dict(action or {}), dict(reset or {})
        self.answer_key, self.show_reset = answer_key, show_reset
        self.max_message_bytes = max_message_bytes
        self._session = self._ws = None

    async def _open(self) -> None:
        import aiohttp

        ws_url = "ws" + self.url[len("http") :] + "/ws"
        self._session = aiohttp.ClientSession()
        try:
            self._ws = await self._session.ws_connect(ws_url, max_msg_size=self.max_message_bytes)
        except Exception as e:
            await self._session.close()
            self._session = None
            raise OpenEnvError(f"OpenEnv server {self.url}: {type(e).__name__}: {e}") from None

    async def _ask(self, message: dict) -> dict:
        import aiohttp

        await self._ws.send_str(json.dumps(message))
        msg = await self._ws.receive()
        if msg.type != aiohttp.WSMsgType.TEXT:
            raise OpenEnvError(f"OpenEnv server {self.url}: the session ended ({msg.type.name})")
        reply = json.loads(msg.data)
        if reply.get("type") == "error":
            d = reply.get("data", {})
            code = d.get("code")
            raise OpenEnvError(f"OpenEnv server {self.url}: {code}: {d.get('message')}", code)
        if reply.get("type") != "observation":
            raise OpenEnvError(f"OpenEnv server {self.url}: unexpected {reply.get('type')!r}")
        return reply.get("data", {})

    def _text(self, data: dict) -> Optional[str]:
        obs = data.get("observation") or {}
        if self.observation_key is None:
            return json.dumps(obs, sort_keys=True)
        if self.observation_key not in obs:
            raise OpenEnvError(
                f"env_args.observation_key {self.observation_key!r}: not a field of the "
                f"observation (fields {sorted(obs)})"
            )
        v = obs[self.observation_key]
        return None if v is None else str(v)

    async def reset(self, item: EnvItem) -> Optional[str]:
        """A session, then the reset. A server at its ``max_concurrent_envs`` refuses the
        session (``CAPACITY_REACHED``): the episode waits for a free one, asking again with
        backoff (50 ms doubling to 1 s), as long as ``tool_timeout_s`` allows."""
        data = {"seed": item.seed, **self.reset_args}
        if self.answer_key is not None:
            data[self.answer_key] = item.answer
        wait = 0.05
        while True:
            await self._open()
            try:
                out = await self._ask({"type": "reset", "data": data})
                break
            except OpenEnvError as e:
                if e.code != "CAPACITY_REACHED":
                    raise
            await self.aclose()
            await asyncio.sleep(wait)
            wait = min(1.0, 2 * wait)
        return self._text(out) if self.show_reset else None

    async def step(self, turn: str) -> StepResult:
        out = await self._ask({"type": "step", "data": {**self.action, self.action_key: turn}})
        done = bool(out.get("done", False))
        text = None if done else self._text(out)
        return StepResult(observation=text, reward=float(out.get("reward") or 0.0), done=done)

    async def aclose(self) -> None:
        """End the session (the server frees its slot) and the connection."""
        try:
            if self._ws is not None and not self._ws.closed:
                await self._ws.send_str(json.dumps({"type": "close"}))
                await self._ws.close()
        finally:
            if self._session is not None:
                await self._session.close()
            self._session = self._ws = None
