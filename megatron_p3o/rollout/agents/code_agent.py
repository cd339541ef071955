"""The bundled code agent (``rollout.multi_turn.agent:
megatron_p3o.rollout.agents.code_agent:agent``), written as a user writes one: the ``openai``
client, the hermes tool calls the endpoint parses, and the sandbox for the code.

Each turn: the model answers; each ``python`` call it made runs in the sandbox
(:func:`megatron_p3o.env.sandbox.run_python`, :data:`LIMITS`) and its output (or the sandbox's
outcome, e.g. ``[timeout]``) is the tool message; a turn without a call is the final answer,
scored by the task's reward (exact match). A call to another tool is answered with an error; at
most :data:`MAX_CALLS` calls run, then the episode's reward is 0.
"""

from __future__ import annotations

import json

from megatron_p3o.env.sandbox import Limits, run_python

LIMITS = Limits(wall_s=5.0, cpu_s=2, memory_mb=256, files_mb=1, output_bytes=256)
MAX_CALLS = 2


async def agent(client, item) -> float:
    from megatron_p3o.data.tasks.tool_code import PYTHON_TOOL, reward

    msgs = [{"role": "user", "content": item["prompt"]}]
    calls = 0
    while True:
        r = await client.chat.completions.create(model="policy", messages=msgs,
                                                 tools=[PYTHON_TOOL])  # fmt: skip
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        if not m.tool_calls:
            return reward(m.content or "", item["answer"])
        for c in m.tool_calls:
            calls += 1
            if calls > MAX_CALLS:
                return 0.0
            msgs.append({"role": "tool", "tool_call_id": c.id, "content": await _run(c)})


async def _run(call) -> str:
    if call.function.name != "python":
        return f"error: no tool named {call.function.name!r}"
    try:
        code = json.loads(call.function.arguments).get("code", "")
    except (json.JSONDecodeError, AttributeError):
        return "error: the arguments are not a JSON object"
    if not isinstance(code, str):
        return "error: 'code' is not text"
    return (await run_python(code, LIMITS)).text().strip()
