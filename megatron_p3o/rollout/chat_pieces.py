"""The chat template's pieces around an observation, as token ids, and how an observation's text
becomes ids.

Why pieces, not renders: a multi-turn trajectory is append-only (``megatron_p3o.rollout.turns``):
the model's tokens as sampled, then the template's text that closes its turn, opens the
observation, the observation, and what closes it and opens the next model turn — each encoded
once, when appended. Rendering the conversation again would re-tokenize what the model wrote.

Derived from the template itself, for both ways a model turn ends:

- the model sampled its stop token (``stop``): only what the template writes *after* that token
  is appended (``after_stop``: ChatML's ``"\\n"`` after ``<|im_end|>``; nothing for Llama-3's
  ``<|eot_id|>``);
- the turn was cut by its token budget (``length``): the whole end of turn (``turn_end``:
  ``<|im_end|>\\n``).

Templates that rewrite earlier turns when rendering later ones (Qwen3 drops earlier reasoning,
and writes an empty ``<think></think>`` only on the last assistant turn) are handled by taking
every piece from the text *after* the assistant's content: how the template would render the
history's assistant turns differently is not what the model was conditioned on when it sampled,
so the trajectory keeps the model's tokens (and the generation prompt it was given).

Observation text is encoded with special tokens treated as text (``split_special_tokens``): a
tool whose output contains ``<|im_end|><|im_start|>assistant`` gets those characters' ordinary
ids, never the template's control tokens — a tool cannot forge a turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from megatron_p3o.runtime.errors import ConfigError

_A, _O, _U = "\x01ASSISTANT\x01", "\x02OBSERVATION\x02", "\x03USER\x03"  # sentinels


def encode_observation(tok, text: str) -> List[int]:
    """An observation's ids: its characters, special-token text included, as ordinary text."""
    return list(tok.encode(text, add_special_tokens=False, split_special_tokens=True))


@dataclass(frozen=True)
class ChatPieces:
    """Token ids the chat template puts around an observation.

    turn_end: closes a model turn cut by its budget (``length``). after_stop: what follows the
    model's own stop token (``stop``). obs_open / obs_close: before and after the observation's
    text (``obs_close`` ends with the opening of the next model turn)."""

    turn_end: tuple = ()
    after_stop: tuple = ()
    obs_open: tuple = ()
    obs_close: tuple = ()

    def closing(self, finish_reason: str) -> tuple:
        """What closes a model turn that ended with ``finish_reason`` (stop / length)."""
        return self.after_stop if finish_reason == "stop" else self.turn_end

    @classmethod
    def from_tokenizer(
        cls, tok, role: str = "tool", chat: bool = True, stop_ids: Sequence[int] = ()
    ) -> "ChatPieces":
        """From the chat template (none, or ``chat`` False: observations as plain text).
        ``stop_ids``: the tokens that end a model turn (the recipe's stop tokens and EOS)."""
        if not chat or not getattr(tok, "chat_template", None):
            return cls()
        key = "rollout.multi_turn.observation_role"
        user = {"role": "user", "content": _U}
        turn = [user, {"role": "assistant", "content": _A}]
        full = [*turn, {"role": role, "content": _O}]
        try:
            one = tok.apply_chat_template(turn, tokenize=False)
            two = tok.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template that has no such role
            raise ConfigError(
                f"{key}={role!r}: the tokenizer's chat template cannot render it "
                f"({type(e).__name__}: {e})"
            ) from None
        if _A not in one or _A not in two or _O not in two:
            raise ConfigError(
                f"{key}={role!r}: the chat template drops the assistant's or the observation's "
                "content from its render"
            )
        end_text = one[one.index(_A) + len(_A) :]
        between = two[two.index(_A) + len(_A) : two.index(_O)]
        if not between.startswith(end_text):
            raise ConfigError(
                f"{key}={role!r}: the chat template closes an assistant turn differently when an "
                f"observation follows ({end_text!r} vs {between!r})"
            )
        open_text = between[len(end_text) :]
        close_text = two[two.index(_O) + len(_O) :]

        def enc(text):  # the template's own text: its control tokens are control tokens
            return tuple(tok.encode(text, add_special_tokens=False))

        end = enc(end_text)
        after = end[1:] if end and end[0] in set(stop_ids) else end
        pieces = cls(end, after, enc(open_text), enc(close_text))
        pieces.check(tok, role)
        return pieces

    def check(self, tok, role: str) -> None:
        """The pieces' text, around a turn and an observation, is the template's own render of
        that conversation from the assistant's content on (the stop path's ``after_stop`` is
        ``turn_end`` after its stop token, by construction)."""
        a, o = "<calc>1+2</calc>", "3"
        msgs = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": a},
            {"role": role, "content": o},
        ]
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

        def dec(ids):
            return tok.decode(list(ids), skip_special_tokens=False)

        got = a + dec(self.turn_end + self.obs_open) + o + dec(self.obs_close)
        if not want.endswith(got):
            raise ConfigError(
                "rollout.multi_turn: the chat template's pieces around an observation do not "
                f"reproduce its render ({got!r} is not the end of {want!r})"
            )
