"""A task a tiny model learns to use a tool on: arithmetic it cannot do in its head, and a
calculator it can call (``megatron_p3o.env.calc_env.CalculatorEnv``).

Prompt ``37*48+15``; the answer is its value, ``1791``. A 2-layer model does not learn two-digit
products in minutes, but it can copy: a turn ``<calc>37*48+15</calc>`` gets the tool's output
``1791`` back as an observation, and copying that is the answer. The base model
(``tools/make_base.py --task tool_calc``) is warmed up on a mix of such tool conversations and
direct answers (a shrug, ``?``), so it calls the tool only sometimes; RL has the tool-call
rate to raise.

The tokenizer is byte-level BPE trained on the task's own text (the ``tokenizers`` library):
digits and operators merge into multi-character tokens, so a model that samples ``1`` ``79``
``1`` writes text whose canonical encoding is other tokens — re-tokenizing a conversation would
change what the model said (``docs/multiturn.md``). Roles and the tool's tags are special
tokens, so a chat template's pieces never merge with what they wrap, and an expression or a
number is the same tokens wherever it appears (copying it is copying tokens)::

    <bos><|user|>37*48+15<|end|><|assistant|><calc>37*48+15</calc><|end|>
    <|tool|>1791<|end|><|assistant|>1791<|end|>
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import List, Tuple

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
SPECIALS = ["<pad>", "<bos>", "<|end|>", "<|user|>", "<|assistant|>", "<|tool|>", CALL_OPEN,
            CALL_CLOSE]  # fmt: skip
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 320  # 256 byte-level symbols (any observation encodes) + 8 specials + merges


def problem(rng: random.Random) -> Tuple[str, str]:
    """(expression, value): ``a*b+c`` with two-digit a, b, c."""
    a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}*{b}+{c}", str(a * b + c)


def splits(train: int = 20000, heldout: int = 500, seed: int = 0):
    """(train rows, held-out rows) of ``{"prompt", "answer"}``; no held-out expression is in
    the training split."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < train + heldout:
        expr, value = problem(rng)
        if expr in seen:
            continue
        seen.add(expr)
        rows.append({"prompt": expr, "answer": value})
    return rows[heldout:], rows[:heldout]


def write_jsonl(rows, path: Path) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def tool_call(expression: str) -> str:
    return f"{CALL_OPEN}{expression}{CALL_CLOSE}"


def conversation(expr: str, value: str, use_tool: bool, direct: str = "") -> List[dict]:
    """A warm-up conversation: the tool called and its output copied, or a direct answer
    (``direct``: what the model says without the tool; the true value by default)."""
    msgs = [{"role": "user", "content": expr}]
    if use_tool:
        return msgs + [
            {"role": "assistant", "content": tool_call(expr)},
            {"role": "tool", "content": value},
            {"role": "assistant", "content": value},
        ]
    return msgs + [{"role": "assistant", "content": direct or value}]


def corpus(rows, rng: random.Random) -> List[str]:
    """Text the tokenizer is trained on: every conversation piece of the training rows."""
    out = []
    for r in rows:
        out += [r["prompt"], tool_call(r["prompt"]), r["answer"]]
    rng.shuffle(out)
    return out


def make_tokenizer(out_dir: Path, rows, seed: int = 0):
    """Byte-level BPE over the task's text (``VOCAB_SIZE`` entries, roles as special tokens)
    with the chat template, saved to ``out_dir`` as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any observation
        show_progress=False,
    )
    tok.train_from_iterator(corpus(rows, random.Random(seed)), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<|end|>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[3:],  # roles and tags: never merged
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def reward(completion: str, answer: str) -> float:
    """1 if the final turn is the answer (surrounding spaces ignored)."""
    return 1.0 if completion.strip() == answer.strip() else 0.0
