"""Turn boundaries on the chat-template families RL users train (issue 62): templates of this
project's own that behave as ChatML (Qwen2.5: ``<|im_end|>\\n`` closes a turn), as Qwen3 (it
rewrites earlier assistant turns: reasoning dropped, an empty think block on the last one, tool
answers wrapped as user turns) and as Llama-3 (header tokens, ``<|eot_id|>``), over the tool
task's BPE tokenizer. For each: the pieces the loop derives, then trajectories of the embedded
engine (fp32, a random tiny Llama whose end-of-turn token is likely, so turns end both by the
stop token and by the token budget): 0 prefix violations, every appended span is the
template's own text between the assistant's content and the next turn (for the path the turn
ended by), and on policy ρ = 1 (e_B = 1 to 1e-6 against a float64 transformers forward)."""

import pytest
import torch

from megatron_p3o.data.tasks import tool_calc
from megatron_p3o.rollout.chat_pieces import ChatPieces, encode_observation

from ..turn_recording import appended_spans, prefix_violations, record_turns

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's rules, written here: reasoning of assistant turns before the last user query dropped;
# after it, the last assistant turn (or one with reasoning) gets its think block, empty if none;
# tool answers are user turns wrapped in <tool_response>
QWEN3 = (
    "{%- set ns = namespace(q=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.q = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- set c = m['content'] -%}{%- set r = '' -%}"
    "{%- if '</think>' in c -%}{%- set r = c.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.q and (loop.last or r) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + c"
    " + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m['content']"
    " + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>"
    "{{ 'ipython' if m['role'] == 'tool' else m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
FAMILIES = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>"),
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
}
# what each template writes, by hand: (turn end, after the stop token, observation open, close)
EXPECTED = {
    "chatml": ("<|im_end|>\n", "\n", "<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n"),
    "qwen3": (
        "<|im_end|>\n",
        "\n",
        "<|im_start|>user\n<tool_response>\n",
        "\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ),  # fmt: skip
    "llama3": (
        "<|eot_id|>",
        "",
        "<|start_header_id|>ipython<|end_header_id|>\n\n",
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def base_tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tool_calc.make_tokenizer(d, tool_calc.splits(2000, 10)[0])
    return d


def family_tok(base_tok_dir, family):
    from transformers import AutoTokenizer

    template, specials, eos = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(base_tok_dir)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.eos_token = eos
    tok.chat_template = template
    return tok


def dec(tok, ids):
    return tok.decode(list(ids), skip_special_tokens=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_pieces_are_the_templates_own_text(base_tok_dir, family):
    tok = family_tok(base_tok_dir, family)
    p = ChatPieces.from_tokenizer(tok, "tool", True, (tok.eos_token_id,))
    got = tuple(dec(tok, x) for x in (p.turn_end, p.after_stop, p.obs_open, p.obs_close))
    assert got == EXPECTED[family]
    assert p.turn_end[0] == tok.eos_token_id and p.turn_end[1:] == p.after_stop


def test_a_qwen3_render_rewrites_the_history_which_the_trajectory_does_not(base_tok_dir):
    """The template drops an earlier turn's reasoning when it renders the next turn: what the
    model was conditioned on is its own tokens, which the trajectory keeps."""
    tok = family_tok(base_tok_dir, "qwen3")
    msgs = [{"role": "user", "content": "u"},
            {"role": "assistant", "content": "<think>why</think>a"},
            {"role": "tool", "content": "3"}, {"role": "user", "content": "v"}]  # fmt: skip
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "why" not in text and "<|im_start|>assistant\na<|im_end|>" in text


def _model(tok, seed=0, positions=256):
    """A tiny Llama over ``tok``; its end-of-turn logit raised, so turns end both ways."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=positions)  # fmt: skip
    ref = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    with torch.no_grad():
        ref.lm_head.weight.mul_(4.0)
        ref.lm_head.weight[tok.eos_token_id] = ref.model.norm.weight * 0.0 + 0.6
    return cfg, ref


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trajectories_on_each_family_are_exact_on_both_stop_paths(base_tok_dir, family):
    from megatron_p3o.data.prompts import encode_prompt
    from megatron_p3o.env.config import MultiTurnConfig
    from megatron_p3o.env.types import EnvItem
    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from megatron_p3o.rollout.turns import build_turn_loop
    from megatron_p3o.types import SamplingParams

    tok = family_tok(base_tok_dir, family)
    cfg, ref = _model(tok)
    engine = EmbeddedEngine(cfg, "fp32", pad_token_id=tok.pad_token_id)
    engine.update_weights([list(ref.state_dict().items())], 0)
    calls = record_turns(engine)
    mt = MultiTurnConfig(env="tests.envs:EchoEnv", env_args={"turns": 3, "reply": "12*3=36"},
                         max_turns=3, max_total_tokens=200)  # fmt: skip
    stops = (tok.eos_token_id,)
    loop = build_turn_loop(mt, tok, True, stops)
    rows = tool_calc.splits(100, 17)[1]
    prompts = [encode_prompt(tok, r["prompt"], chat=True) for r in rows]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    sp = SamplingParams(max_new_tokens=5, stop_token_ids=stops, seed=3)
    try:
        out = loop.run(engine, prompts, items, 3, sp)
    finally:
        loop.close()
    inv = prefix_violations(out, calls)
    assert inv["episodes"] >= 50 and inv["turns"] >= 150 and inv["violations"] == 0, inv
    want_tail = EXPECTED[family]
    obs = encode_observation(tok, "12*3=36")
    paths = set()
    for k, s in enumerate(out):
        assert not s.meta["observation_cut"]
        spans = appended_spans(s)
        for (_, turn, _, fin), span in zip(calls[k], spans):
            paths.add(fin)
            # the template's text after the assistant's content, for this stop path
            closing = want_tail[1] if fin == "stop" else want_tail[0]
            text = closing + want_tail[2] + "12*3=36" + want_tail[3]
            assert dec(tok, span) == text
            assert span[len(span) - len(obs) - len(loop.pieces.obs_close) :][: len(obs)] == obs
            if fin == "stop":
                assert turn[-1] == tok.eos_token_id
    assert paths == {"stop", "length"}
    # on policy: the engine's ℓb are a float64 transformers forward's log-probs of the kept
    # tokens (ρ = 1 to fp32 rounding), so e_B = (Σρ)²/(N·Σρ²) = 1
    r = ratios(ref, out)
    assert float((r - 1).abs().max()) < 1e-5
    assert abs(ess(r) - 1.0) < 1e-6


def ratios(ref, samples) -> torch.Tensor:
    """ρ = π/πb on every policy token, π from a float64 forward of the kept sequence."""
    rho = []
    ref64 = ref.double()
    for s in samples:
        seq = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            lp = torch.log_softmax(ref64(seq).logits[0], -1)
        p = len(s.prompt_ids)
        for i, (t, lb, m) in enumerate(zip(s.completion_ids, s.logprobs, s.policy_mask)):
            if m:
                rho.append(float(torch.exp(lp[p + i - 1, t] - lb)))
    return torch.tensor(rho, dtype=torch.float64)


def ess(r: torch.Tensor) -> float:
    return float(r.sum() ** 2 / (len(r) * (r**2).sum()))


def test_a_loop_that_re_tokenizes_its_history_breaks_the_prefix_and_e_b(base_tok_dir):
    """The control (issue 62): the same loop, but before every turn the conversation is
    rendered to text and encoded again, as a loop over messages does. On this BPE tokenizer the
    engine then sees other tokens than the trajectory keeps: prefix violations, and the kept
    tokens' ratios on policy are no longer 1 (e_B < 1). The real loop on the same engine and
    seeds: 0 violations, e_B = 1."""
    from transformers import AutoTokenizer

    from megatron_p3o.data.prompts import encode_prompt
    from megatron_p3o.env.config import MultiTurnConfig, env_host
    from megatron_p3o.env.types import EnvItem
    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from megatron_p3o.rollout.turns import TurnLoop
    from megatron_p3o.types import SamplingParams

    tok = AutoTokenizer.from_pretrained(base_tok_dir)

    class ReTokenizing(TurnLoop):
        def engine_input(self, t):
            text = tok.decode(t.prompt + t.ids, skip_special_tokens=False)
            return tok.encode(text, add_special_tokens=False)

    cfg, ref = _model(tok, seed=1)
    rows = tool_calc.splits(100, 17)[1]
    prompts = [encode_prompt(tok, r["prompt"], chat=True) for r in rows]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    stops = (tok.eos_token_id,)
    sp = SamplingParams(max_new_tokens=6, stop_token_ids=stops, seed=3)
    mt = MultiTurnConfig(env="tests.envs:EchoEnv", env_args={"turns": 3, "reply": "12*3=36"},
                         max_turns=3, max_total_tokens=120)  # fmt: skip
    found = {}
    for name, cls in (("real", TurnLoop), ("control", ReTokenizing)):
        engine = EmbeddedEngine(cfg, "fp32", pad_token_id=tok.pad_token_id)
        engine.update_weights([list(ref.state_dict().items())], 0)
        calls = record_turns(engine)
        loop = cls(mt, env_host(mt), tok, ChatPieces.from_tokenizer(tok, "tool", True, stops))
        try:
            out = loop.run(engine, prompts, items, 3, sp)
        finally:
            loop.close()
        found[name] = (prefix_violations(out, calls)["violations"], ess(ratios(ref, out)))
    assert found["real"][0] == 0 and abs(found["real"][1] - 1.0) < 1e-6, found
    assert found["control"][0] > 0 and found["control"][1] < 1.0 - 1e-3, found
