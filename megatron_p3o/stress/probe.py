"""Exogenous mismatch: a setting's train–rollout mismatch on a fixed probe set at the base
weights, measured before any training step — the x-axis of a stress study.

Why: the mismatch the loss sees during a run is partly an outcome (each objective's own drift,
its reuse and staleness). A setting's *exogenous* mismatch is what its rollout engine does to
the same policy: the first ``n`` held-out prompts, one completion each from the setting's engine
(its precision, logit noise, engine temperature; SGLang's server when it is the engine), scored
by the trainer at the same (base) weights:

    per token      mean |ℓθ − ℓb|                      (``probe_abs_dlogp``)
    per sequence   mean |Σ_t (ℓθ − ℓb)|                (``probe_abs_seq_dlogp``)
    KL(πb‖πθ)      mean over tokens of ρ − 1 − log ρ    (``probe_kl_b_theta``, ρ = πθ/πb, ≥ 0)

Corrupted reported ℓb (``rollout.logprob_noise``) is reporting noise, not a shift of the
sampling distribution: the probe does not add it (it measures the engine), and such cells form
their own family in the report.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict

import torch
import torch.distributed as dist


def probe_mismatch(trainer, n_prompts: int = 64) -> Dict[str, float]:
    """The three probe statistics of ``trainer``'s rollout setting at its current weights
    (call before the first step); identical on every rank."""
    from ..policy_update import score_responses
    from ..rollout.prompts import all_rows

    cfg, g = trainer.cfg, trainer.groups
    d = cfg.data
    rows = all_rows(d.eval_path, trainer.tok, d.prompt_key, d.answer_key)
    dp = g.layout.dp or 1
    n = min(n_prompts, len(rows)) // dp * dp
    if n == 0:
        raise ValueError(f"probe: {d.eval_path} has fewer than {dp} prompts")
    mine = [r[0] for r in rows[:n]][g.dp_rank :: dp]
    sampling = trainer.sampling
    if cfg.rollout.engine_temperature is not None:  # the engine samples at its own temperature
        sampling = replace(sampling, temperature=cfg.rollout.engine_temperature)
    samples = trainer.rollout.evaluate(mine, sampling, trainer.step_idx)
    per_step, _ = trainer.batcher.build(samples, [0.0] * len(samples))
    sums = torch.zeros(5, dtype=torch.float64, device=g.device)
    for mbs in per_step:
        score_responses(
            trainer.ddp, g, mbs, "probe_logprobs", trainer.update.temperature,
            trainer.update.vocab_size, cfg.loss.logprob_chunk,
        )  # fmt: skip
        if not g.is_last_stage():
            continue
        for mb in mbs:
            r = mb["response"]
            m = r["mask"].double()
            diff = r["probe_logprobs"].double() - r["behavior_logprobs"].double()
            dl = torch.where(m > 0, diff, torch.zeros_like(m))
            has = m.sum(-1) > 0
            part = torch.stack(
                [
                    dl.abs().sum(),
                    dl.sum(-1).abs()[has].sum(),
                    ((torch.exp(dl) - 1.0 - dl) * m).sum(),
                    m.sum(),
                    has.double().sum(),
                ]
            )
            sums += part.to(sums.device)
    if g.layout.dp_enabled:
        # DP group: each DP rank scored a disjoint share of the probe prompts.
        dist.all_reduce(sums, group=g.dp)
    if g.layout.pp_enabled:
        # PP group: only the last stage scored; every stage reports the same numbers.
        dist.broadcast(sums, src=g.last_stage_global_rank(), group=g.pp)
    tok, seq, kl, n_tok, n_seq = sums.tolist()
    return {
        "probe_abs_dlogp": tok / max(n_tok, 1.0),
        "probe_abs_seq_dlogp": seq / max(n_seq, 1.0),
        "probe_kl_b_theta": kl / max(n_tok, 1.0),
        "probe_tokens": n_tok,
    }
