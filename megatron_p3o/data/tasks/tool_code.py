"""A task a tiny model solves by writing code: the tool-call task's arithmetic (``a*b+c`` with
two-digit numbers, :mod:`.tool_calc`), answered through a Python tool called in the hermes format
that agents and Qwen-family models use, and run in the sandbox
(:mod:`megatron_p3o.env.sandbox`).

Why: a model that cannot multiply two-digit numbers in its head (a 4-layer model cannot, in
minutes) can still answer by writing ``print(37*48+15)`` and copying what the tool prints — the
computing is the way to the answer. The rollout is an agent written against the OpenAI client
(:mod:`megatron_p3o.rollout.agents.code_agent`): the model's turn is parsed for a ``python``
call, the snippet runs sandboxed, its stdout is the tool message, and the final turn is scored.

The chat template is small and fixed (roles as special tokens, like the tool task's), with the
tool call written as the hermes block the ``hermes`` parser reads::

    <bos><|user|>37*48+15<|end|><|assistant|><tool_call>{"name": "python", "arguments":
    {"code": "print(37*48+15)"}}</tool_call><|end|><|tool|>1791<|end|><|assistant|>1791<|end|>

The tokenizer is byte-level BPE trained on the task's own text (the call's fixed JSON merges into
few tokens).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import List

from megatron_p3o.data.tasks.tool_calc import reward, splits, write_jsonl  # noqa: F401

SPECIALS = ["<pad>", "<bos>", "<|end|>", "<|user|>", "<|assistant|>", "<|tool|>", "<tool_call>",
            "</tool_call>"]  # fmt: skip
# tool messages carry no name in this template: it has one tool
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    '{% for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|end|>'
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 360
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python snippet; returns what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
        },
    },
}


def snippet(expression: str) -> str:
    return f"print({expression})"


def call_text(expression: str) -> str:
    """The hermes block of a ``python`` call that prints ``expression``."""
    args = json.dumps({"code": snippet(expression)})
    return f'<tool_call>{{"name": "python", "arguments": {args}}}</tool_call>'


def conversation(expr: str, value: str, use_tool: bool, direct: str = "") -> List[dict]:
    """A warm-up conversation: the tool called (its output copied), or a direct answer."""
    msgs = [{"role": "user", "content": expr}]
    if use_tool:
        return msgs + [
            {"role": "assistant", "content": call_text(expr)},
            {"role": "tool", "content": value},
            {"role": "assistant", "content": value},
        ]
    return msgs + [{"role": "assistant", "content": direct or value}]


def corpus(rows, rng: random.Random) -> List[str]:
    out = []
    for r in rows:
        out += [r["prompt"], call_text(r["prompt"]), r["answer"]]
    rng.shuffle(out)
    return out


def make_tokenizer(out_dir: Path, rows, seed: int = 0):
    """Byte-level BPE over the task's text with the chat template (``VOCAB_SIZE`` entries),
    saved to ``out_dir`` as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(rows, random.Random(seed)), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<|end|>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


__all__ = ["CHAT_TEMPLATE", "PYTHON_TOOL", "call_text", "conversation", "make_tokenizer",
           "reward", "snippet", "splits", "write_jsonl"]  # fmt: skip
