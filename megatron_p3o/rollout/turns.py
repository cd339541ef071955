"""Multi-turn rollouts, token in and token out, one coroutine per trajectory.

Why token in, token out: the ratio πθ/πb must be taken on the tokens the engine sampled. A loop
that renders the conversation to text and re-tokenizes it between turns trains on other tokens
than were sampled — BPE is not a bijection (a sampled ``1``·``79``·``1`` re-encodes as
``17``·``9``·``1``), a chat template may rewrite the history — and one misaligned token moves
P3O's e_B for the whole step. So a trajectory is append-only (:mod:`.trajectory`): every turn's
input is the previous input, the engine's output and the appended ids (the prefix invariant).

Why a coroutine per trajectory: agentic work is mostly waiting — on tools, on the engine. Each
trajectory advances when its own engine turn and its own environment step return; nothing waits
for the slowest trajectory of the batch (the lock-step loop this replaced took 3.25× as long on
tools of random latency, ``benchmarks/bench_multiturn.py``). ``rollout.multi_turn.concurrency``
trajectories are in flight at once. The engine serves concurrent turns its own way
(:mod:`.turn_server`): SGLang batches its requests continuously; the embedded engine batches
every waiting trajectory in one forward and keeps each one's KV cache between its turns.

Environments run outside the trainer's process (:mod:`megatron_p3o.env.workers`): a step past
``tool_timeout_s`` kills its worker and ends the episode ``tool_error``. A stop signal ends the
rollout: every trajectory is cancelled, every busy worker killed, and
:class:`~megatron_p3o.runtime.preemption.RolloutInterrupted` raised (the run checkpoints its
last step; the batch is made again on resume).

Random streams: each trajectory turn samples with a seed of its own (the batch's seed, the
trajectory's index, the turn), so no trajectory's draws depend on when others finish.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace
from typing import List, Optional, Sequence

from megatron_p3o.env.config import MultiTurnConfig
from megatron_p3o.env.types import EnvItem, StepResult
from megatron_p3o.rollout.chat_pieces import ChatPieces, encode_observation
from megatron_p3o.rollout.sglang.protocol import routing_key
from megatron_p3o.rollout.trajectory import Trajectory, turn_seed  # noqa: F401 - re-exported
from megatron_p3o.runtime.errors import UserError
from megatron_p3o.types import Sample, SamplingParams

POLL_S = 0.2  # how often a rollout looks for a stop signal


class AllAborted(UserError, RuntimeError):
    """Every trajectory of a rollout was aborted: nothing to train on (the message says why)."""


class TurnLoop:
    """Runs one environment episode per trajectory against an engine (:meth:`run`)."""

    def __init__(self, cfg: MultiTurnConfig, host, tok, pieces: ChatPieces, agents=None):
        """``host``: where episodes run (:class:`~megatron_p3o.env.workers.EnvHost`); or
        ``agents`` (:class:`~megatron_p3o.rollout.agents.runner.AgentEpisodes`): the user's
        agent drives each episode through the endpoint."""
        self.cfg, self.host, self.tok, self.pieces = cfg, host, tok, pieces
        self.agents = agents
        self.last_ticks = 0  # the embedded server's forwards in the last rollout (benchmarks)
        self._encoded: dict = {}  # observation text -> ids (tools repeat their answers)

    def run(
        self,
        engine,
        prompts: Sequence[Sequence[int]],
        items: Sequence[EnvItem],
        n: int,
        sampling: SamplingParams,
    ) -> List[Sample]:
        """``n`` trajectories per prompt (``group_id`` = prompt index), in group order. An engine
        that serves several ranks runs them where it lives (``rollout_turns``)."""
        route = getattr(engine, "rollout_turns", None)
        if route is not None:
            return route(self, prompts, items, n, sampling)
        return self.run_local(engine, prompts, items, n, sampling)

    def run_local(self, engine, prompts, items, n, sampling) -> List[Sample]:
        """Every trajectory on this process, against ``engine``."""
        trajs = [Trajectory(g * n + j, g, list(p)) for g, p in enumerate(prompts) for j in range(n)]
        if not trajs:
            return []
        asyncio.run(self._run(engine, trajs, items, sampling))
        self._report(trajs, items)
        if self.agents is not None:
            return self.agents.samples(trajs)
        return [t.sample() for t in trajs]

    def close(self) -> None:
        if self.host is not None:
            self.host.close()

    # -- the rollout ----------------------------------------------------------------------------
    async def _run(self, engine, trajs, items, sampling) -> None:
        from megatron_p3o.runtime.preemption import RolloutInterrupted, signalled

        c = self.cfg
        first = c.max_prompt_tokens if self.agents else max(len(t.prompt) for t in trajs)
        longest = first + c.max_total_tokens
        server = engine.turn_server(min(c.concurrency, len(trajs)), longest)
        if self.agents is not None:
            await self.agents.start()
        tasks = [
            asyncio.ensure_future(self._episode(server, t, items[t.group], sampling)) for t in trajs
        ]
        try:
            pending = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=POLL_S,
                                                return_when=asyncio.FIRST_EXCEPTION)  # fmt: skip
                failed = [x for x in tasks if x.done() and x.exception() is not None]
                if failed:
                    raise failed[0].exception()
                if pending and signalled():
                    raise RolloutInterrupted("a stop signal arrived during a multi-turn rollout")
        except BaseException:
            for x in tasks:
                x.cancel()
            if self.host is not None:
                self.host.interrupt()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            self.last_ticks = getattr(server, "ticks", 0)
            server.close()
            if self.agents is not None:
                await self.agents.stop()

    async def _episode(self, server, t: Trajectory, item: EnvItem, sampling) -> None:
        c = self.cfg
        await server.admit(t.index)
        if self.agents is not None:
            try:
                await self.agents.episode(self, server, t, item, sampling)
            finally:
                server.release(t.index)
            return
        ep = self.host.episode()
        try:
            seeded = replace(item, seed=item.seed * 1_000_003 + t.index)
            t0 = time.monotonic()
            kind, val = await ep.reset(seeded, c.tool_timeout_s)
            t.env_s += time.monotonic() - t0
            if kind != "ok":
                why = f"ran past {c.tool_timeout_s:g} s" if kind == "timeout" else f"failed: {val}"
                t.status, t.error = "aborted", f"reset() {why}"
                return
            if val[0] is not None:
                self._observe(t, val[0], val[1], server.context_length, after_turn=False)
            key = routing_key(t.prompt)  # a router: the server that holds the prefix
            while t.status is None:
                await self._turn(server, ep, t, sampling, key)
        finally:
            await ep.aclose()
            ep.close()
            server.release(t.index)

    async def _turn(self, server, ep, t: Trajectory, sampling, key: str) -> None:
        c, ctx = self.cfg, server.context_length
        oldest = t.oldest_version()
        stale = c.max_trajectory_staleness
        if t.turns >= c.max_turns:
            t.status = "truncated"
            return
        if stale is not None and oldest is not None and server.weight_version - oldest > stale:
            t.status, t.stale = "truncated", True
            return
        budget = t.turn_budget(sampling.max_new_tokens, c.max_total_tokens, ctx)
        if budget <= 0:
            t.status = "truncated"
            return
        sp = replace(sampling, max_new_tokens=budget, seed=turn_seed(sampling.seed, t.index,
                                                                       t.turns))  # fmt: skip
        t.inputs.append(len(t.prompt) + len(t.ids))
        t0 = time.monotonic()
        s = await server.generate(t.index, self.engine_input(t), sp, key)
        t1 = time.monotonic()
        t.engine_s += t1 - t0
        if not t.take_turn(s, budget_left=budget == sampling.max_new_tokens):
            return
        kind, val = await ep.step(self._turn_text(t, sampling.stop_token_ids), c.tool_timeout_s)
        t.env_s += time.monotonic() - t1
        self._after_step(t, kind, val, ctx, last=t.turns >= c.max_turns)

    def engine_input(self, t: Trajectory) -> List[int]:
        """What the engine is given for the next turn: the trajectory as kept, token for token
        (a test's control loop re-renders it here to show what that breaks)."""
        return t.prompt + t.ids

    # -- one turn's environment side ------------------------------------------------------------
    def _turn_text(self, t: Trajectory, stops) -> str:
        a, b = t.spans[-1]
        ids = t.ids[a:b]
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        # special tokens stay: a tool's tags may be special tokens (the tool task's <calc>)
        return self.tok.decode(ids, skip_special_tokens=False)

    def _after_step(self, t: Trajectory, kind: str, val, ctx, last: bool) -> None:
        if kind in ("timeout", "died"):  # the worker was killed or died: its state is gone
            t.tool_errors += 1
            t.turn_rewards.append(0.0)
            why = (f"the tool ran past {self.cfg.tool_timeout_s:g} s" if kind == "timeout"
                   else str(val))  # fmt: skip
            self._observe(t, f"error: {why}", False, ctx)
            if t.status is None:
                t.status = "tool_error"
            return
        cut = False
        if kind == "error":  # the step raised: an error observation, the episode goes on
            t.tool_errors += 1
            res = StepResult(observation=f"error: {val}", tool_error=True)
        else:
            res, cut = val
            if isinstance(res, str):  # step() returned something else
                res = StepResult(observation=f"error: {res}", tool_error=True)
        t.turn_rewards.append(float(res.reward))
        t.tool_calls += res.tool_calls
        t.tool_errors += int(res.tool_error and kind == "ok")
        if res.done:
            t.status = "completed"
        elif last:
            t.status = "truncated"  # no turn left to answer the observation
        elif res.observation is not None:
            self._observe(t, res.observation, cut, ctx)

    def _observe(self, t: Trajectory, text: str, cut: bool, ctx, after_turn: bool = True) -> None:
        """Append an observation with the template's pieces, cut to the budget (keeping room
        for one model token); marks the trajectory when cut, ends it when nothing fits."""
        p = self.pieces
        head = (list(p.closing(t.last_finish)) if after_turn else []) + list(p.obs_open)
        tail = list(p.obs_close)
        body = self._encoded.get(text)  # the text was cut to size in the worker
        if body is None:
            body = encode_observation(self.tok, text)
            if len(self._encoded) < 65536:
                self._encoded[text] = body
        room = t.turn_budget(self.cfg.max_total_tokens, self.cfg.max_total_tokens, ctx)
        room -= len(head) + len(tail) + 1
        t.cut = t.cut or cut
        if room < len(body):
            t.cut = True
            if room < 0:
                t.status = "truncated"
                return
            body = body[:room]
        t.append(head + body + tail, False)

    def _report(self, trajs: List[Trajectory], items: Sequence[EnvItem]) -> None:
        """One line for the rollout's aborted trajectories: the environment, the first one's
        item and reason, how many trajectories and items; every trajectory aborted is an
        error."""
        aborted = [t for t in trajs if t.status == "aborted"]
        if not aborted:
            return
        it = items[aborted[0].group]
        n_items = len({t.group for t in aborted})
        who = f"agent={self.cfg.agent}" if self.agents is not None else f"env={self.cfg.env}"
        line = (f"rollout.multi_turn.{who}: data item {it.index} "
                f"({it.prompt[:60]!r}): {aborted[0].error}; {len(aborted)} of {len(trajs)} "
                f"trajectories ({n_items} items) aborted")  # fmt: skip
        if len(aborted) == len(trajs):
            raise AllAborted(f"every trajectory of the rollout was aborted: {line}")
        print(f"warning: {line}, not trained", file=sys.stderr, flush=True)


def build_turn_loop(cfg: Optional[MultiTurnConfig], tok, chat: bool,
                    stop_ids: Sequence[int] = ()) -> Optional[TurnLoop]:  # fmt: skip
    """The loop ``rollout.multi_turn`` describes (None without it): the environment class
    imported and tried once, the template pieces computed and checked (``chat``:
    ``data.chat_template``; ``stop_ids``: the tokens that end a model turn)."""
    if cfg is None:
        return None
    if cfg.agent:
        from megatron_p3o.rollout.agents.runner import AgentEpisodes

        return TurnLoop(cfg, None, tok, ChatPieces(), AgentEpisodes(cfg, tok, stop_ids))
    from megatron_p3o.env.config import env_host

    pieces = ChatPieces.from_tokenizer(tok, cfg.observation_role, chat, stop_ids)
    return TurnLoop(cfg, env_host(cfg), tok, pieces)
