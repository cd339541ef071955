"""The tool-use bases (``tools/make_base.py --task tool_calc|tool_code --train``): a small Llama
warmed up on the task's conversations, some calling the tool and some answering directly —
``tool_calc`` the calculator (``<calc>`` tags, :class:`~megatron_p3o.env.calc_env.CalculatorEnv`),
``tool_code`` a hermes ``python`` call run in the sandbox (the bundled code agent through the
OpenAI-compatible endpoint, :mod:`megatron_p3o.rollout.agents.code_agent`).

Why a mix: RL needs something to learn. Trained on tool conversations only, the base would call
the calculator every time and copy its answer (nothing left to improve); on direct answers only,
it would never call it (and a policy gradient cannot discover a tool it never samples). With a
share ``--tool-share`` of tool conversations, sampling at temperature 1 calls the tool about
that often, greedy decoding answers directly, and RL raises the tool-call rate, and with it the
accuracy. The direct answer taught is a shrug (``?``, never right): two-digit products are beyond
a 4-layer model in minutes, and teaching it to guess them trains a mental-arithmetic path that
competes with copying the tool's value (tried: after a guessing phase the answers that followed a
tool call were right 2% of the time instead of 86%). Copying comes first (:data:`PHASES`), the
shrug after.

The loss is on the assistant's tokens only (both turns of a tool conversation); the user's and
the tool's tokens are context. Held-out accuracy is measured through the trainer's own turn loop
(:class:`megatron_p3o.rollout.turns.TurnLoop`, greedy, fp32 embedded engine, the recipe's
environment or agent): the number the RL recipe starts from.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from shipped_base import MODEL  # tools/: the chain base's size, the same here

ENV = "megatron_p3o.env.calc_env:CalculatorEnv"
AGENT = "megatron_p3o.rollout.agents.code_agent:agent"
# task -> (multi_turn keys, max_new_tokens per turn): = recipes/tiny_cpu_tools.yaml and
# recipes/tiny_cpu_code.yaml; whether a trajectory called its tool
LOOPS = {
    "tool_calc": (dict(env=ENV, max_turns=3, max_total_tokens=48), 16),
    "tool_code": (dict(agent=AGENT, tool_parser="hermes", max_turns=3, max_total_tokens=64,
                       max_prompt_tokens=32, tool_timeout_s=10.0), 24),
}  # fmt: skip


def _called(s) -> bool:
    return s.meta["tool_calls"] > 0  # the calculator's calls, or the calls the endpoint parsed


SHRUG = "?"  # the direct answer the warm-up teaches (see the module docstring)


def _task(name: str):
    import importlib

    return importlib.import_module(f"megatron_p3o.data.tasks.{name}")


def _examples(tok, rows, tool_share: float, rng: random.Random, direct=None, task="tool_calc"):
    """(ids, labels) of warm-up conversations: labels −100 except the assistant's tokens;
    ``direct``: the direct answer taught (None: the true value)."""
    conversation = _task(task).conversation
    out = []
    for r in rows:
        msgs = conversation(r["prompt"], r["answer"], rng.random() < tool_share, direct or "")
        ids, labels = [], []
        for k in range(len(msgs)):  # the render grows message by message (the template
            upto = tok.apply_chat_template(  # extends each prefix: checked in make_tokenizer)
                msgs[: k + 1], tokenize=True, return_dict=False
            )
            new = upto[len(ids) :]
            ids = list(upto)
            labels += new if msgs[k]["role"] == "assistant" else [-100] * len(new)
        # the opening <|assistant|> of each assistant turn is template, not the model's
        for i, t in enumerate(ids):
            if t == tok.convert_tokens_to_ids("<|assistant|>"):
                labels[i] = -100
        out.append((ids, labels))
    return out


def heldout(model, tok, rows, limit: int, task: str = "tool_calc") -> dict:
    """Greedy held-out accuracy and tool-call rate through the trainer's turn loop."""
    from megatron_p3o.data.prompts import encode_prompt
    from megatron_p3o.env.config import MultiTurnConfig
    from megatron_p3o.env.types import EnvItem
    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from megatron_p3o.rollout.turns import build_turn_loop
    from megatron_p3o.types import SamplingParams

    cfg = model.config.to_dict()
    engine = EmbeddedEngine(cfg, "fp32", pad_token_id=tok.pad_token_id)
    engine.update_weights([list(model.state_dict().items())], 0)
    keys, max_new = LOOPS[task]
    loop = build_turn_loop(MultiTurnConfig(**keys), tok, True, (tok.eos_token_id,))
    rows = rows[:limit]
    prompts = [encode_prompt(tok, r["prompt"], chat=True) for r in rows]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    sp = SamplingParams(top_k=1, max_new_tokens=max_new, stop_token_ids=(tok.eos_token_id,),
                        seed=0)  # fmt: skip
    try:
        out = loop.run(engine, prompts, items, 1, sp)
    finally:
        loop.close()
    n = len(out)
    return {
        "acc": sum(s.reward for s in out) / n,
        "tool_call_rate": sum(_called(s) for s in out) / n,
    }


# the warm-up's phases: (steps, share of tool conversations, the direct answer taught: None for
# the true value, learning rate). 1: copying (the tool's value into the answer), with true
# direct answers; 2: a fresh optimizer, the shrug, fewer tool conversations: the first answer
# token moves toward answering directly, the copying stays
PHASES = ((2000, 0.6, None, 3e-3), (300, 0.4, SHRUG, 1e-3))


def _batches(pool, g, batch: int, pad: int):
    idx = torch.randint(0, len(pool), (batch,), generator=g).tolist()
    L = max(len(pool[i][0]) for i in idx)
    x = torch.full((batch, L), pad)
    y = torch.full((batch, L), -100)
    for j, i in enumerate(idx):
        ids, labels = pool[i]
        x[j, : len(ids)] = torch.tensor(ids)
        y[j, : len(ids)] = torch.tensor(labels)
    return x, y


def train(out: Path, seed: int, phases=PHASES, batch: int = 64, start=None, task="tool_calc"):
    """Tokenizer, warm-up, ``hf/`` and the data files under ``out``; returns base.json's facts.
    ``start``: ``(phase, weights dir)`` to begin at a later phase from a model that finished the
    earlier ones (the batches of those phases are drawn again, so the run is the same)."""
    from rich.progress import Progress
    from transformers import LlamaConfig, LlamaForCausalLM

    mod = _task(task)
    make_tokenizer, splits, write_jsonl = mod.make_tokenizer, mod.splits, mod.write_jsonl
    t0 = time.time()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    train_rows, held_rows = splits(seed=0)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(train_rows, out / "train.jsonl")
    write_jsonl(held_rows, out / "heldout.jsonl")
    tok = make_tokenizer(out / "hf", train_rows)
    rng = random.Random(seed)
    pools = [_examples(tok, train_rows, share, rng, direct, task)
             for _, share, direct, _ in phases]  # fmt: skip
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **MODEL,
    )
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    first = 0
    if start is not None:
        first, weights = start
        model = LlamaForCausalLM.from_pretrained(weights)
        for k in range(first):  # the earlier phases' batch draws
            for _ in range(phases[k][0]):
                torch.randint(0, len(pools[k]), (batch,), generator=g)
    with Progress() as bar:
        for k in range(first, len(phases)):
            steps, _, _, lr = phases[k]
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            job = bar.add_task(f"SFT {task}, phase {k + 1}", total=steps)
            for step in range(1, steps + 1):
                x, y = _batches(pools[k], g, batch, tok.pad_token_id)
                loss = model(input_ids=x, labels=y).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                bar.advance(job)
                if step % 250 == 0:
                    h = heldout(model, tok, held_rows, 100, task)
                    bar.console.print(f"phase {k + 1} step {step}: loss {loss.item():.3f}, "
                                      f"held-out (100) {h}")  # fmt: skip
    model.eval()
    model.save_pretrained(out / "hf")
    h = heldout(model, tok, held_rows, len(held_rows), task)
    return {
        "task": task,
        "seed": seed,
        "phases": [list(p) for p in phases],
        "heldout_greedy_acc": round(h["acc"], 4),
        "heldout_tool_call_rate": round(h["tool_call_rate"], 4),
        "heldout_size": len(held_rows),
        "sft_wall_s": round(time.time() - t0, 1),
    }


def write_base_json(out: Path, info: dict) -> None:
    (out / "base.json").write_text(json.dumps(info, indent=1) + "\n")
