"""Exact match of the last answer in the completion (after ``####`` or ``=``, or the last token)."""

from __future__ import annotations

import re

_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(completion: str) -> str:
    text = completion.strip()
    for marker in ("####", "answer:", "Answer:", "="):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
            break
    nums = _NUM.findall(text)
    if nums:
        return nums[0] if text.strip().startswith(nums[0]) else nums[-1]
    parts = text.split()
    return parts[-1] if parts else ""


def exact_match_reward(completion: str, answer: str) -> float:
    return 1.0 if extract_answer(completion) == str(answer).strip() else 0.0
