"""Multi-turn rollouts (issue 53): the turn loop against a scripted engine, the chat template's
pieces, the calculator, limits and faults. The engines themselves: tests/distributed/
test_multiturn_engines.py (embedded) and tests/sglang_server/test_multiturn_real.py (SGLang)."""

import math
import random
import time
from pathlib import Path

import pytest
import torch

from megatron_p3o.data.tasks import tool_calc
from megatron_p3o.env.calculator import CalculatorError, calculate
from megatron_p3o.env.config import MultiTurnConfig, env_factory
from megatron_p3o.env.types import EnvItem, StepResult
from megatron_p3o.rollout.engine import RolloutEngine
from megatron_p3o.rollout.turns import ENV_VERSION, ChatPieces, TurnLoop, build_turn_loop
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.types import Sample, SamplingParams


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    train, _ = tool_calc.splits(2000, 10)
    return tool_calc.make_tokenizer(tmp_path_factory.mktemp("tok"), train)


class ScriptedEngine(RolloutEngine):
    """Each call's completions: ``turn(call, row)`` token ids, log-probs drawn from a seeded
    generator (recorded), the engine's weight version (``push_after``: a push lands after
    that many calls). Records every call's inputs."""

    def __init__(self, turn, version=3):
        self.turn, self.version, self.calls, self.emitted = turn, version, [], []
        self.out = []  # per call, per row: (input ids, output ids, log-probs)
        self.g = torch.Generator().manual_seed(0)

    def generate(self, prompts, n, sampling, keys=None):
        self.calls.append([list(p) for p in prompts])
        self.out.append([])
        out = []
        for i, p in enumerate(prompts):
            ids = self.turn(len(self.calls) - 1, i)[: sampling.max_new_tokens]
            lps = (-torch.rand(len(ids), generator=self.g, dtype=torch.float64)).tolist()
            self.emitted.append((list(p), ids, lps))
            self.out[-1].append((list(p), ids, lps))
            fin = "stop" if ids and ids[-1] in sampling.stop_token_ids else "length"
            out.append(Sample(list(p), ids, lps, fin, self.version, group_id=i))
        return out

    def update_weights(self, buckets, version):
        self.version = version

    def health(self):
        return {"ok": True, "weight_version": self.version}


class EchoEnv:
    """Answers every turn with an observation (``reply``), done after ``turns`` turns."""

    def __init__(self, turns=3, reply="1+2=3", reward=0.25):
        self.turns, self.reply, self.reward, self.n = turns, reply, reward, 0

    def reset(self, item):
        self.n = 0
        return None

    def step(self, turn):
        self.n += 1
        done = self.n >= self.turns
        return StepResult(None if done else self.reply, self.reward, done, tool_calls=1)


def _loop(tok, env, **cfg):
    c = MultiTurnConfig(env="tests.unit.test_multiturn:EchoEnv", **cfg)
    return TurnLoop(c, env, tok, ChatPieces.from_tokenizer(tok, "tool"))


def _prompts(tok, n):
    from megatron_p3o.data.prompts import encode_prompt

    rows = tool_calc.splits(50, n)[1]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    return [encode_prompt(tok, r["prompt"], chat=True) for r in rows], items


def _sampling(tok, k=8):
    return SamplingParams(max_new_tokens=k, stop_token_ids=(tok.eos_token_id,), seed=1)


def _turn(tok):
    end = tok.eos_token_id
    calc = tok.encode("<calc>1+2</calc>", add_special_tokens=False)
    return lambda call, row: calc + [end] if call < 2 else [tok.encode("3")[-1], end]


# -- the loop ---------------------------------------------------------------------------------
def test_token_in_token_out_prefix_masks_and_logprobs(tok):
    """Every turn's input is the previous input + the engine's output + the appended ids (0
    violations over 60 episodes of 3 turns); stored log-probs are the engine's bit for bit;
    mask-0 positions are exactly the observation and template spans; every per-token array
    has the completion's length; versions −1 on environment tokens."""
    eng = ScriptedEngine(_turn(tok))
    loop = _loop(tok, lambda: EchoEnv(3), max_turns=3, max_total_tokens=80)
    prompts, items = _prompts(tok, 20)
    out = loop.run(eng, prompts, items, 3, _sampling(tok, 16))
    assert len(out) == 60 and all(s.meta["turns"] == 3 for s in out)
    p = loop.pieces
    obs = tok.encode("1+2=3", add_special_tokens=False)
    violations = 0
    for j, s in enumerate(out):  # every trajectory stays active: row j of every call
        assert len(s.completion_ids) == len(s.logprobs) == len(s.policy_mask)
        assert len(s.token_versions) == len(s.completion_ids)
        seq = s.prompt_ids + s.completion_ids
        starts = s.meta["turn_inputs"]
        assert starts[0] == len(s.prompt_ids) and len(starts) == 3
        want_mask = []
        for k, a in enumerate(starts):
            inp, ids, lps = eng.out[k][j]
            violations += inp != seq[:a]  # the input: everything so far, as it was kept
            c = a - len(s.prompt_ids)
            assert seq[a : a + len(ids)] == ids
            assert s.logprobs[c : c + len(ids)] == lps  # the engine's, bit for bit
            want_mask += [1] * len(ids)
            b = starts[k + 1] if k + 1 < len(starts) else len(seq)
            env = list(p.obs_open) + obs + list(p.obs_close) if b > a + len(ids) else []
            assert seq[a + len(ids) : b] == env  # then exactly the observation's span
            want_mask += [0] * len(env)
        assert s.policy_mask == want_mask
        assert all((v == ENV_VERSION) == (m == 0) for v, m in zip(s.token_versions, s.mask()))
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.mask()) if m == 0)
        assert s.reward == pytest.approx(0.75) and s.meta["status"] == "completed"
    assert violations == 0


def test_a_re_rendered_history_is_another_token_sequence(tok):
    """The control: a loop that renders the conversation to text and re-tokenizes it each turn
    gives other tokens than the engine sampled (BPE: ``<calc>`` ``1`` is re-encoded
    ``<calc>1``) — the defect the loop avoids exists with this tokenizer."""
    end = tok.eos_token_id
    pieces = [tok.convert_tokens_to_ids(t) for t in ("<calc>", "1", "+", "2", "</calc>")]
    assert None not in pieces and all(t != tok.unk_token_id for t in pieces)
    eng = ScriptedEngine(lambda call, row: pieces + [end])
    loop = _loop(tok, lambda: EchoEnv(3), max_turns=3, max_total_tokens=80)
    prompts, items = _prompts(tok, 2)
    out = loop.run(eng, prompts, items, 1, _sampling(tok, 16))
    violations = 0
    for s in out:
        text = tok.decode(s.prompt_ids + s.completion_ids, skip_special_tokens=False)
        again = tok.encode(text, add_special_tokens=False)
        violations += again != s.prompt_ids + s.completion_ids
    assert violations >= 1


def test_the_budget_clamps_turns_and_cuts_observations(tok):
    """100 episodes with 10 kB observations: no trajectory passes max_total_tokens or
    max_turns; the cut observation is marked; nothing but the budget ends them."""
    eng = ScriptedEngine(_turn(tok))
    big = "7" * 10_000
    loop = _loop(tok, lambda: EchoEnv(5, reply=big), max_turns=4, max_total_tokens=40)
    prompts, items = _prompts(tok, 50)
    out = loop.run(eng, prompts, items, 2, _sampling(tok, 16))
    assert len(out) == 100
    for s in out:
        assert len(s.completion_ids) <= 40 and s.meta["turns"] <= 4
        assert s.meta["observation_cut"] and s.meta["status"] == "truncated"
        assert s.finish_reason == "length"
    assert max(len(c) for c in eng.calls[-1]) <= max(len(p) for p in prompts) + 40


def test_max_turns_ends_an_episode_truncated(tok):
    eng = ScriptedEngine(_turn(tok))
    loop = _loop(tok, lambda: EchoEnv(10), max_turns=2, max_total_tokens=200)
    prompts, items = _prompts(tok, 3)
    out = loop.run(eng, prompts, items, 1, _sampling(tok, 16))
    assert all(s.meta["turns"] == 2 and s.meta["status"] == "truncated" for s in out)
    assert len(eng.calls) == 2
    # the episode ends after the model's turn: no environment token at the end
    assert all(s.policy_mask[-1] == 1 for s in out)


class SlowTool(EchoEnv):
    def step(self, turn):
        time.sleep(10)
        return super().step(turn)


class BrokenTool(EchoEnv):
    def step(self, turn):
        raise RuntimeError("the tool crashed")


@pytest.mark.parametrize("env", [SlowTool, BrokenTool], ids=["hangs", "raises"])
def test_a_hanging_or_raising_tool_is_an_error_observation_within_two_seconds(tok, env):
    eng = ScriptedEngine(_turn(tok))
    loop = _loop(tok, lambda: env(3), max_turns=3, max_total_tokens=120, tool_timeout_s=0.5)
    prompts, items = _prompts(tok, 4)
    t0 = time.monotonic()
    out = loop.run(eng, prompts, items, 2, _sampling(tok, 16))
    assert time.monotonic() - t0 < 2.0
    for s in out:
        text = tok.decode(s.completion_ids, skip_special_tokens=True)
        assert "error:" in text and s.meta["tool_errors"] >= 1
        if env is SlowTool:  # past the timeout the episode ends, its state unknown
            assert s.meta["status"] == "tool_error" and s.meta["turns"] == 1
        else:  # an exception is an observation: the model may try again
            assert "the tool crashed" in text and s.meta["turns"] == 3


class OddEnv(EchoEnv):
    def __init__(self, kind):
        super().__init__(2)
        self.kind = kind

    def reset(self, item):
        if self.kind == "reset_fails":
            raise ValueError("no episode for this prompt")
        return None

    def step(self, turn):
        res = super().step(turn)
        obs = {"empty": "", "bytes": b"\xff\xfe ok \x80", "none": None}.get(self.kind, "x")
        return StepResult(obs if not res.done else None, res.reward, res.done)


@pytest.mark.parametrize("kind", ["empty", "bytes", "none", "reset_fails"])
def test_empty_non_utf8_missing_observations_and_a_failed_reset(tok, kind):
    eng = ScriptedEngine(_turn(tok))
    loop = _loop(tok, lambda: OddEnv(kind), max_turns=3, max_total_tokens=120)
    prompts, items = _prompts(tok, 2)
    out = loop.run(eng, prompts, items, 1, _sampling(tok, 16))
    for s in out:
        if kind == "reset_fails":  # aborted: never trained, no reward, no engine call
            assert s.meta["status"] == "aborted" and s.reward == 0.0
            assert s.completion_ids == [] and eng.calls == []
            continue
        assert s.meta["status"] == "completed"
        text = tok.decode(s.completion_ids, skip_special_tokens=False)
        if kind == "bytes":
            assert "\ufffd" in text and " ok " in text
        if kind == "empty":  # the template's pieces alone
            assert "<|tool|><|end|><|assistant|>" in text


def test_a_weight_push_mid_trajectory_versions_each_turn(tok):
    """Per-token versions across turns: turn 1 at version 3, a push, turn 2 at version 4;
    the environment's tokens −1; the sample's version is its oldest policy token's."""
    eng = ScriptedEngine(_turn(tok))
    real = eng.generate

    def pushing(prompts, n, sampling, keys=None):
        out = real(prompts, n, sampling)
        eng.version += 1
        return out

    eng.generate = pushing
    loop = _loop(tok, lambda: EchoEnv(2), max_turns=2, max_total_tokens=80)
    prompts, items = _prompts(tok, 1)
    (s,) = loop.run(eng, prompts, items, 1, _sampling(tok, 16))
    n1, n2 = len(_turn(tok)(0, 0)), len(_turn(tok)(1, 0))
    env = len(s.completion_ids) - n1 - n2
    assert env > 0 and s.token_versions == [3] * n1 + [ENV_VERSION] * env + [4] * n2
    assert s.weight_version == 3 and s.policy_versions() == [3] * n1 + [4] * n2


# -- the chat template's pieces ----------------------------------------------------------------
def test_chat_pieces_are_computed_once_and_match_a_full_render(tok):
    p = ChatPieces.from_tokenizer(tok, "tool")
    ids = tok.convert_tokens_to_ids
    assert p.turn_end == (ids("<|end|>"),)
    assert p.obs_open == (ids("<|tool|>"),)
    assert p.obs_close == (ids("<|end|>"), ids("<|assistant|>"))
    import copy

    broken = copy.deepcopy(tok)  # the fixture's tokenizer stays as it is
    broken.chat_template = "{{ raise_exception('no') }}"
    with pytest.raises(ConfigError, match="observation_role"):
        ChatPieces.from_tokenizer(broken, "tool")


def test_no_chat_template_appends_plain_text(tok):
    assert ChatPieces.from_tokenizer(tok, "tool", chat=False) == ChatPieces()


# -- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"env": "nomodule"}, "must be 'module:Class'"),
        ({"env": "megatron_p3o.env.calc_env:Nope"}, "cannot be imported"),
        ({"env": "megatron_p3o.env.calc_env:CalculatorEnv", "env_args": {"bad": 1}}, "env_args"),
        ({"env": "megatron_p3o.env.calc_env:CalculatorEnv", "max_turns": 0}, "max_turns=0"),
        ({"env": "megatron_p3o.env.calc_env:CalculatorEnv", "tool_timeout_s": 0}, "tool_timeout"),
    ],
)
def test_config_errors_name_the_key(kw, msg):
    with pytest.raises(ConfigError) as e:
        env_factory(MultiTurnConfig(**kw))
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_build_turn_loop_without_a_section_is_none(tok):
    assert build_turn_loop(None, tok, True) is None


# -- the calculator ----------------------------------------------------------------------------
def test_the_calculator_computes_arithmetic_like_python():
    rng = random.Random(0)
    for _ in range(300):
        a, b, c = (rng.randint(-99, 99) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice(["+", "-", "*", "//", "%"])
        if op2 in ("//", "%") and c == 0:
            c = 7
        expr = f"({a}{op1}{b}){op2}{c}"
        assert calculate(expr) == eval(expr)  # noqa: S307 - the reference, on our own input
    assert calculate("7/2") == 3.5 and calculate("8/2") == 4 and calculate("2**10") == 1024


@pytest.mark.parametrize(
    "expr,msg",
    [
        ("9**9**9", "exponent"),
        ("10**60*10**60", "digits"),
        ("2**64**2", "exponent"),
        ("99999999999**9", "digits"),
        ("1/0", "division by zero"),
        ("__import__('os').system('x')", "not arithmetic"),
        ("open('f')", "not arithmetic"),
        ("1_000", "'_'"),
        ("(" * 150 + "1" + ")" * 150, "longer than"),
        ("", "empty"),
    ],
)
def test_the_calculator_refuses_before_computing(expr, msg):
    """Refused from the sizes, not after the work: 9**9**9 would take minutes (a bound of a
    second, not a timing)."""
    t0 = time.monotonic()
    with pytest.raises(CalculatorError) as e:
        calculate(expr)
    assert time.monotonic() - t0 < 1.0 and msg in str(e.value) and "\n" not in str(e.value)


def test_the_calculator_env_calls_the_tool_then_scores_the_answer():
    from megatron_p3o.env.calc_env import CalculatorEnv

    env = CalculatorEnv(max_tool_calls=1)
    assert env.reset(EnvItem(0, "37*48+15", "1791", 0)) is None
    r = env.step("<calc>37*48+15</calc>")
    assert (r.observation, r.tool_calls, r.done) == ("1791", 1, False)
    r = env.step("<calc>9**9**9</calc>")  # over the call limit
    assert r.done and r.tool_error and "more than 1" in r.observation
    env.reset(EnvItem(0, "37*48+15", "1791", 0))
    assert env.step("1791") == StepResult(reward=1.0, done=True)
    env.reset(EnvItem(0, "37*48+15", "1791", 0))
    assert env.step("1790").reward == 0.0
    bad = CalculatorEnv().step("<calc>1/0</calc>")
    assert bad.tool_error and bad.observation == "error: division by zero" and not bad.done


def test_tool_calc_splits_never_share_an_expression():
    train, held = tool_calc.splits(3000, 300)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for r in held[:50]:
        a, rest = r["prompt"].split("*")
        b, c = rest.split("+")
        assert int(r["answer"]) == int(a) * int(b) + int(c)
    assert math.isclose(sum(len(r["answer"]) for r in held) / len(held), 3.9, abs_tol=0.3)
    assert Path(tool_calc.__file__).read_text().count("eval(") == 0


# -- routing: a trajectory's turns to the server that holds its prefix ---------------------------
def test_every_turn_carries_its_prompts_routing_key_and_requests_never_mix_keys(tok):
    """The loop keys every turn of a trajectory by its prompt (a router then sends all of them
    to the server that holds the prefix); a request batches only jobs of one key."""
    from megatron_p3o.rollout.sglang.protocol import request_chunks, routing_key

    eng = ScriptedEngine(_turn(tok))
    seen = []
    real = eng.generate

    def keyed(prompts, n, sampling, keys=None):
        seen.append(list(keys))
        return real(prompts, n, sampling)

    eng.generate = keyed
    loop = _loop(tok, lambda: EchoEnv(3), max_turns=3, max_total_tokens=80)
    prompts, items = _prompts(tok, 4)
    loop.run(eng, prompts, items, 2, _sampling(tok, 16))
    want = [routing_key(p) for p in prompts for _ in range(2)]
    assert len(seen) == 3 and all(k == want for k in seen) and len(set(want)) == 4
    jobs = [(g, [g] * 4, None, k) for g, k in enumerate("aaabbc")]
    assert [[j[0] for j in c] for c in request_chunks(jobs, 2)] == [[0, 1], [2], [3, 4], [5]]
    assert [len(c) for c in request_chunks([(0, [], None, None)] * 6, 4)] == [4, 2]


def test_the_client_sends_the_key_and_a_launched_router_sticks_to_it(monkeypatch):
    import urllib.request

    from megatron_p3o.rollout.sglang import SGLangConfig, SGLangEngine
    from megatron_p3o.rollout.sglang.launch import router_command
    from megatron_p3o.rollout.sglang.protocol import ROUTING_KEY_HEADER

    from ..sglang_standin import SGLangStandIn

    srv = SGLangStandIn(lambda body: ([1, 2], [-0.1, -0.2], "stop"))
    srv.version = "0"  # as after the trainer's first push
    opened, orig = [], urllib.request.urlopen

    def spy(req, *a, **k):
        opened.append({h.lower(): v for h, v in req.header_items()})
        return orig(req, *a, **k)

    monkeypatch.setattr(urllib.request, "urlopen", spy)
    try:
        eng = SGLangEngine(SGLangConfig(url=srv.url))
        eng.generate([[5, 6], [7, 8]], 2, SamplingParams(max_new_tokens=2), keys=["k1", "k2"])
        eng.generate([[5, 6]], 1, SamplingParams(max_new_tokens=2))
    finally:
        srv.close()
    sent = [h.get(ROUTING_KEY_HEADER) for h in opened]
    assert sorted(sent[:4]) == ["k1", "k1", "k2", "k2"] and sent[4] is None, sent
    cmd = router_command("py", "h", 1, ["http://a:1", "http://b:2"], 9, sticky=True)
    assert cmd[cmd.index("--policy") + 1] == "manual"
    assert "--policy" not in router_command("py", "h", 1, ["http://a:1"], 9)


def test_the_calculator_env_through_the_loop_sees_its_special_tags(tok):
    """The tool's tags are special tokens of the task's tokenizer: the turn the environment
    gets keeps them (a decode that drops special tokens would never call the tool)."""
    from megatron_p3o.env.calc_env import CalculatorEnv

    end = tok.eos_token_id
    call = tok.encode("<calc>2*3+4</calc>", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<calc>") in call
    answer = tok.encode("10", add_special_tokens=False)
    eng = ScriptedEngine(lambda k, row: (call if k == 0 else answer) + [end])
    c = MultiTurnConfig(env="megatron_p3o.env.calc_env:CalculatorEnv")
    loop = TurnLoop(c, CalculatorEnv, tok, ChatPieces.from_tokenizer(tok, "tool"))
    (s,) = loop.run(eng, [[1, 2]], [EnvItem(0, "2*3+4", "10", 0)], 1, _sampling(tok, 16))
    text = tok.decode(s.completion_ids, skip_special_tokens=False)
    assert s.meta["tool_calls"] == 1 and s.reward == 1.0 and "<|tool|>10<|end|>" in text


def test_evaluation_rows_are_encoded_as_training_prompts(tok, tmp_path):
    """Held-out rows of a chat recipe go through the chat template, as the training prompts do
    (they were encoded as plain text: a chat recipe was scored on prompts it never saw)."""
    from megatron_p3o.data.prompts import PromptData, all_rows

    path = tmp_path / "held.jsonl"
    tool_calc.write_jsonl([{"prompt": "12*34+56", "answer": "464"}], path)
    ((ids, answer),) = all_rows(str(path), tok, chat=True)
    train = PromptData(str(path), tok, chat_template=True, shuffle=False)
    assert ids == train.encode("12*34+56") and answer == "464"
    assert ids[1] == tok.convert_tokens_to_ids("<|user|>")
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
