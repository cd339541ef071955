"""Multi-turn against single-turn on the same number of policy tokens, side by side: the rollout
(turn loop vs one generate call), the loop's own overhead per episode, and the trainer's step.

The same tiny Llama (random weights, the tool task's BPE tokenizer) in the fp32 embedded engine
and in the trainer. Multi-turn: ``--episodes`` trajectories of ``--turns`` turns of
``--turn-tokens`` tokens each, an observation of ``--obs-tokens`` tokens after every turn but
the last (an environment that answers instantly: the loop, not the tool, is measured).
Single-turn: the same prompts, one completion of ``turns × turn-tokens`` tokens each — the same
policy tokens, without the environment's. Turns are forced to their full length (the stop
token is not a stop here). The step: one P3O optimizer step (ESS pre-pass, gradient pass,
AdamW) on packed micro-batches of each batch. Rounds alternate so drift hits both alike;
medians are reported.

    python benchmarks/bench_multiturn.py [--episodes 64 --turns 3 --rounds 3]

Last line: ``RESULT mt_vs_st_rollout=<x> loop_overhead_ms_per_episode=<y>
mt_vs_st_step=<z> mt_env_token_share=<s>``. The step ratio includes the environment's tokens,
which the forward processes (as context) but the loss does not train.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


class _Echo:
    """An environment that answers every turn at once with a fixed observation."""

    def __init__(self, turns: int, reply: str):
        self.turns, self.reply, self.n = turns, reply, 0

    def reset(self, item):
        self.n = 0

    def step(self, turn):
        from megatron_p3o.env.types import StepResult

        self.n += 1
        return StepResult(None if self.n >= self.turns else self.reply, 0.0, self.n >= self.turns)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=12)
    ap.add_argument("--obs-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (after a warm-up)")
    a = ap.parse_args()

    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from rich.console import Console
    from rich.table import Table

    from megatron_p3o.data.prompts import encode_prompt
    from megatron_p3o.data.tasks import tool_calc
    from megatron_p3o.env.config import MultiTurnConfig
    from megatron_p3o.env.types import EnvItem
    from megatron_p3o.loss import build_objective
    from megatron_p3o.model.builder import BuildOptions, build_model
    from megatron_p3o.model.description import ModelDescription, description_to_hf_config
    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from megatron_p3o.rollout.turns import ChatPieces, TurnLoop
    from megatron_p3o.runtime.parallel import Layout, initialize
    from megatron_p3o.types import SamplingParams
    from megatron_p3o.update.batching import BatchConfig, MicroBatcher
    from megatron_p3o.update.optim import OptimConfig, build_optimizer, wrap_ddp, zero_grads
    from megatron_p3o.update.policy_update import PolicyUpdate
    from megatron_p3o.weight_sync.source import TrainerWeights

    torch.set_num_threads(2)
    groups = initialize(Layout())
    tok = tool_calc.make_tokenizer(Path(tempfile.mkdtemp()), tool_calc.splits(2000, 10)[0])
    desc = ModelDescription(architecture="LlamaForCausalLM", vocab_size=len(tok), hidden_size=128,
                            intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=4,
                            head_dim=32)  # fmt: skip
    seq = 16 + a.turns * (a.turn_tokens + a.obs_tokens + 4)
    chunks = build_model(desc, groups, BuildOptions(seq_length=seq))
    engine = EmbeddedEngine(description_to_hf_config(desc), "fp32", pad_token_id=0)
    engine.update_weights([TrainerWeights(chunks, groups, desc).full()], 0)
    rows = tool_calc.splits(2000, a.episodes)[1]
    prompts = [encode_prompt(tok, r["prompt"], chat=True) for r in rows]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    reply = "7" * a.obs_tokens  # byte-level: one token per character here
    # the loop is given its environment directly (``env`` names it for the record only)
    cfg = MultiTurnConfig(env=f"{__name__}:_Echo", max_turns=a.turns, max_total_tokens=seq - 16)
    loop = TurnLoop(cfg, lambda: _Echo(a.turns, reply), tok, ChatPieces.from_tokenizer(tok))
    turn = SamplingParams(max_new_tokens=a.turn_tokens, seed=1)  # no stop: full turns
    whole = SamplingParams(max_new_tokens=a.turns * a.turn_tokens, seed=1)
    gen_time = [0.0]
    real = engine.generate

    def timed(*x, **k):
        t0 = time.perf_counter()
        out = real(*x, **k)
        gen_time[0] += time.perf_counter() - t0
        return out

    engine.generate = timed
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    opt = build_optimizer(ddp, groups, OptimConfig(lr=1e-6))
    step = PolicyUpdate(build_objective("p3o"), groups, len(tok))
    batcher = MicroBatcher(BatchConfig(max_tokens_per_gpu=1024), groups, seq, 0)

    def rollout(kind):
        gen_time[0] = 0.0
        t0 = time.perf_counter()
        if kind == "multi":
            out = loop.run(engine, prompts, items, 1, turn)
        else:
            out = engine.generate(prompts, 1, whole)
        return out, time.perf_counter() - t0, gen_time[0]

    def train(samples):
        adv = torch.randn(len(samples), generator=torch.Generator().manual_seed(0))
        (mbs,), _ = batcher.build(samples, adv)
        t0 = time.perf_counter()
        zero_grads(ddp, opt)
        step.run(ddp, mbs)
        opt.step()
        return time.perf_counter() - t0

    times = {k: {"rollout": [], "loop": [], "step": []} for k in ("multi", "single")}
    tokens = {}
    for r in range(a.rounds + 1):
        for kind in ("multi", "single"):
            samples, total, gen = rollout(kind)
            s = train(samples)
            pol = sum(x.policy_tokens for x in samples)
            tokens[kind] = (pol, sum(len(x.completion_ids) for x in samples) - pol)
            if r:  # the first round warms up
                times[kind]["rollout"].append(total)
                times[kind]["loop"].append(total - gen)
                times[kind]["step"].append(s)
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in times.items()}
    table = Table(title=f"{a.episodes} episodes: {a.turns} turns × {a.turn_tokens} tokens, "
                  f"{a.obs_tokens}-token observations; median of {a.rounds}")  # fmt: skip
    for c in ("batch", "policy tokens", "env tokens", "rollout s", "loop s", "step s"):
        table.add_column(c)
    for k in ("multi", "single"):
        m = med[k]
        table.add_row(k, str(tokens[k][0]), str(tokens[k][1]), f"{m['rollout']:.3f}",
                      f"{m['loop']:.3f}", f"{m['step']:.3f}")  # fmt: skip
    Console().print(table)
    share = tokens["multi"][1] / sum(tokens["multi"])
    print(
        f"RESULT mt_vs_st_rollout={med['multi']['rollout'] / med['single']['rollout']:.2f} "
        f"loop_overhead_ms_per_episode={1000 * med['multi']['loop'] / a.episodes:.2f} "
        f"mt_vs_st_step={med['multi']['step'] / med['single']['step']:.2f} "
        f"mt_env_token_share={share:.2f}"
    )


if __name__ == "__main__":
    main()
