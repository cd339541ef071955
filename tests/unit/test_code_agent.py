"""The code-tool task and its bundled agent (issue 64): the model's hermes ``python`` call runs
in the sandbox and its stdout comes back as the tool message, through the endpoint, token in and
token out; the final answer is scored against the task's value (computed here with Python's own
arithmetic); a snippet that spins gets the sandbox's outcome as its tool message and the episode
goes on. A scripted engine writes the turns (the shipped base and the recipe come later)."""

import pytest

from megatron_p3o.data.tasks import tool_code
from megatron_p3o.env.config import MultiTurnConfig
from megatron_p3o.env.types import EnvItem
from megatron_p3o.rollout.turns import build_turn_loop
from megatron_p3o.types import SamplingParams

from ..turn_recording import appended_spans, prefix_violations, record_turns


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    train, _ = tool_code.splits(2000, 10)
    return tool_code.make_tokenizer(tmp_path_factory.mktemp("tok"), train)


def scripted(tok, code_for, answer_for):
    """An engine whose first turn calls ``python`` with ``code_for(prompt)`` and whose second
    answers ``answer_for(tool output)``."""
    from .test_multiturn import ScriptedEngine

    eos, tool = tok.eos_token_id, tok.convert_tokens_to_ids("<|tool|>")

    def respond(ids, turn):
        if tool not in ids:
            expr = tok.decode(ids, skip_special_tokens=True)
            args = __import__("json").dumps({"code": code_for(expr)})
            text = f'<tool_call>{{"name": "python", "arguments": {args}}}</tool_call>'
            return tok.encode(text, add_special_tokens=False) + [eos]
        out = tok.decode(ids[ids.index(tool) + 1 :], skip_special_tokens=True).split("\n")[0]
        return tok.encode(answer_for(out), add_special_tokens=False) + [eos]

    return ScriptedEngine(tok, respond)


def rollout(tok, eng, n_prompts=6, n=2):
    cfg = MultiTurnConfig(agent="megatron_p3o.rollout.agents.code_agent:agent",
                          tool_parser="hermes", max_turns=3, max_total_tokens=200,
                          max_prompt_tokens=64, tool_timeout_s=10)  # fmt: skip
    loop = build_turn_loop(cfg, tok, True, (tok.eos_token_id,))
    rows = tool_code.splits(50, n_prompts)[1]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    sp = SamplingParams(max_new_tokens=80, stop_token_ids=(tok.eos_token_id,), seed=1)
    try:
        return loop.run(eng, [[0]] * len(rows), items, n, sp), rows
    finally:
        loop.close()


def test_the_snippet_runs_sandboxed_and_copying_its_output_is_rewarded(tok):
    eng = scripted(tok, tool_code.snippet, lambda out: out)
    calls = record_turns(eng)
    out, rows = rollout(tok, eng)
    assert prefix_violations(out, calls)["violations"] == 0
    for s in out:
        expr = rows[s.group_id]["prompt"]
        a, b, c = (int(x) for x in expr.replace("*", "+").split("+"))
        assert s.meta["status"] == "completed" and s.meta["turns"] == 2
        assert s.reward == 1.0 and rows[s.group_id]["answer"] == str(a * b + c)
        (span,) = appended_spans(s)  # the tool message: the sandbox's stdout, as text
        assert tok.decode(span, skip_special_tokens=False) == (
            f"<|tool|>{a * b + c}<|end|><|assistant|>"
        )


def test_a_wrong_answer_scores_zero_and_a_spinning_snippet_is_its_outcome(tok):
    eng = scripted(tok, tool_code.snippet, lambda out: "7")
    out, _ = rollout(tok, eng, n_prompts=2, n=1)
    assert [s.reward for s in out] == [0.0, 0.0]
    eng = scripted(tok, lambda expr: "while True: pass", lambda out: out)
    out, _ = rollout(tok, eng, n_prompts=2, n=1)
    for s in out:
        (span,) = appended_spans(s)
        # the CPU limit stops it, or the wall limit first on a loaded machine (CI saw both)
        text = tok.decode(span)
        assert ("[cpu_limit]" in text or "[timeout]" in text) and s.meta["status"] == "completed"
        assert s.reward == 0.0  # the outcome's text is not the answer
