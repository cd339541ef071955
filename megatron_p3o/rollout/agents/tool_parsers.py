"""Tool calls in a model turn's text, as OpenAI ``tool_calls``.

Why a parser of our own per family, and why after the tokens are recorded: the endpoint
(:mod:`.endpoint`) answers the agent in OpenAI's format, so the calls the model wrote in its
family's markup must become ``tool_calls``; the trainer trains on the tokens the engine sampled,
so the parser reads the turn's decoded text and never writes back (parsing cannot change what is
trained).

Formats (the one a recipe names, ``rollout.multi_turn.tool_parser``):

- ``hermes`` — Qwen2.5/Qwen3/Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call (several: parallel calls);
- ``qwen3_coder`` — Qwen3-Coder's XML: ``<tool_call><function=NAME><parameter=KEY>VALUE
  </parameter>...</function></tool_call>``; a value is converted by the type the request's tool
  schema gives its parameter (integer, number, boolean, object/array as JSON, ``null``), text
  otherwise;
- ``none`` — no parsing: the turn is content.

Malformed calls (the documented outcome): a block that does not parse (bad JSON, no name,
arguments that are not an object, an unclosed block, a function not in the request's ``tools``)
is not a call: its text stays in ``content`` where the model wrote it, and :attr:`ParsedTurn.errors`
says why (the endpoint counts them, ``mt_malformed_calls``). The agent sees what the model wrote;
nothing is dropped or invented.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from megatron_p3o.runtime.errors import ConfigError

PARSERS = ("hermes", "qwen3_coder", "none")


@dataclass
class ParsedTurn:
    """A turn's text split into ``content`` (everything that is not a well-formed call, as
    written, stripped at its ends) and ``tool_calls`` (OpenAI's form: ``{"id", "type":
    "function", "function": {"name", "arguments": <JSON text>}}``); ``errors``: one line per
    malformed block."""

    content: str
    tool_calls: List[dict] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)


def _call(name: str, arguments: dict, call_id: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _schemas(tools: Optional[Sequence[dict]]) -> Optional[Dict[str, dict]]:
    """Function name -> its parameters' JSON schema properties (None: no tools given, every
    name accepted)."""
    if not tools:
        return None
    out = {}
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(fn, dict) and "name" in fn:
            out[fn["name"]] = (fn.get("parameters") or {}).get("properties") or {}
    return out


_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _split_blocks(text: str, decode: Callable[[str, int], object]) -> ParsedTurn:
    """``<tool_call>`` blocks through ``decode(body, i)`` (a call dict, or an error string);
    the text around them and every block that failed stay content, in order."""
    kept, calls, errors, at = [], [], [], 0
    for m in _BLOCK.finditer(text):
        kept.append(text[at : m.start()])
        got = decode(m.group(1), len(calls))
        if isinstance(got, str):
            errors.append(f"tool call {len(calls) + len(errors) + 1}: {got}")
            kept.append(m.group(0))
        else:
            calls.append(got)
        at = m.end()
    rest = text[at:]
    if "<tool_call>" in rest:
        errors.append(f"tool call {len(calls) + len(errors) + 1}: unclosed <tool_call>")
    kept.append(rest)
    return ParsedTurn("".join(kept).strip(), calls, errors)


def parse_hermes(text: str, tools=None, id_prefix: str = "call") -> ParsedTurn:
    """Hermes JSON calls (module docstring)."""
    known = _schemas(tools)

    def decode(body: str, i: int):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return f"not JSON ({e.msg} at character {e.pos})"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return "no 'name'"
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return "'arguments' is text that is not JSON"
        if not isinstance(args, dict):
            return "'arguments' is not an object"
        if known is not None and obj["name"] not in known:
            return f"no tool named {obj['name']!r} in the request"
        return _call(obj["name"], args, f"{id_prefix}_{i}")

    return _split_blocks(text, decode)


_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _convert(value: str, schema: Optional[dict]):
    """A Qwen3-Coder parameter's text as the type its schema names (text when unknown); raises
    ValueError when it does not read as that type."""
    v = value[1:] if value.startswith("\n") else value
    v = v[:-1] if v.endswith("\n") else v
    if v.strip().lower() == "null":
        return None
    kind = (schema or {}).get("type", "string")
    if isinstance(kind, list):  # ["integer", "null"]
        kind = next((k for k in kind if k != "null"), "string")
    if kind in ("integer", "int"):
        return int(v.strip())
    if kind in ("number", "float"):
        x = float(v.strip())
        return int(x) if x.is_integer() and "." not in v and "e" not in v.lower() else x
    if kind in ("boolean", "bool"):
        if v.strip().lower() not in ("true", "false"):
            raise ValueError(f"{v.strip()!r} is not true or false")
        return v.strip().lower() == "true"
    if kind in ("object", "array"):
        return json.loads(v)
    return v


def parse_qwen3_coder(text: str, tools=None, id_prefix: str = "call") -> ParsedTurn:
    """Qwen3-Coder XML calls (module docstring)."""
    known = _schemas(tools)

    def decode(body: str, i: int):
        m = _FUNCTION.match(body)
        if m is None:
            return "no <function=...>...</function>"
        name, inner = m.group(1).strip(), m.group(2)
        if known is not None and name not in known:
            return f"no tool named {name!r} in the request"
        props = (known or {}).get(name, {})
        args = {}
        for p in _PARAM.finditer(inner):
            key = p.group(1).strip()
            try:
                args[key] = _convert(p.group(2), props.get(key))
            except (ValueError, json.JSONDecodeError) as e:
                return f"parameter {key!r}: {e}"
        if _PARAM.sub("", inner).strip():
            return "text outside <parameter=...> blocks"
        return _call(name, args, f"{id_prefix}_{i}")

    return _split_blocks(text, decode)


def parse_none(text: str, tools=None, id_prefix: str = "call") -> ParsedTurn:
    return ParsedTurn(text.strip())


def tool_parser(name: str) -> Callable[..., ParsedTurn]:
    """The parser a recipe names (``rollout.multi_turn.tool_parser``)."""
    table = {"hermes": parse_hermes, "qwen3_coder": parse_qwen3_coder, "none": parse_none}
    if name not in table:
        raise ConfigError(f"rollout.multi_turn.tool_parser={name!r}: one of {', '.join(PARSERS)}")
    return table[name]
