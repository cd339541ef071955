"""One agent episode's session: the OpenAI chat requests of the user's agent turned into engine
turns of one trajectory, token in and token out.

Why a session keeps the tokens, not the messages: the agent sees OpenAI messages (text), but the
ratio πθ/πb is taken on the tokens the engine sampled. So each request's messages are matched
against the messages the session's tokens already hold:

- the session's messages, then only non-assistant messages (tool results, user turns): those
  are appended as template pieces (mask 0, :func:`~.render.encode_messages` with
  ``after_assistant``) after the model's last turn, exactly as the environment loop appends an
  observation, and the engine continues from the kept ids;
- anything else — an assistant message that is not what the model generated (the agent edited,
  compacted or replaced its history), an earlier message changed or dropped, other ``tools`` —
  starts a new **segment**: the request's messages are rendered afresh as the prompt of a new
  token sequence. The tokens of the earlier segment are never re-tokenized.

The segment rule (how segments are trained): each segment is its own sample, sharing its
trajectory's reward, group and status; the group's baseline counts the trajectory once (its
first segment; ``megatron_p3o.advantage.turns``), and every segment gets that trajectory's
advantage.

Sampling is the recipe's (the behaviour log-probs must be the distribution the trainer scores):
a request's ``max_tokens`` / ``max_completion_tokens`` can only lower a turn's budget; its
``temperature``, ``top_p``, ``stop``, ``seed`` and the like are ignored; ``n`` > 1 and
``stream`` are refused (400). The turn's text is parsed for tool calls after its tokens are
recorded (:mod:`.tool_parsers`).
"""

from __future__ import annotations

import json
import time
from typing import List, Optional, Tuple

from megatron_p3o.rollout.agents.render import RenderError, content_text, encode_messages
from megatron_p3o.rollout.trajectory import Trajectory


class RequestError(Exception):
    """A request the session refuses (HTTP 400); ``ended``: the episode's budget is spent (its
    trajectory ends ``truncated``)."""

    def __init__(self, msg: str, ended: bool = False):
        super().__init__(msg)
        self.ended = ended


def _norm_calls(calls) -> tuple:
    out = []
    for c in calls or []:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return tuple(out)


def norm(m: dict) -> tuple:
    """What of a message the session compares: role, content text, tool calls (name and
    arguments as JSON values), the tool call it answers and its name."""
    if not isinstance(m, dict) or "role" not in m:
        raise RequestError("a message without a 'role'")
    return (m["role"], content_text(m.get("content")), _norm_calls(m.get("tool_calls")),
            m.get("tool_call_id"), m.get("name"))  # fmt: skip


class AgentSession:
    """The session of trajectory ``traj`` (its first segment; later ones are kept in
    :attr:`segments`), answering through ``turn`` (the loop's engine turn: ``await turn(traj,
    budget) -> (Sample, budget_left)``)."""

    def __init__(self, traj: Trajectory, tok, parser, max_turns: int, stop_ids,
                 max_prompt: int = 1 << 30):  # fmt: skip
        self.tok, self.parser, self.max_turns = tok, parser, max_turns
        self.max_prompt = max_prompt
        self.stop_ids = set(stop_ids)
        self.segments: List[Trajectory] = [traj]
        self.known: Optional[List[tuple]] = None  # the messages the current segment holds
        self.tools: Optional[list] = None
        self.turns = 0
        self.malformed = 0
        self.requests = 0

    @property
    def traj(self) -> Trajectory:
        return self.segments[-1]

    def prepare(self, body: dict) -> Tuple[Trajectory, Optional[int]]:
        """Check a request and append what it adds; the trajectory to continue and the
        request's own token limit (None: the recipe's)."""
        if body.get("stream"):
            raise RequestError("stream: true is not supported (one JSON answer per request)")
        if int(body.get("n", 1) or 1) != 1:
            raise RequestError(f"n={body.get('n')}: one choice per request")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("'messages' must be a non-empty list")
        if self.turns >= self.max_turns:
            raise RequestError(f"the episode's max_turns ({self.max_turns}) are used", ended=True)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        tools = body.get("tools") or None
        new = [norm(m) for m in msgs]
        t = self.traj
        k = len(self.known) if self.known is not None else 0
        extends = (self.known is not None and tools == self.tools and len(new) > k
                   and new[:k] == self.known
                   and all(m[0] != "assistant" for m in new[k:]))  # fmt: skip
        try:
            if extends:
                ids = encode_messages(self.tok, msgs[k:], tools, after_assistant=True)
                if t.last_finish == "stop" and ids and ids[0] in self.stop_ids:
                    ids = ids[1:]  # the model's own stop token closed its turn already
                t.append(ids, False)
            else:
                ids = encode_messages(self.tok, msgs, tools)
                if len(ids) > self.max_prompt:
                    raise RequestError(
                        f"the conversation is {len(ids)} tokens, above rollout.multi_turn."
                        f"max_prompt_tokens={self.max_prompt}"
                    )
                if t.turns:  # a new segment
                    t = Trajectory(t.index, t.group, ids)
                    self.segments.append(t)
                else:
                    t.prompt = ids
        except RenderError as e:
            raise RequestError(str(e)) from None
        self.known, self.tools = new, tools
        self.requests += 1
        return t, (int(limit) if limit else None)

    def answer(self, t: Trajectory, sample, model: str) -> dict:
        """The OpenAI chat completion for the turn just taken (its tokens already in ``t``)."""
        self.turns += 1
        a, b = t.spans[-1]
        ids = t.ids[a:b]
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.tok.decode(ids, skip_special_tokens=False)
        parsed = self.parser(text, self.tools, id_prefix=f"call_{t.index}_{self.turns}")
        self.malformed += len(parsed.errors)
        msg = {"role": "assistant", "content": parsed.content or None}
        if parsed.tool_calls:
            msg["tool_calls"] = parsed.tool_calls
            t.tool_calls += len(parsed.tool_calls)  # meta["tool_calls"]: the calls parsed
            finish = "tool_calls"
        else:
            finish = "stop" if sample.finish_reason == "stop" else "length"
        self.known.append(norm(msg))
        return {
            "id": f"chatcmpl-{t.index}-{self.turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": len(t.prompt) + a,
                "completion_tokens": b - a,
                "total_tokens": len(t.prompt) + b,
            },
        }

    def finish(self, status: str, reward: float, error: Optional[str] = None) -> None:
        """Every segment ends with the episode's status (unless one of its own ended it:
        ``truncated``) and the episode's reward, on its last turn."""
        for t in self.segments:
            t.status = status if status == "aborted" else (t.status or status)
            t.error = t.error or error
            t.turn_rewards = [0.0] * max(0, t.turns - 1) + [float(reward)] * min(1, t.turns)

    def samples(self):
        """One sample per segment with a model turn (the segment rule, module docstring)."""
        segs = [t for t in self.segments if t.turns] or self.segments[:1]
        out = []
        for i, t in enumerate(segs):
            s = t.sample()
            s.meta.update(trajectory=t.index, segment=i, segments=len(segs), requests=self.requests,
                          malformed_calls=self.malformed)  # fmt: skip
            out.append(s)
        return out
