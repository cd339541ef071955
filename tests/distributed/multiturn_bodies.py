"""Rank bodies of the multi-turn tests (issue 53): trajectories rolled out token in, token out by
an engine holding the trainer's weights, then one P3O step of the trainer on them.

On policy (fp32 engine, no push) the trainer's ℓθ on the policy's tokens is the engine's ℓb, so
e_B = 1; no environment token may reach the loss: the gradient reaching the logits rows that
score environment tokens is exactly zero (the unfused output layer, whose logits exist).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

from megatron_p3o.checkpoint.state import load_model_state
from megatron_p3o.loss import build_objective
from megatron_p3o.loss.config import LossConfig
from megatron_p3o.model.builder import BuildOptions, build_model
from megatron_p3o.update.batching import BatchConfig, MicroBatcher
from megatron_p3o.update.optim import OptimConfig, wrap_ddp, zero_grads
from megatron_p3o.update.policy_update import PolicyUpdate

from .bodies import desc_of

SEQ = 96


def tool_model(groups, tok_dir: str, out: str, seed: int = 0, peaked: bool = False):
    """A tiny Llama over the tool task's tokenizer (random weights, seeded alike on every rank),
    saved as a Megatron checkpoint at ``out`` and as an HF directory at ``out``/hf (rank 0).
    ``peaked``: the output layer's rows scaled ×4 and the end-of-turn row zeroed, so a turn
    practically never stops by itself (a test that needs a long turn)."""
    from transformers import AutoTokenizer

    from megatron_p3o.checkpoint.state import save_model_state
    from megatron_p3o.weight_sync.source import TrainerWeights

    tok = AutoTokenizer.from_pretrained(tok_dir)
    desc = replace(desc_of("llama"), vocab_size=len(tok))
    chunks = build_model(desc, groups, BuildOptions(seq_length=SEQ))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for _, p in sorted(chunks[0].named_parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=g))  # less uniform than the init
        if peaked:
            w = chunks[0].output_layer.weight
            w.mul_(4.0)
            w[tok.eos_token_id].zero_()
    save_model_state(chunks, out)
    named = TrainerWeights(chunks, groups, desc).full()
    if groups.rank == 0:
        from safetensors.torch import save_file

        from megatron_p3o.model.description import description_to_hf_config

        hf = Path(out) / "hf"
        hf.mkdir(parents=True, exist_ok=True)
        cfg = description_to_hf_config(desc)
        cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id)  # fmt: skip
        import json

        (hf / "config.json").write_text(json.dumps(cfg))
        save_file({n: t.contiguous() for n, t in named}, str(hf / "model.safetensors"))
        tok.save_pretrained(hf)
    return len(tok)


def embedded_rollout(groups, ckpt: str, n_prompts: int = 16, n: int = 3, turns: int = 3,
                     env: str = "EchoEnv", env_args=None, pushes=()):  # fmt: skip
    """Trajectories from the fp32 embedded engine holding the checkpoint's weights, against an
    environment of tests/envs.py (EchoEnv: every episode ``turns`` turns), and the prefix
    invariant over them. ``pushes``: (tick, version) pairs — a weight push lands before that
    tick of the engine's multi-turn server (the same weights under a new version: the caches
    are recomputed, ℓb stay on policy)."""
    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from tests.turn_recording import prefix_violations, record_turns

    hf = Path(ckpt) / "hf"
    import json

    from safetensors.torch import load_file

    cfg = json.loads((hf / "config.json").read_text())
    engine = EmbeddedEngine(cfg, "fp32", pad_token_id=cfg["pad_token_id"])
    weights = sorted(load_file(str(hf / "model.safetensors")).items())
    engine.update_weights([weights], 0)
    if pushes:
        _push_at_ticks(engine, weights, dict(pushes))
    calls = record_turns(engine)
    samples = rollout(engine, str(hf), n_prompts, n, turns, env=env, env_args=env_args)
    from transformers import AutoTokenizer

    inv = prefix_violations(samples, calls)
    inv["retokenized"] = retokenized(samples, AutoTokenizer.from_pretrained(str(hf)))
    return samples, inv


def retokenized(samples, tok) -> int:
    """Trajectories whose text, rendered and encoded again, is other tokens than were kept."""
    n = 0
    for s in samples:
        seq = s.prompt_ids + s.completion_ids
        n += tok.encode(tok.decode(seq, skip_special_tokens=False),
                        add_special_tokens=False) != seq  # fmt: skip
    return n


def _push_at_ticks(engine, weights, at: dict) -> None:
    """A push (the same weights as version ``at[tick]``) lands before each listed tick of the
    multi-turn server: trajectories in a tool call then, or mid-turn."""
    real = engine.turn_server

    def turn_server(slots, max_len):
        srv = real(slots, max_len)
        inner = srv._tick

        def tick_(rows):
            if srv.ticks in at:
                engine.update_weights([weights], at[srv.ticks])
            return inner(rows)

        srv._tick = tick_
        return srv

    engine.turn_server = turn_server


def rollout(engine, tok_dir: str, n_prompts: int, n: int, turns: int, max_new_tokens: int = 8,
            env: str = "EchoEnv", env_args=None):  # fmt: skip
    """``n`` trajectories of each of ``n_prompts`` held-out prompts through the turn loop."""
    from transformers import AutoTokenizer

    from megatron_p3o.data.prompts import encode_prompt
    from megatron_p3o.data.tasks import tool_calc
    from megatron_p3o.env.config import MultiTurnConfig
    from megatron_p3o.env.types import EnvItem
    from megatron_p3o.rollout.turns import build_turn_loop
    from megatron_p3o.types import SamplingParams

    tok = AutoTokenizer.from_pretrained(tok_dir)
    rows = tool_calc.splits(100, n_prompts)[1]
    prompts = [encode_prompt(tok, r["prompt"], chat=True) for r in rows]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    args = env_args or {"turns": turns, "reply": "12*3=36"}
    cfg = MultiTurnConfig(env=f"tests.envs:{env}", env_args=args, max_turns=turns,
                          max_total_tokens=SEQ - 24)  # fmt: skip
    loop = build_turn_loop(cfg, tok, True, (tok.eos_token_id,))
    sp = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens,
                        stop_token_ids=(tok.eos_token_id,), seed=5)  # fmt: skip
    try:
        return loop.run(engine, prompts, items, n, sp)
    finally:
        loop.close()


def agent_rollout(engine, tok_dir: str, n_prompts: int, n: int, agent: str = "three_turns",
                  max_new_tokens: int = 8):  # fmt: skip
    """The same trajectories driven by an agent of tests/agents.py through the endpoint."""
    from transformers import AutoTokenizer

    from megatron_p3o.data.tasks import tool_calc
    from megatron_p3o.env.config import MultiTurnConfig
    from megatron_p3o.env.types import EnvItem
    from megatron_p3o.rollout.turns import build_turn_loop
    from megatron_p3o.types import SamplingParams

    tok = AutoTokenizer.from_pretrained(tok_dir)
    rows = tool_calc.splits(100, n_prompts)[1]
    items = [EnvItem(i, r["prompt"], r["answer"], i) for i, r in enumerate(rows)]
    cfg = MultiTurnConfig(agent=f"tests.agents:{agent}", max_turns=3, max_prompt_tokens=24,
                          max_total_tokens=SEQ - 24)  # fmt: skip
    loop = build_turn_loop(cfg, tok, True, (tok.eos_token_id,))
    sp = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens,
                        stop_token_ids=(tok.eos_token_id,), seed=5)  # fmt: skip
    try:
        return loop.run(engine, [[0]] * len(rows), items, n, sp)
    finally:
        loop.close()


def on_policy_step(groups, ckpt: str, samples, budget: int = 256):
    """One P3O step of the trainer (packed micro-batches, PolicyUpdate.run, unfused output
    layer) on ``samples`` at the checkpoint's weights. Returns the largest |ℓθ − ℓb| over the
    policy's tokens, e_B, the largest |∂loss/∂logits| over the rows that score an environment
    token (and how many rows), and the smallest over the rows that score a policy token."""
    import json

    from megatron_p3o.model import forward
    from megatron_p3o.update import policy_update

    vocab = json.loads((Path(ckpt) / "hf" / "config.json").read_text())["vocab_size"]
    desc = replace(desc_of("llama"), vocab_size=vocab)  # as tool_model built it
    chunks = build_model(desc, groups, BuildOptions(seq_length=SEQ))
    load_model_state(chunks, ckpt)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    dp, r = groups.layout.dp, groups.dp_rank
    mine = samples[r * len(samples) // dp : (r + 1) * len(samples) // dp]
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(len(samples), generator=g)[r * len(samples) // dp :][: len(mine)]
    cfg = BatchConfig(max_tokens_per_gpu=budget)
    (mbs,), _ = MicroBatcher(cfg, groups, SEQ, 0).build(mine, adv)
    step = PolicyUpdate(build_objective("p3o"), groups, desc.vocab_size, LossConfig())
    seen, grads = [], []
    real_lp, real_call = policy_update.response_logprobs, forward._call_loss

    def lp_spy(batch, logits, *a, **k):
        out = real_lp(batch, logits, *a, **k)
        resp = batch["response"]
        seen.append((out[0].detach().clone(), resp["behavior_logprobs"], resp["mask"]))
        return out

    def call_spy(loss_fn, batch, out, *a, **k):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            idx = batch["response"]["index"]
            mask = batch["response"]["mask"]
            length = batch["response"]["mask"].new_tensor(
                [len(mine[i].completion_ids) for i in batch["response"]["sample_index"]]
            )
            real = torch.arange(idx.shape[1])[None, :] < length[:, None]

            def keep(grad, idx=idx, mask=mask, real=real):
                rows = grad.reshape(-1, grad.shape[-1])
                env = rows[idx[(mask == 0) & real]].abs().amax(-1)
                pol = rows[idx[(mask > 0) & real]].abs().amax(-1)
                grads.append((env, pol))

            out.register_hook(keep)
        return real_call(loss_fn, batch, out, *a, **k)

    zero_grads(ddp)
    with (
        mock.patch.object(policy_update, "response_logprobs", lp_spy),
        mock.patch.object(forward, "_call_loss", call_spy),
    ):
        metrics = step.run(ddp, mbs)
    diffs = [float(((lp - lb.to(lp)).abs() * (m > 0)).max()) for lp, lb, m in seen if (m > 0).any()]
    env = torch.cat([e for e, _ in grads]) if grads else torch.zeros(0)
    pol = torch.cat([p for _, p in grads]) if grads else torch.zeros(0)
    return {
        "max_lp_diff": max(diffs) if diffs else None,
        "ess": metrics.get("ess"),
        "env_rows": int(env.numel()),
        "env_grad_max": float(env.max()) if env.numel() else None,
        "policy_grad_min": float(pol.min()) if pol.numel() else None,
        "policy_rows": int(pol.numel()),
    }
