"""Multi-turn rollouts, token in and token out: the engine's tokens are kept exactly as it
sampled them, and nothing is ever decoded and encoded again.

Why: the ratio πθ/πb must be taken on the tokens the engine sampled. A loop that renders the
conversation to text and re-tokenizes it between turns trains on other tokens than were sampled
— BPE is not a bijection (a sampled ``1``·``79``·``1`` re-encodes as ``17``·``9``·``1``), a chat
template may rewrite the history — and one misaligned token moves P3O's e_B for the whole step.
So a trajectory is append-only: the model's tokens as generated (``Sample.policy_mask`` 1, their
log-probs and weight versions), then each observation and the chat template's pieces around it,
encoded once when appended (mask 0, log-prob 0, version −1). Every turn's input is the previous
input, the engine's output and the appended ids (the prefix invariant, tested).

The template pieces (:class:`ChatPieces`: what closes the model's turn, what opens and closes an
observation and opens the next model turn) are computed once from the tokenizer's chat template
and checked against a full render of a conversation.

Turns are synchronous across trajectories: every active trajectory's next turn is one
``engine.generate`` call, made by every rank the same number of times (``engine.any_rank``: a
central server's generate is a collective). Each trajectory's budget (``max_total_tokens``)
clamps its turn afterwards: sampling is autoregressive, so the first k tokens of a longer draw
are a draw with ``max_new_tokens = k``. Environment steps of a turn run concurrently, each
bounded by ``tool_timeout_s``.

Statuses (``Sample.meta["status"]``): ``completed`` (the environment ended it),
``truncated`` (``max_turns`` or ``max_total_tokens``; trained like a completion cut by
``max_new_tokens``: ``batch.mask_truncated`` drops it), ``tool_error`` (a step ran past its
timeout: ended with an error observation; its turns are trained, reward as the environment
gave), ``aborted`` (the environment's reset failed or the engine aborted: never trained, mask 0,
reward 0).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Sequence

from megatron_p3o.env.config import MultiTurnConfig
from megatron_p3o.env.types import EnvItem, StepResult
from megatron_p3o.rollout.engine import RolloutEngine
from megatron_p3o.rollout.sglang.protocol import routing_key
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.types import Sample, SamplingParams

ENV_VERSION = -1  # the weight version of a token the environment wrote
STATUSES = ("completed", "truncated", "tool_error", "aborted")
_A, _O = "\x01ASSISTANT\x01", "\x02OBSERVATION\x02"  # sentinels rendered through the template


@dataclass(frozen=True)
class ChatPieces:
    """Token ids the chat template puts around an observation.

    turn_end: closes the model's turn when it stopped without it (length); ``()`` when the
        stop token itself closes the turn. obs_open / obs_close: before and after the
        observation's text (``obs_close`` ends with the opening of the next model turn)."""

    turn_end: tuple = ()
    obs_open: tuple = ()
    obs_close: tuple = ()

    @classmethod
    def from_tokenizer(cls, tok, role: str = "tool", chat: bool = True) -> "ChatPieces":
        """From the chat template (none, or ``chat`` False: observations as plain text)."""
        if not chat or not getattr(tok, "chat_template", None):
            return cls()
        user = [{"role": "user", "content": "u"}]
        turn = [*user, {"role": "assistant", "content": _A}]
        full = [*turn, {"role": role, "content": _O}]
        try:
            one = tok.apply_chat_template(turn, tokenize=False)
            two = tok.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template that has no such role
            raise ConfigError(
                f"rollout.multi_turn.observation_role={role!r}: the tokenizer's chat template "
                f"cannot render it ({type(e).__name__}: {e})"
            ) from None
        if _O not in two or not two.startswith(one) or _A not in one:
            raise ConfigError(
                f"rollout.multi_turn.observation_role={role!r}: the chat template renders a "
                "conversation that does not extend the previous one (it rewrites the history)"
            )
        end_text = one[one.index(_A) + len(_A) :]
        open_text = two[len(one) : two.index(_O)]
        close_text = two[two.index(_O) + len(_O) :]

        def enc(text):
            return tuple(tok.encode(text, add_special_tokens=False))

        pieces = cls(enc(end_text), enc(open_text), enc(close_text))
        pieces.check(tok, role)
        return pieces

    def check(self, tok, role: str) -> None:
        """The pieces' text, with a turn and an observation between them, is the template's
        own render of that conversation."""
        a, o = "<calc>1+2</calc>", "3"
        msgs = [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": a},
            {"role": role, "content": o},
        ]
        want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        head = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        got = (
            head
            + a
            + "".join(
                tok.decode(list(p), skip_special_tokens=False)
                for p in (self.turn_end, self.obs_open)
            )
            + o
            + tok.decode(list(self.obs_close), skip_special_tokens=False)
        )
        if got != want:
            raise ConfigError(
                "rollout.multi_turn: the chat template's pieces around an observation do not "
                f"reproduce its render ({got!r} != {want!r})"
            )


@dataclass
class _Trajectory:
    group: int
    prompt: List[int]
    env: object
    ids: List[int] = field(default_factory=list)  # after the prompt
    mask: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    inputs: List[int] = field(default_factory=list)  # each turn's input length (invariant)
    routes: object = None
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    cut: bool = False
    status: Optional[str] = None
    last_turn: tuple = (0, 0, "stop")  # (start, end, finish reason) of the latest model turn

    def append(self, ids, policy: bool, logprobs=None, versions=None) -> None:
        ids = list(ids)
        self.ids += ids
        self.mask += [1 if policy else 0] * len(ids)
        self.logprobs += list(logprobs) if policy else [0.0] * len(ids)
        self.versions += list(versions) if policy else [ENV_VERSION] * len(ids)


def _call_all(fns: Sequence[Callable[[], object]], timeout_s: float) -> List[tuple]:
    """Each ``fn()`` in a thread of its own, all bounded by one deadline: ``("ok", value)``,
    ``("error", exception)`` or ``("timeout", None)``. A thread past the deadline is left
    behind (Python cannot stop one): its episode ends."""
    out: List[tuple] = [("timeout", None)] * len(fns)

    def run(i, fn):
        try:
            out[i] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - becomes an error observation
            out[i] = ("error", e)

    threads = [threading.Thread(target=run, args=(i, f), daemon=True) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [o if not t.is_alive() else ("timeout", None) for o, t in zip(out, threads)]


class TurnLoop:
    """Runs one environment per trajectory against an engine (:meth:`run`)."""

    def __init__(self, cfg: MultiTurnConfig, make_env: Callable[[], object], tok, pieces):
        self.cfg, self.make_env, self.tok, self.pieces = cfg, make_env, tok, pieces
        self.eos = tok.eos_token_id

    def encode_observation(self, text) -> List[int]:
        """An observation's ids, encoded once (bytes that are not UTF-8 are replaced)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self.tok.encode(str(text), add_special_tokens=False))

    def run(
        self,
        engine: RolloutEngine,
        prompts: Sequence[Sequence[int]],
        items: Sequence[EnvItem],
        n: int,
        sampling: SamplingParams,
    ) -> List[Sample]:
        """``n`` trajectories per prompt (``group_id`` = prompt index), in group order."""
        c = self.cfg
        trajs = [
            _Trajectory(g, list(p), self.make_env())
            for g, p in enumerate(prompts)
            for _ in range(n)
        ]
        firsts = _call_all(
            [
                (lambda t=t, k=k: t.env.reset(replace(items[t.group], seed=items[t.group].seed
                                                      * 1_000_003 + k)))
                for k, t in enumerate(trajs)
            ],
            c.tool_timeout_s,
        )  # fmt: skip
        for t, (kind, obs) in zip(trajs, firsts):
            if kind != "ok":
                t.status = "aborted"
            elif obs is not None:
                self._observe(t, obs, after_turn=False)
        per_turn = min(sampling.max_new_tokens, c.max_total_tokens)
        turn = 0
        active = [t for t in trajs if t.status is None]
        while turn < c.max_turns and engine.any_rank(bool(active)):
            seed = None if sampling.seed is None else sampling.seed * 7919 + turn
            sp = replace(sampling, max_new_tokens=per_turn, seed=seed)
            for t in active:
                t.inputs.append(len(t.prompt) + len(t.ids))
            keys = [routing_key(t.prompt) for t in active]  # a router: the prefix's server
            outs = engine.generate([t.prompt + t.ids for t in active], 1, sp, keys)
            stepping = []
            for t, s in zip(active, outs):
                if self._take_turn(t, s):
                    stepping.append(t)
            texts = [self._turn_text(t) for t in stepping]
            results = _call_all(
                [(lambda t=t, x=x: t.env.step(x)) for t, x in zip(stepping, texts)],
                c.tool_timeout_s,
            )
            last = turn + 1 >= c.max_turns
            for t, (kind, res) in zip(stepping, results):
                self._after_step(t, kind, res, last)
            active = [t for t in active if t.status is None]
            turn += 1
        for t in active:
            t.status = "truncated"  # max_turns
        return [self._sample(t) for t in trajs]

    # -- one turn ---------------------------------------------------------------------------
    def _take_turn(self, t: _Trajectory, s: Sample) -> bool:
        """Append the engine's tokens (clamped to the budget); whether the environment steps."""
        t.turns += 1
        room = self.cfg.max_total_tokens - len(t.ids)
        toks, lps, vers = s.completion_ids[:room], s.logprobs[:room], s.versions()[:room]
        t.append(toks, True, lps, vers)
        t.last_turn = (len(t.ids) - len(toks), len(t.ids), s.finish_reason)
        if s.routed_experts is not None:  # [input + output − 1, layers, k] of this call
            t.routes = s.routed_experts[: len(t.prompt) + len(t.ids) - 1]
        if s.finish_reason == "abort":
            t.status = "aborted"
        elif len(s.completion_ids) > room or len(t.ids) >= self.cfg.max_total_tokens:
            t.status = "truncated"  # the budget ended the turn
        return t.status is None

    def _turn_text(self, t: _Trajectory) -> str:
        a, b, _ = t.last_turn
        ids = t.ids[a:b]
        if ids and ids[-1] == self.eos:
            ids = ids[:-1]
        # special tokens stay: a tool's tags may be special tokens (the tool task's <calc>)
        return self.tok.decode(ids, skip_special_tokens=False)

    def _after_step(self, t: _Trajectory, kind: str, res, last: bool) -> None:
        if kind == "timeout":
            t.tool_errors += 1
            self._observe(t, f"error: the tool ran past {self.cfg.tool_timeout_s:g} s")
            t.status = "tool_error"
            return
        if kind == "error":
            t.tool_errors += 1
            res = StepResult(observation=f"error: {type(res).__name__}: {res}", tool_error=True)
        if not isinstance(res, StepResult):
            res = StepResult(observation=f"error: step() returned {type(res).__name__}")
        t.reward += float(res.reward)
        t.tool_calls += res.tool_calls
        t.tool_errors += int(res.tool_error and kind == "ok")
        if res.done:
            t.status = "completed"
        elif last:
            t.status = "truncated"  # no turn left to answer the observation
        elif res.observation is not None:
            self._observe(t, res.observation)

    def _observe(self, t: _Trajectory, text, after_turn: bool = True) -> None:
        """Append an observation with the template's pieces, cut to the budget (keeping room
        for one model token); marks the trajectory when cut, ends it when nothing fits."""
        p = self.pieces
        closing = list(p.turn_end) if after_turn and t.last_turn[2] != "stop" else []
        head, tail = closing + list(p.obs_open), list(p.obs_close)
        body = self.encode_observation(text)
        room = self.cfg.max_total_tokens - len(t.ids) - len(head) - len(tail) - 1
        if room < len(body):
            t.cut = True
            if room < 0:
                t.status = "truncated"
                return
            body = body[:room]
        t.append(head + body + tail, False)

    def _sample(self, t: _Trajectory) -> Sample:
        policy = [v for v, m in zip(t.versions, t.mask) if m]
        mask = t.mask if t.status != "aborted" else [0] * len(t.mask)
        return Sample(
            prompt_ids=t.prompt,
            completion_ids=t.ids,
            logprobs=t.logprobs,
            finish_reason={"completed": "stop", "aborted": "abort"}.get(t.status, "length"),
            weight_version=min(policy) if policy else 0,
            group_id=t.group,
            reward=t.reward if t.status != "aborted" else 0.0,
            meta={
                "status": t.status,
                "turns": t.turns,
                "tool_calls": t.tool_calls,
                "tool_errors": t.tool_errors,
                "observation_cut": t.cut,
                "turn_inputs": t.inputs,
            },
            routed_experts=t.routes,  # the batch's grid holds −1 past them
            token_versions=t.versions,
            policy_mask=mask,
        )


def build_turn_loop(cfg: Optional[MultiTurnConfig], tok, chat: bool) -> Optional[TurnLoop]:
    """The loop ``rollout.multi_turn`` describes (None without it): the environment class
    imported and tried once, the template pieces computed and checked (``chat``:
    ``data.chat_template``)."""
    if cfg is None:
        return None
    from megatron_p3o.env.config import env_factory

    pieces = ChatPieces.from_tokenizer(tok, cfg.observation_role, chat)
    return TurnLoop(cfg, env_factory(cfg), tok, pieces)
