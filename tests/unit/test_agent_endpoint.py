"""Bring your own agent (issue 64): agents written against the ``openai`` client drive episodes
through the rollout's OpenAI-compatible endpoint, answered by the embedded engine. What is
trained is the engine's tokens: prefix invariant, ℓb as the engine gave them, mask-0 spans that
are exactly the appended messages (the template's text, written out by hand here), e_B = 1 on
policy at fp32 against a float64 transformers forward; an agent that edits its history starts a
new segment; faults end their episode in the documented status."""

import json

import pytest
import torch

from megatron_p3o.data.tasks import tool_calc
from megatron_p3o.env.config import MultiTurnConfig
from megatron_p3o.env.types import EnvItem
from megatron_p3o.rollout.chat_pieces import encode_observation
from megatron_p3o.rollout.turns import build_turn_loop
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.types import SamplingParams

from ..agents import TOOLS, tool_result
from ..turn_recording import appended_spans, prefix_violations, record_turns

# a ChatML template with tools (Qwen's layout): the tools' system block, tool answers as user
# turns in <tool_response>, an assistant's tool calls as hermes blocks
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tool_calc.make_tokenizer(d, tool_calc.splits(2000, 10)[0])
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(d)
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.eos_token = "<|im_end|>"
    t.chat_template = TEMPLATE
    return t


@pytest.fixture(scope="module")
def model(tok):
    """A tiny Llama over ``tok`` whose turns end both ways (test_chat_templates' own), with room
    for the tools' system block."""
    from .test_chat_templates import _model

    return _model(tok, positions=2048)


def engine_for(model):
    from megatron_p3o.rollout.embedded import EmbeddedEngine

    cfg, ref = model
    e = EmbeddedEngine(cfg, "fp32", pad_token_id=0)
    e.update_weights([list(ref.state_dict().items())], 0)
    return e


def rollout(tok, engine, agent, n_prompts=17, n=3, k=5, **mt):
    mt = {"max_turns": 3, "max_total_tokens": 200, **mt}
    cfg = MultiTurnConfig(agent=f"tests.agents:{agent}", tool_parser="hermes", **mt)
    loop = build_turn_loop(cfg, tok, True, (tok.eos_token_id,))
    rows = tool_calc.splits(100, n_prompts)[1]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    prompts = [[0]] * len(rows)  # an agent's first request is its prompt
    sp = SamplingParams(max_new_tokens=k, stop_token_ids=(tok.eos_token_id,), seed=3)
    try:
        return loop.run(engine, prompts, items, n, sp)
    finally:
        loop.close()


def dec(tok, ids):
    return tok.decode(list(ids), skip_special_tokens=False)


def test_the_trained_tokens_are_the_engines_through_the_endpoint(tok, model):
    engine = engine_for(model)
    calls = record_turns(engine)
    out = rollout(tok, engine, "three_turns")
    inv = prefix_violations(out, calls)
    assert inv["episodes"] >= 50 and inv["turns"] >= 150 and inv["violations"] == 0, inv
    paths = set()
    for k, s in enumerate(out):
        assert s.meta["status"] == "completed" and s.meta["segments"] == 1
        # the prompt: the template's render of the agent's first request, tools included
        head = dec(tok, s.prompt_ids)
        assert head.startswith("<|im_start|>system\n# Tools\n" + json.dumps(TOOLS[0]))
        assert head.endswith("<|im_end|>\n<|im_start|>assistant\n")
        spans = appended_spans(s)
        assert len(spans) == 2
        for turn, ((_, out_ids, _, fin), span) in enumerate(zip(calls[k], spans)):
            paths.add(fin)
            closing = "\n" if fin == "stop" else "<|im_end|>\n"
            text = tool_result(turn)
            want = (closing + "<|im_start|>user\n<tool_response>\n" + text
                    + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
            assert dec(tok, span) == want
            obs = encode_observation(tok, text)
            at = len(tok.encode(closing + "<|im_start|>user\n<tool_response>\n",
                                add_special_tokens=False))  # fmt: skip
            assert span[at : at + len(obs)] == obs  # the content, encoded as text
            if fin == "stop":
                assert out_ids[-1] == tok.eos_token_id
    assert paths == {"stop", "length"}
    from .test_chat_templates import ess, ratios

    r = ratios(model[1], out)
    assert float((r - 1).abs().max()) < 1e-5
    assert abs(ess(r) - 1.0) < 1e-6


def test_an_agent_that_edits_its_history_starts_a_new_segment(tok, model):
    from megatron_p3o.advantage.turns import step_advantages

    engine = engine_for(model)
    calls = record_turns(engine)
    out = rollout(tok, engine, "edits_its_history", n_prompts=4, n=2)
    assert len(out) == 16  # 8 trajectories, 2 segments each
    by = {}
    for s in out:
        by.setdefault(s.meta["trajectory"], []).append(s)
    for k, (a, b) in by.items():
        assert (a.meta["segment"], b.meta["segment"]) == (0, 1)
        assert a.meta["turns"] == 2 and b.meta["turns"] == 1
        # the first segment holds the engine's two turns as sampled; the second starts from the
        # template's render of the edited conversation (never a re-tokenized first segment)
        (i0, o0, l0, _), (i1, o1, l1, _), (i2, o2, l2, _) = calls[k]
        assert a.prompt_ids == i0 and a.prompt_ids + a.completion_ids == i1 + o1
        assert a.logprobs[: len(l0)] == l0 and a.logprobs[-len(l1) :] == l1
        assert i2 == b.prompt_ids and b.completion_ids == o2 and b.logprobs == l2
        text = dec(tok, b.prompt_ids)
        assert "<|im_start|>assistant\n(summary of my first answer)<|im_end|>" in text
        assert a.reward == b.reward == float(k // 2 % 2)
    # the segment rule: each trajectory counts once in its group's baseline, every segment
    # gets its trajectory's advantage (GRPO over the 2 trajectories of each prompt)
    rewards = torch.tensor([s.reward for s in out], dtype=torch.float64)
    groups = torch.tensor([s.group_id for s in out])
    adv = step_advantages(out, rewards, groups, None, "grpo", 1e-6)
    for s, a in zip(out, adv.tolist()):
        mates = [x.reward for x in out if x.group_id == s.group_id and x.meta["segment"] == 0]
        mean = sum(mates) / len(mates)
        std = (sum((x - mean) ** 2 for x in mates) / len(mates)) ** 0.5
        assert a == pytest.approx((s.reward - mean) / (std + 1e-6))


def test_faults_end_their_episode_in_the_documented_status(tok, model, capfd):
    engine = engine_for(model)
    out = rollout(tok, engine, "raises", n_prompts=3, n=1)
    assert [s.meta["status"] for s in out] == ["completed", "aborted", "completed"]
    assert out[1].reward == 0 and sum(out[1].policy_mask) == 0
    err = capfd.readouterr().err
    assert "rollout.multi_turn.agent=tests.agents:raises: data item 1" in err
    assert "RuntimeError: the agent's own bug" in err
    out = rollout(tok, engine, "until_refused", n_prompts=2, n=1, max_turns=8,
                  max_total_tokens=30)  # fmt: skip
    assert {s.meta["status"] for s in out} == {"truncated"}
    assert all(s.reward == 0.5 for s in out)  # the agent handled the refusal: its reward
    assert all(len(s.completion_ids) <= 30 for s in out)


@pytest.mark.parametrize("agent, why", [("streams", "stream: true is not supported"),
                                        ("sleeps", "ran past 1 s")])  # fmt: skip
def test_streaming_and_a_hung_agent_abort_their_episodes_in_one_line(tok, model, agent, why):
    from megatron_p3o.rollout.turns import AllAborted

    with pytest.raises(AllAborted, match=why):
        rollout(tok, engine_for(model), agent, n_prompts=2, n=1, episode_timeout_s=1)


@pytest.mark.parametrize(
    "kw, msg",
    [
        (
            dict(env="tests.envs:EchoEnv", agent="tests.agents:raises"),
            "env and agent are exclusive",
        ),
        (dict(agent="tests.agents"), "must be 'module:function'"),
        (dict(agent="tests.agents:raises", credit="turn"), "credit=turn needs per-turn rewards"),
    ],
)
def test_agent_config_errors_name_the_key(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        MultiTurnConfig(**kw)


def test_an_agent_that_is_not_async_or_not_there_is_one_error(tok):
    for spec, msg in [("tests.agents:TOOLS", "must be an 'async def'"),
                      ("tests.agents:nope", "cannot be imported")]:  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            build_turn_loop(MultiTurnConfig(agent=spec), tok, True, (tok.eos_token_id,))


def test_mcp_tools_reach_the_template_and_their_results_come_back_as_text(tok, model, tmp_path):
    """The recipe's MCP server (tests/mcp_server.py over stdio): its tools are rendered in the
    prompt's tools block, its results are the tool messages' tokens (encoded as text)."""
    import sys
    from pathlib import Path

    server = str(Path(__file__).resolve().parent.parent / "mcp_server.py")
    spec = {"command": sys.executable, "args": [server, "stdio", str(tmp_path / "pids")]}
    out = rollout(tok, engine_for(model), "with_mcp_tools", n_prompts=3, n=2, mcp_servers=[spec],
                  max_prompt_tokens=1600)  # fmt: skip
    assert len(out) == 6
    for s in out:
        assert s.meta["status"] == "completed" and s.reward == 1.0
        head = dec(tok, s.prompt_ids)
        assert '"name": "add"' in head and '"name": "spin"' in head  # the server's schemas
        spans = appended_spans(s)
        for turn, span in enumerate(spans):
            result = str(s.meta["trajectory"] // 2 + turn)  # add(a=item index, b=turn)
            assert "<tool_response>\n" + result + "\n</tool_response>" in dec(tok, span)
    assert len((tmp_path / "pids").read_text().split()) == 1  # one server for the rollout


def test_tool_calls_the_engine_writes_reach_the_agent_and_the_tokens_stay_the_engines(tok):
    """A scripted engine writes a hermes call in its first two turns and an answer in its third
    (the tool task's tokenizer, 51 episodes): the agent gets two parsed calls per episode, and the
    recorded completion tokens of every turn are exactly the engine's (parsing reads them only)."""
    from .test_multiturn import ScriptedEngine

    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
    eos = tok.eos_token_id
    call_ids = tok.encode(call, add_special_tokens=False) + [eos]
    answer_ids = tok.encode("42", add_special_tokens=False) + [eos]

    def respond(ids, turn):  # a call in the first two turns, then the answer: the prompt (tools,
        made = (ids.count(eos) - 2) // 2  # user) ends 2 turns, each turn and tool answer 1 more
        return call_ids if made < 2 else answer_ids

    eng = ScriptedEngine(tok, respond)
    calls = record_turns(eng)
    out = rollout(tok, eng, "counts_calls", k=len(call_ids) + 8, max_total_tokens=1000)
    inv = prefix_violations(out, calls)
    assert inv["episodes"] >= 50 and inv["turns"] >= 150 and inv["violations"] == 0, inv
    for k, s in enumerate(out):
        assert s.reward == 2.0 and s.meta["malformed_calls"] == 0, s.meta
        assert s.meta["tool_calls"] == 2  # the calls parsed, counted per trajectory
        outs = [o for _, o, _, _ in calls[k]]
        assert outs == [call_ids, call_ids, answer_ids]
        a, b = s.meta["turn_spans"][0]
        assert s.completion_ids[a:b] == call_ids  # as the engine wrote them


def test_a_missing_client_package_is_one_error_when_the_loop_is_built(tok, monkeypatch):
    """Without the agents extra (openai, aiohttp; mcp with mcp_servers) the loop is refused when
    it is built, in one line naming the key and the install — not at the first rollout."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n in ("openai", "mcp") else real(n, *a))  # fmt: skip
    cfg = MultiTurnConfig(agent="tests.agents:three_turns")
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.agent needs openai: pip install"):
        build_turn_loop(cfg, tok, True, (tok.eos_token_id,))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "mcp" else real(n, *a))  # fmt: skip
    cfg = MultiTurnConfig(agent="tests.agents:three_turns", mcp_servers=[{"url": "http://x"}])
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.mcp_servers needs mcp"):
        build_turn_loop(cfg, tok, True, (tok.eos_token_id,))
