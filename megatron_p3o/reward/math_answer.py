"""Math answers checked with ``math-verify`` (LaTeX / numbers / sets, symbolic equivalence)."""

from __future__ import annotations


def math_verify_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer is equivalent to ``answer``, else 0.0."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    pred = parse(completion)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0
