"""Tool-call parsers (issue 64): fixtures of each format — single, parallel and malformed calls —
give the documented ``tool_calls`` and content (megatron_p3o/rollout/agents/tool_parsers.py's
docstring); the expected values are written out by hand here."""

import json

import pytest

from megatron_p3o.rollout.agents.tool_parsers import tool_parser
from megatron_p3o.runtime.errors import ConfigError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "scale": {"type": "number"},
                    "tags": {"type": "array"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    },
]


def calls(parsed):
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls
    ]


def test_hermes_single_call_and_its_openai_form():
    call = '{"name": "python", "arguments": {"code": "print(6*7)"}}'
    text = f"Let me run it.\n<tool_call>\n{call}\n</tool_call>"
    p = tool_parser("hermes")(text, TOOLS, id_prefix="call_3_1")
    assert p.content == "Let me run it."
    assert p.errors == []
    assert p.tool_calls == [
        {
            "id": "call_3_1_0",
            "type": "function",
            "function": {"name": "python", "arguments": '{"code": "print(6*7)"}'},
        }
    ]


def test_hermes_parallel_calls_keep_their_order_and_text_between():
    text = (
        '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>\n'
        "and\n"
        '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    )
    p = tool_parser("hermes")(text, TOOLS)
    assert calls(p) == [("weather", {"city": "Paris", "days": 2}), ("weather", {"city": "Oslo"})]
    assert [c["id"] for c in p.tool_calls] == ["call_0", "call_1"]
    assert p.content == "and"


@pytest.mark.parametrize(
    "block, why",
    [
        ('{"name": "python", "arguments": {"code": 1}', "not JSON"),
        ('{"arguments": {"code": "1"}}', "no 'name'"),
        ('{"name": "python", "arguments": [1, 2]}', "'arguments' is not an object"),
        ('{"name": "python", "arguments": "{oops"}', "is text that is not JSON"),
        ('{"name": "shell", "arguments": {}}', "no tool named 'shell'"),
    ],
)
def test_a_malformed_hermes_call_stays_content_and_is_counted(block, why):
    good = '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
    text = f"a <tool_call>{block}</tool_call> b {good}"
    p = tool_parser("hermes")(text, TOOLS)
    assert calls(p) == [("python", {"code": "1"})]  # the well-formed one still parses
    assert p.content == f"a <tool_call>{block}</tool_call> b"  # as the model wrote it
    assert len(p.errors) == 1 and why in p.errors[0], p.errors


def test_an_unclosed_call_is_content():
    text = 'ok <tool_call>{"name": "python", "arguments": {"code": "1"}}'
    p = tool_parser("hermes")(text, TOOLS)
    assert p.tool_calls == [] and p.content == text
    assert "unclosed" in p.errors[0]


def test_without_tools_in_the_request_every_name_is_taken():
    p = tool_parser("hermes")('<tool_call>{"name": "any", "arguments": {}}</tool_call>', None)
    assert calls(p) == [("any", {})] and p.content == ""


def test_qwen3_coder_converts_values_by_the_schema():
    text = (
        "I will check.\n<tool_call>\n<function=weather>\n"
        "<parameter=city>\nSão Paulo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n"
        "<parameter=metric>\nTrue\n</parameter>\n"
        "<parameter=scale>\n1.5\n</parameter>\n"
        '<parameter=tags>\n["a", 2]\n</parameter>\n'
        "<parameter=note>\nnull\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    p = tool_parser("qwen3_coder")(text, TOOLS)
    assert p.errors == [] and p.content == "I will check."
    want = {"city": "São Paulo", "days": 3, "metric": True, "scale": 1.5, "tags": ["a", 2],
            "note": None}  # fmt: skip
    assert calls(p) == [("weather", want)]


def test_qwen3_coder_keeps_multi_line_text_and_parallel_calls():
    code = "x = 6\nprint(x * 7)"
    text = (
        f"<tool_call>\n<function=python>\n<parameter=code>\n{code}\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=weather>\n<parameter=city>\nRome\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    p = tool_parser("qwen3_coder")(text, TOOLS)
    assert calls(p) == [("python", {"code": code}), ("weather", {"city": "Rome"})]


@pytest.mark.parametrize(
    "body, why",
    [
        ("<parameter=city>\nRome\n</parameter>", "no <function=...>"),
        ("<function=weather>\n<parameter=days>\nthree\n</parameter>\n</function>", "'days'"),
        ("<function=weather>\n<parameter=metric>\nyes\n</parameter>\n</function>", "'metric'"),
        ("<function=weather>\nloose text\n</function>", "outside <parameter"),
        ("<function=shell>\n</function>", "no tool named 'shell'"),
    ],
)
def test_a_malformed_qwen3_coder_call_stays_content(body, why):
    text = f"<tool_call>\n{body}\n</tool_call>"
    p = tool_parser("qwen3_coder")(text, TOOLS)
    assert p.tool_calls == [] and p.content == text.strip()
    assert len(p.errors) == 1 and why in p.errors[0], p.errors


def test_none_parses_nothing_and_an_unknown_parser_names_the_key():
    text = '<tool_call>{"name": "python", "arguments": {}}</tool_call>'
    p = tool_parser("none")(text, TOOLS)
    assert p.tool_calls == [] and p.content == text
    with pytest.raises(ConfigError, match="rollout.multi_turn.tool_parser='xml'"):
        tool_parser("xml")
