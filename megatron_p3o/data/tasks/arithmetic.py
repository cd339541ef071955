"""Multi-digit addition as a verifiable RL task, with a character-level HF tokenizer.

Prompt ``"37+45="``, answer ``"28"``: the sum written least-significant digit first (82 reversed),
so each digit depends only on the operands and the carry — learnable by a 2-layer model on a CPU
in minutes. The completion is the answer's digits then ``<eos>``. Deterministic splits: the
held-out pairs never appear in training.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import List, Tuple

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARS = list("0123456789+=")


def make_tokenizer(out_dir: Path, chars=CHARS):
    """A character-level ``PreTrainedTokenizerFast`` over ``SPECIALS`` then ``chars`` (this
    task's by default; ``tools/make_base.py`` passes its task's), saved to ``out_dir``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    fast.save_pretrained(out_dir)
    return fast


def splits(
    digits: int = 2, heldout: int = 500, seed: int = 0
) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """(train pairs, held-out pairs) of ``digits``-digit operands."""
    hi = 10**digits
    pairs = [(a, b) for a in range(hi) for b in range(hi)]
    random.Random(seed).shuffle(pairs)
    return pairs[heldout:], pairs[:heldout]


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    """The sum, least-significant digit first."""
    return str(a + b)[::-1]


def write_jsonl(pairs, path: Path) -> None:
    with open(path, "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": prompt(a, b), "answer": answer(a, b)}) + "\n")


def reward(completion: str, answer: str) -> float:
    """The task's reward: 1 if the completion is the answer. The character tokenizer decodes
    with a space between tokens ("2 8"), which is this task's business, not the trainer's."""
    from megatron_p3o.reward.exact_match import exact_match_reward

    return exact_match_reward(completion.replace(" ", ""), answer)
