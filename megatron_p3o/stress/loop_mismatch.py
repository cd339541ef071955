"""Mismatches of the multi-turn loop that are no trainer option: a grid's ``mismatch.<k>.loop``.

``retokenize`` — what a loop over chat messages does (most peers' multi-turn loops, and their
users' agents): before every turn the history is rendered to text and encoded again, and the
engine samples the next turn from those ids. The trainer keeps the tokens the engine sampled
(the trajectory stays append-only), so the ratio πθ/πb of every turn after the first is taken
on a context the engine did not see: a BPE that re-merges a sampled ``1``·``79`` into ``17``·``9``
or parses special-token text gives the engine another prefix than the one trained on
(``docs/multiturn.md``; the control in ``tests/unit/test_chat_templates.py`` shows the prefix
violations and e_B < 1 it causes on policy). The held-out evaluation stays token-in-token-out,
so two settings of the same arm differ by what they trained on, not by how they are scored.

Never a trainer option: it exists to measure what exact tokenization buys (stress study v6,
``docs/stress_v6_plan.md``); the stress runner applies it to a built trainer
(:func:`apply_loop_mismatch`).
"""

from __future__ import annotations

from typing import List


class Retokenized:
    """``engine_input`` for a :class:`~megatron_p3o.rollout.turns.TurnLoop`: the kept ids
    decoded (special tokens as text) and encoded again. ``turns`` counts the turns it served and
    ``changed`` those whose ids differ from the kept ones; an encoding longer than the kept ids
    (it would not fit the engine's slot) is not used and counted in ``longer``."""

    def __init__(self, tok):
        self.tok, self.on = tok, True
        self.reset()

    def reset(self) -> None:
        """Start counting again (after the probe: the counts are the training rollouts')."""
        self.turns = self.changed = self.longer = 0

    def __call__(self, t) -> List[int]:
        kept = t.prompt + t.ids
        if not self.on:
            return kept
        ids = self.tok.encode(self.tok.decode(kept, skip_special_tokens=False),
                              add_special_tokens=False)  # fmt: skip
        self.turns += 1
        if len(ids) > len(kept):
            self.longer += 1
            return kept
        self.changed += int(ids != kept)
        return ids

    def summary(self) -> dict:
        """CSV columns: the share of rollout turns whose engine input was not the kept ids."""
        n = max(self.turns, 1)
        return {"loop_turns": self.turns, "loop_changed_share": self.changed / n,
                "loop_longer_share": self.longer / n}  # fmt: skip


def apply_loop_mismatch(kind: str, trainer) -> Retokenized | None:
    """Install ``kind`` ("" = none) in ``trainer``'s multi-turn loop for its rollouts; its
    held-out evaluation keeps the kept ids. Returns the installed hook (its counts)."""
    if not kind:
        return None
    if kind != "retokenize":
        raise ValueError(f"unknown loop mismatch {kind!r}")
    loop = trainer.turns
    if loop is None:
        raise ValueError("a loop mismatch needs a multi-turn recipe (rollout.multi_turn)")
    hook = Retokenized(loop.tok)
    loop.engine_input = hook  # the instance's, for this trainer's rollouts only
    inner = trainer.evaluate_detail

    def evaluate_detail(*args, **kwargs):
        hook.on = False
        try:
            return inner(*args, **kwargs)
        finally:
            hook.on = True

    trainer.evaluate_detail = evaluate_detail
    return hook
