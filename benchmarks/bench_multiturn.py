"""Multi-turn rollouts, side by side in one run: one coroutine per trajectory against lock-step
turns, and a multi-turn rollout against a single-turn one of the same policy tokens.

1. ``tools`` — a zero-cost scripted engine (every turn is a tool call), ``--n`` trajectories
   of 1–8 turns whose tools answer after U(0, 0.5) s, 5% of the calls after 3 s (drawn from
   each episode's seed: both loops see the same latencies; ``bench_envs.LatencyTools``, in
   worker processes as in training). Lock-step: every trajectory's next turn waits until the
   whole batch finished its turn (the loop this project ran before issue 62; here the same
   loop behind a per-turn barrier, ``LockStep``). The limit: the slowest trajectory's own
   serial time (its tools' and its engine turns' seconds).
2. ``embedded`` — the embedded engine (a random Llama of the shipped tool base's shape, the
   tool task's BPE tokenizer, ``--precision`` fp32 as before issue 62): ``--episodes`` of
   ``--turns`` turns of ``--turn-tokens`` tokens with ``--obs-tokens``-token observations
   (answered at once), against one generate of ``turns × turn-tokens`` tokens per prompt — the
   same policy tokens. Turns are forced to their full length (no stop token). Beside them the
   floor: one generate per prompt whose prompt carries the multi-turn rollout's environment
   tokens too (the same tokens through the model; what multi-turn costs beyond it is the loop's
   and the turn server's own).
3. ``sglang`` (``--sglang``, needs ``$SGLANG_PYTHON``) — the real SGLang 0.5.23 CPU server
   with that model, ``--sglang-n`` trajectories, the latency profile of 1, async against
   lock-step.

Rounds alternate the compared runs so drift hits both alike; medians are reported.

    python benchmarks/bench_multiturn.py [--rounds 3] [--sglang]

Last line: ``RESULT tools_lockstep_vs_async=<x> tools_async_vs_limit=<y>
embedded_mt_vs_st=<z> embedded_floor_vs_st=<f> embedded_mt_vs_floor=<g>
[sglang_lockstep_vs_async=<w>]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_p3o.rollout.turn_server import TurnServer  # noqa: E402


class LockStep(TurnServer):
    """A turn server behind a per-turn barrier: a trajectory's turn starts only when every
    trajectory still running has asked for its turn (the lock-step loop's schedule)."""

    def __init__(self, inner):
        self.inner, self.context_length = inner, inner.context_length
        self.active, self.arrived, self.gate = set(), set(), None

    @property
    def weight_version(self):
        return self.inner.weight_version

    async def admit(self, k):
        await self.inner.admit(k)
        self.active.add(k)

    def _open(self):
        if self.arrived and self.arrived >= self.active:
            self.gate.set()
            self.arrived, self.gate = set(), asyncio.Event()

    async def generate(self, k, ids, sampling, key=None):
        if self.gate is None:
            self.gate = asyncio.Event()
        gate = self.gate
        self.arrived.add(k)
        self._open()
        await gate.wait()
        return await self.inner.generate(k, ids, sampling, key)

    def release(self, k):
        self.active.discard(k)
        self.arrived.discard(k)
        if self.gate is not None:
            self._open()
        self.inner.release(k)

    def close(self):
        self.inner.close()


def lockstep(engine):
    """``engine`` whose multi-turn server is wrapped in :class:`LockStep`."""
    real = engine.turn_server
    engine.turn_server = lambda slots, max_len: LockStep(real(slots, max_len))
    return engine


def scripted_engine(tok):
    """Zero cost: every turn is the same tool call, returned at once."""
    from megatron_p3o.rollout.engine import RolloutEngine
    from megatron_p3o.types import Sample

    call = tok.encode("<calc>1+2</calc>", add_special_tokens=False) + [tok.eos_token_id]

    class Scripted(RolloutEngine):
        weight_version = 0

        def generate(self, prompts, n, sampling, keys=None):
            return [Sample(list(p), call, [-0.5] * len(call), "stop", 0, group_id=i)
                    for i, p in enumerate(prompts)]  # fmt: skip

        def update_weights(self, buckets, version):
            pass

        def health(self):
            return {"ok": True}

    return Scripted()


def loop_for(tok, env: str, args: dict, turns: int, total: int, concurrency: int):
    from megatron_p3o.env.config import MultiTurnConfig
    from megatron_p3o.rollout.turns import build_turn_loop

    cfg = MultiTurnConfig(env=f"bench_envs:{env}", env_args=args, max_turns=turns,
                          max_total_tokens=total, tool_timeout_s=60.0, concurrency=concurrency,
                          memory_mb=0)  # fmt: skip
    return build_turn_loop(cfg, tok, True, (tok.eos_token_id,))


def timed(loop, engine, prompts, items, sp):
    t0 = time.perf_counter()
    out = loop.run(engine, prompts, items, 1, sp)
    return time.perf_counter() - t0, out


def tool_latency(tok, prompts, items, a, results):
    """Part 1: async against lock-step on tools of random latency, zero-cost engine."""
    from megatron_p3o.types import SamplingParams

    args = {"max_turns": 8, "hi": 0.5, "slow_p": 0.05, "slow_s": 3.0}
    sp = SamplingParams(max_new_tokens=16, stop_token_ids=(tok.eos_token_id,), seed=1)
    loops = {k: loop_for(tok, "LatencyTools", args, 8, 200, a.n) for k in ("async", "lockstep")}
    engines = {"async": scripted_engine(tok), "lockstep": lockstep(scripted_engine(tok))}
    times = {k: [] for k in loops}
    limit = []
    try:
        for r in range(a.rounds + 1):
            for k in ("async", "lockstep") if r % 2 == 0 else ("lockstep", "async"):
                dt, out = timed(loops[k], engines[k], prompts, items, sp)
                if r:  # the first round starts the environment workers
                    times[k].append(dt)
                    if k == "async":
                        limit.append(max(s.meta["env_s"] + s.meta["engine_s"] for s in out))
                print(f"  tools round {r} {k}: {dt:.2f} s", flush=True)
    finally:
        for lp in loops.values():
            lp.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    results["tools"] = (med["async"], med["lockstep"], statistics.median(limit))


def embedded(tok, a, results):
    """Part 2: the embedded engine, multi-turn against single-turn at equal policy tokens."""
    from megatron_p3o.data.prompts import encode_prompt
    from megatron_p3o.data.tasks import tool_calc
    from megatron_p3o.env.types import EnvItem
    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from megatron_p3o.types import SamplingParams

    model = random_model(tok, Path(tempfile.mkdtemp()))
    engine = EmbeddedEngine(model[0], a.precision, pad_token_id=tok.pad_token_id)
    engine.update_weights([model[1]], 0)
    rows = tool_calc.splits(2000, a.episodes)[1]
    prompts = [encode_prompt(tok, r["prompt"], chat=True) for r in rows]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    reply = "7" * a.obs_tokens  # byte-level: one token per character here
    total = a.turns * (a.turn_tokens + a.obs_tokens + 4)
    loop = loop_for(tok, a.embedded_env, {"turns": a.turns, "reply": reply}, a.turns, total, 256)
    turn = SamplingParams(max_new_tokens=a.turn_tokens, seed=1)  # no stop: full turns
    whole = SamplingParams(max_new_tokens=a.turns * a.turn_tokens, seed=1)
    # the floor: single-turn completions whose prompts carry as many more tokens as the
    # multi-turn rollout appends (its environment tokens), so the same tokens go through the
    # model; what the multi-turn rollout costs beyond it is the loop's and the server's own
    env_ids = loop.pieces.obs_open + tuple(tok.encode(reply, add_special_tokens=False))
    env_ids = list(loop.pieces.turn_end + env_ids + loop.pieces.obs_close) * (a.turns - 1)
    longer = [p + env_ids for p in prompts]
    times = {"multi": [], "single": [], "floor": []}
    order = ("multi", "single", "floor")
    tokens, ticks = {}, 0
    try:
        for r in range(a.rounds + 1):
            for k in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                if k == "multi":
                    out = loop.run(engine, prompts, items, 1, turn)
                    ticks = loop.last_ticks
                elif k == "floor":
                    out = engine.generate(longer, 1, whole)
                else:
                    out = engine.generate(prompts, 1, whole)
                dt = time.perf_counter() - t0
                pol = sum(s.policy_tokens for s in out)
                tokens[k] = (pol, sum(len(s.completion_ids) for s in out) - pol)
                if r:
                    times[k].append(dt)
                print(f"  embedded round {r} {k}: {dt:.3f} s", flush=True)
    finally:
        loop.close()
    assert tokens["multi"][0] == tokens["single"][0], tokens  # the same policy tokens
    assert len(env_ids) * len(prompts) == tokens["multi"][1], (len(env_ids), tokens)
    results["embedded"] = ({k: statistics.median(v) for k, v in times.items()}, tokens, ticks)


def random_model(tok, out: Path):
    """A seeded random Llama of the shipped tool base's shape over the task's tokenizer, saved
    as an HF directory: ``(config dict, sorted named tensors)``."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from shipped_base import MODEL

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      **{**MODEL, "max_position_embeddings": 512})  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    return raw, sorted(load_file(str(out / "model.safetensors")).items()), out


def sglang(tok, prompts, items, a, results):
    """Part 3: the real SGLang CPU server, async against lock-step, the tools of part 1."""
    from megatron_p3o.rollout.sglang import SGLangConfig, build_fleet
    from megatron_p3o.runtime.ports import free_port
    from megatron_p3o.types import SamplingParams

    work = Path(tempfile.mkdtemp(prefix="bench-mt-sglang-"))
    raw, named, hf = random_model(tok, work / "hf")
    sg = SGLangConfig(model_path=str(hf), dtype="bfloat16", port=free_port(),
                      startup_timeout_s=600)  # fmt: skip
    fleet = build_fleet(sg, [], work / "logs", "tensor")
    fleet.start()
    try:
        fleet.update_weights(iter([named]), 1)
        args = {"max_turns": 8, "hi": 0.5, "slow_p": 0.05, "slow_s": 3.0}
        sp = SamplingParams(max_new_tokens=12, stop_token_ids=(tok.eos_token_id,), seed=1)
        n = a.sglang_n
        loops = {k: loop_for(tok, "LatencyTools", args, 8, 300, n) for k in ("async", "lock")}
        real = fleet.turn_server
        times = {k: [] for k in loops}
        try:
            for r in range(a.rounds + 1):
                for k in ("async", "lock") if r % 2 == 0 else ("lock", "async"):
                    fleet.turn_server = (real if k == "async" else
                                         lambda s, m: LockStep(real(s, m)))  # fmt: skip
                    dt, _ = timed(loops[k], fleet, prompts[:n], items[:n], sp)
                    if r:
                        times[k].append(dt)
                    print(f"  sglang round {r} {k}: {dt:.2f} s", flush=True)
        finally:
            for lp in loops.values():
                lp.close()
        results["sglang"] = {k: statistics.median(v) for k, v in times.items()}
    finally:
        fleet.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256, help="trajectories of the tool comparison")
    ap.add_argument("--episodes", type=int, default=256,
                    help="part 2's trajectories (256: the tool recipe's rollout, 32 prompts x 8; "
                         "64 before 2026-12-07 noon)")  # fmt: skip
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=12)
    ap.add_argument("--obs-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (after a warm-up)")
    ap.add_argument("--sglang", action="store_true", help="also the real SGLang CPU server")
    ap.add_argument("--sglang-n", type=int, default=128)
    ap.add_argument("--parts", default="tools,embedded", help="of tools,embedded")
    ap.add_argument("--precision", default="fp32", help="the embedded engine's (part 2)")
    ap.add_argument("--embedded-env", default="Echo", choices=["Echo", "EchoOnLoop"],
                    help="part 2's environment: in worker processes (as a sync environment "
                         "runs), or on the event loop (no isolation)")  # fmt: skip
    a = ap.parse_args()

    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from machine import cpu_model
    from rich.console import Console
    from rich.table import Table

    from megatron_p3o.data.prompts import encode_prompt
    from megatron_p3o.data.tasks import tool_calc
    from megatron_p3o.env.types import EnvItem

    torch.set_num_threads(2)
    print(f"CPU: {cpu_model()}, torch threads 2")
    tok = tool_calc.make_tokenizer(Path(tempfile.mkdtemp()), tool_calc.splits(2000, 10)[0])
    rows = tool_calc.splits(2000, max(a.n, a.sglang_n))[1]
    prompts = [encode_prompt(tok, r["prompt"], chat=True) for r in rows]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    results, parts = {}, a.parts.split(",")
    if "tools" in parts:
        tool_latency(tok, prompts[: a.n], items[: a.n], a, results)
    if "embedded" in parts:
        embedded(tok, a, results)
    if a.sglang:
        sglang(tok, prompts, items, a, results)
    table = Table(title=f"multi-turn rollouts, median of {a.rounds} rounds ({cpu_model()})")
    for c in ("comparison", "A s", "B s", "B ÷ A"):
        table.add_column(c)
    res = []
    if "tools" in results:
        asy, lock, lim = results["tools"]
        table.add_row(f"tools: async (A) vs lock-step (B), N={a.n}, ≤8 turns",
                      f"{asy:.2f}", f"{lock:.2f}", f"{lock / asy:.2f}")  # fmt: skip
        table.add_row("tools: the limit (A: slowest trajectory's own serial time) vs async (B)",
                      f"{lim:.2f}", f"{asy:.2f}", f"{asy / lim:.2f}")  # fmt: skip
        res += [
            f"tools_lockstep_vs_async={lock / asy:.2f}",
            f"tools_async_vs_limit={asy / lim:.2f}",
        ]
    if "embedded" in results:
        med, tokens, ticks = results["embedded"]
        table.add_row(f"embedded {a.precision} ({a.embedded_env}): single-turn (A) vs "
                      f"multi-turn (B), {tokens['multi'][0]} policy "
                      f"tokens, {tokens['multi'][1]} env tokens, {ticks} forwards",
                      f"{med['single']:.3f}", f"{med['multi']:.3f}",
                      f"{med['multi'] / med['single']:.2f}")  # fmt: skip
        table.add_row("embedded: single-turn with the env tokens in its prompts (A: the same "
                      "tokens through the model) vs multi-turn (B)", f"{med['floor']:.3f}",
                      f"{med['multi']:.3f}", f"{med['multi'] / med['floor']:.2f}")  # fmt: skip
        res.append(f"embedded_mt_vs_st={med['multi'] / med['single']:.2f}")
        res.append(f"embedded_floor_vs_st={med['floor'] / med['single']:.2f}")
        res.append(f"embedded_mt_vs_floor={med['multi'] / med['floor']:.2f}")
    if "sglang" in results:
        m = results["sglang"]
        table.add_row(
            f"sglang CPU server: async (A) vs lock-step (B), N={a.sglang_n}",
            f"{m['async']:.2f}",
            f"{m['lock']:.2f}",
            f"{m['lock'] / m['async']:.2f}",
        )
        res.append(f"sglang_lockstep_vs_async={m['lock'] / m['async']:.2f}")
    Console(width=140).print(table)
    print("RESULT " + " ".join(res))


if __name__ == "__main__":
    main()
