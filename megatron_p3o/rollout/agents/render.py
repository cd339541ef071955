"""OpenAI chat messages as token ids: a whole conversation (a session's first request, or a new
segment), or only the messages appended after the model's last turn.

Why sentinels: the template's own text (role headers, end-of-turn markers, the tools' system
block) is encoded with its control tokens, but every message's *content* — what a user, a tool
or the agent wrote — is encoded as text, special-token text included
(:func:`~megatron_p3o.rollout.chat_pieces.encode_observation`), so nothing a tool returns can
forge a turn. Each content is rendered as a sentinel, the render is cut at the sentinels, and
the pieces are encoded each their own way; the result decodes to the template's real render of
the real messages (checked; a template that rewrites content, as Llama-3's ``| trim`` does, is
matched by trimming, else refused in one line).

Appended messages are rendered after a stand-in assistant turn and taken from the end of its
content on (as :class:`~megatron_p3o.rollout.chat_pieces.ChatPieces`): the model's own tokens
are never rendered again.
"""

from __future__ import annotations

import json
import re
from typing import List, Optional, Sequence

from megatron_p3o.rollout.chat_pieces import encode_observation
from megatron_p3o.runtime.errors import UserError

_SENT = "\x02C{}\x02"
_SENT_RE = re.compile("\x02C(\\d+)\x02")
_ASSISTANT = "\x01ASSISTANT\x01"


class RenderError(UserError, ValueError):
    """A conversation the chat template cannot render as the session needs (the message says
    which message and why)."""


def content_text(content) -> str:
    """A message's content as text: None -> "", a list of parts -> their text joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                out.append(str(part.get("text", "")))
            elif isinstance(part, str):
                out.append(part)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RenderError(f"a message content part of type {kind!r} (text only)")
        return "".join(out)
    raise RenderError(f"a message content of type {type(content).__name__}")


def _for_template(m: dict, content: str) -> dict:
    """``m`` as transformers' chat templates take it: the given content, tool-call arguments
    as objects (templates ``tojson`` them)."""
    out = {"role": m["role"], "content": content}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            out[key] = m[key]
    calls = []
    for c in m.get("tool_calls") or []:
        fn = dict(c.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append({"type": "function", "id": c.get("id"), "function": fn})
    if calls:
        out["tool_calls"] = calls
    return out


def _render(tok, msgs, tools) -> str:
    try:
        return tok.apply_chat_template(
            msgs, tools=tools or None, tokenize=False, add_generation_prompt=True
        )
    except Exception as e:  # noqa: BLE001 - jinja's errors name the template's own reason
        raise RenderError(f"the chat template cannot render these messages ({e})") from None


def _encode(tok, messages, tools, after_assistant: bool, strip: bool) -> tuple:
    texts = [content_text(m.get("content")) for m in messages]
    if strip:
        texts = [t.strip() for t in texts]
    lead = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _ASSISTANT}]
    lead = lead if after_assistant else []
    sent = lead + [_for_template(m, _SENT.format(i)) for i, m in enumerate(messages)]
    real = lead + [_for_template(m, t) for m, t in zip(messages, texts)]
    text, want = _render(tok, sent, tools), _render(tok, real, tools)
    if after_assistant:
        if _ASSISTANT not in text or _ASSISTANT not in want:
            raise RenderError("the chat template drops an assistant turn's content")
        text = text[text.index(_ASSISTANT) + len(_ASSISTANT) :]
        want = want[want.index(_ASSISTANT) + len(_ASSISTANT) :]
    ids: List[int] = []
    at = 0
    for m in _SENT_RE.finditer(text):
        ids += tok.encode(text[at : m.start()], add_special_tokens=False)
        ids += encode_observation(tok, texts[int(m.group(1))])
        at = m.end()
    ids += tok.encode(text[at:], add_special_tokens=False)
    got = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return ids, got == want, want


def encode_messages(tok, messages: Sequence[dict], tools: Optional[list] = None,
                    after_assistant: bool = False) -> List[int]:  # fmt: skip
    """The ids of ``messages`` rendered by the chat template with the generation prompt
    (``after_assistant``: only what follows a model turn's content — the end of that turn,
    the messages, the next generation prompt). Raises :class:`RenderError`."""
    ids, ok, want = _encode(tok, messages, tools, after_assistant, strip=False)
    if not ok:
        ids, ok, _ = _encode(tok, messages, tools, after_assistant, strip=True)
    if not ok:
        raise RenderError(
            "the chat template's render of the messages is not reproduced piece by piece "
            f"(its end: {want[-80:]!r})"
        )
    return ids
