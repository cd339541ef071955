"""Agents the tests bring (issue 64), written as a user writes one: an ``async def (client,
item)`` against the ``openai`` client, returning the episode's reward."""

import asyncio

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "run a Python snippet",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    }
]
RESULT = "result: 42"


def tool_result(turn: int) -> str:
    return f"{RESULT} (turn {turn})"


async def three_turns(client, item):
    """Three model turns; after each of the first two a tool message (answering the turn's
    parsed calls, or a call id of its own when the model made none)."""
    msgs = [{"role": "user", "content": item["prompt"]}]
    for turn in range(3):
        r = await client.chat.completions.create(model="p3o-policy", messages=msgs, tools=TOOLS)
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        if turn < 2:
            ids = [c.id for c in m.tool_calls or []] or [f"own_{turn}"]
            for i in ids:
                msgs.append({"role": "tool", "tool_call_id": i, "content": tool_result(turn)})
    return 1.0 if "4" in (m.content or "") else 0.0


async def edits_its_history(client, item):
    """Two turns, then the first answer replaced by the agent's own text (a compaction): the
    third request starts a new segment."""
    msgs = [{"role": "user", "content": item["prompt"]}]
    for turn in range(3):
        r = await client.chat.completions.create(model="p3o-policy", messages=msgs, tools=TOOLS)
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": f"own_{turn}", "content": tool_result(turn)})
        if turn == 1:
            msgs[1] = {"role": "assistant", "content": "(summary of my first answer)"}
    return float(item["index"] % 2)


async def raises(client, item):
    await client.chat.completions.create(
        model="p3o-policy", messages=[{"role": "user", "content": item["prompt"]}]
    )
    if item["index"] == 1:
        raise RuntimeError("the agent's own bug")
    return 1.0


async def sleeps(client, item):
    await asyncio.sleep(3600)


async def streams(client, item):
    await client.chat.completions.create(
        model="p3o-policy", messages=[{"role": "user", "content": item["prompt"]}], stream=True
    )
    return 1.0


async def until_refused(client, item):
    """Asks again and again; the reward it returns when the session refuses (its budget)."""
    import openai

    msgs = [{"role": "user", "content": item["prompt"]}]
    try:
        while True:
            r = await client.chat.completions.create(model="p3o-policy", messages=msgs)
            msgs.append(r.choices[0].message.model_dump(exclude_none=True))
            msgs.append({"role": "user", "content": "more"})
    except openai.BadRequestError:
        return 0.5


async def with_mcp_tools(client, item):
    """Passes the recipe's MCP tools to the template and, after each of two turns, calls one
    (``add``, the turn's numbers) and sends its result back as the tool message."""
    box = item["tools"]
    msgs = [{"role": "user", "content": item["prompt"]}]
    for turn in range(3):
        r = await client.chat.completions.create(model="p3o-policy", messages=msgs,
                                                 tools=box.schemas)  # fmt: skip
        msgs.append(r.choices[0].message.model_dump(exclude_none=True))
        if turn < 2:
            text, ok = await box.call("add", {"a": item["index"], "b": turn})
            assert ok, text
            msgs.append({"role": "tool", "tool_call_id": f"own_{turn}", "content": text})
    return 1.0


async def counts_calls(client, item):
    """Three turns; each turn's parsed tool calls answered by id; the reward is the number of
    calls it was given (the parser's output, as the agent sees it)."""
    msgs = [{"role": "user", "content": item["prompt"]}]
    seen = 0
    for turn in range(3):
        r = await client.chat.completions.create(model="p3o-policy", messages=msgs, tools=TOOLS)
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        for c in m.tool_calls or []:
            assert c.function.name == "python" and r.choices[0].finish_reason == "tool_calls"
            seen += 1
            msgs.append({"role": "tool", "tool_call_id": c.id, "content": tool_result(turn)})
        if not m.tool_calls:
            break
    return float(seen)
