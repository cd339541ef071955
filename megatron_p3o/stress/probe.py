"""Exogenous mismatch: a setting's train–rollout mismatch on a fixed probe set at the base
weights, measured before any training step — the x-axis of a stress study, and what
``python -m megatron_p3o.probe`` reports for any engine.

Why: the mismatch the loss sees during a run is partly an outcome (each objective's own drift,
its reuse and staleness). A setting's *exogenous* mismatch is what its rollout engine does to
the same policy: the first ``n`` held-out prompts, one completion each from the setting's engine
(its precision, logit noise, engine temperature; SGLang's server when it is the engine), scored
by the trainer at the same (base) weights:

    per token      mean |ℓθ − ℓb|                      (``probe_abs_dlogp``)
    per sequence   mean |Σ_t (ℓθ − ℓb)|                (``probe_abs_seq_dlogp``)
    KL(πb‖πθ)      mean over tokens of ρ − 1 − log ρ    (``probe_kl_b_theta``, ρ = πθ/πb, ≥ 0)

:func:`probe_mismatch` returns these three (what the stress tool records per cell, bitwise as
before); :func:`probe_detail` also keeps every token's ℓθ and ℓb (float64, gathered from every
rank) and :func:`mismatch_stats` turns them into the probe CLI's fuller statistics: p50/p99 per
token and per sequence, |Δℓ| by completion position, the ESS e_B and the ρ histogram.

Corrupted reported ℓb (``rollout.logprob_noise``) is reporting noise, not a shift of the
sampling distribution: the probe does not add it (it measures the engine), and such cells form
their own family in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_p3o.runtime.collectives import (
    all_gather_objects,
    all_sum,
    broadcast,
    broadcast_objects,
)
from megatron_p3o.runtime.errors import DataError

# one sequence's valid tokens: (global prompt index, ℓθ, ℓb)
_Row = Tuple[int, List[float], List[float]]


@dataclass
class ProbeTokens:
    """Every valid token of the probe, in prompt order (identical on every rank)."""

    logp_theta: List[float]  # the trainer's ℓθ
    logp_behavior: List[float]  # the engine's reported ℓb
    position: List[int]  # index of the token in its completion (0 = first)
    sequence: List[int]  # index of its sequence (0 .. n_seq − 1, prompt order)
    prompts: int  # prompts sampled (one completion each)
    path: str  # the prompt file


def probe_mismatch(trainer, n_prompts: int = 64) -> Dict[str, float]:
    """The three probe statistics of ``trainer``'s rollout setting at its current weights
    (call before the first step); identical on every rank."""
    sums, _, _ = _probe(trainer, n_prompts)
    return _summary(sums)


def probe_detail(
    trainer,
    n_prompts: int = 64,
    path: Optional[str] = None,
    on_phase: Optional[Callable[[str], None]] = None,
) -> Tuple[Dict[str, float], ProbeTokens]:
    """:func:`probe_mismatch`'s statistics and every token behind them (``path``: the prompt
    file, default ``data.eval_path`` then ``data.path``); ``on_phase("sample" | "score" |
    "gather")`` is called as each phase starts (progress)."""
    d = trainer.cfg.data
    path = path or d.eval_path or d.path
    sums, rows, n = _probe(trainer, n_prompts, path, keep=True, on_phase=on_phase)
    rows.sort(key=lambda r: r[0])
    lt: List[float] = []
    lb: List[float] = []
    pos: List[int] = []
    seq: List[int] = []
    for i, (_, a, b) in enumerate(rows):
        lt += a
        lb += b
        pos += range(len(a))
        seq += [i] * len(a)
    return _summary(sums), ProbeTokens(lt, lb, pos, seq, n, path)


def _summary(sums: torch.Tensor) -> Dict[str, float]:
    tok, seq, kl, n_tok, n_seq = sums.tolist()
    return {
        "probe_abs_dlogp": tok / max(n_tok, 1.0),
        "probe_abs_seq_dlogp": seq / max(n_seq, 1.0),
        "probe_kl_b_theta": kl / max(n_tok, 1.0),
        "probe_tokens": n_tok,
    }


def _probe(trainer, n_prompts, path=None, keep=False, on_phase=None):
    """``(sums, rows, prompts)``: the float64 sums ``[Σ|Δℓ|, Σ|ΣΔℓ|, Σ(ρ−1−Δℓ), tokens,
    sequences]`` over every rank and, with ``keep``, every sequence's ``(prompt index, ℓθ, ℓb)``
    gathered to every rank (unordered)."""
    from megatron_p3o.data.prompts import all_rows
    from megatron_p3o.logprob.scoring import score_responses

    cfg, g = trainer.cfg, trainer.groups
    d = cfg.data
    path = path or d.eval_path
    phase = on_phase or (lambda name: None)
    rows = all_rows(path, trainer.tok, d.prompt_key, d.answer_key, chat=d.chat_template)
    dp = g.layout.dp or 1
    n = min(n_prompts, len(rows)) // dp * dp
    if n == 0:
        raise DataError(f"probe: {path} has {len(rows)} prompts, fewer than {dp} (one per DP rank)")
    idx = list(range(n))[g.dp_rank :: dp]
    mine = [rows[i][0] for i in idx]
    items = None
    if getattr(trainer, "turns", None) is not None:  # multi-turn: trajectories through the loop
        from megatron_p3o.env.types import eval_items

        items = eval_items(path, d.prompt_key, rows, idx)
    sampling = trainer.sampling
    if cfg.rollout.engine_temperature is not None:  # the engine samples at its own temperature
        sampling = replace(sampling, temperature=cfg.rollout.engine_temperature)
    phase("sample")
    # the environment's tokens are masked: only the policy's are scored
    samples = trainer.rollout.evaluate(mine, sampling, trainer.step_idx, None, items)
    per_step, _ = trainer.batcher.build(samples, [0.0] * len(samples))
    phase("score")
    sums = torch.zeros(5, dtype=torch.float64, device=g.device)
    kept: List[_Row] = []
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
            if keep:
                kept += _rows(r, g.dp_rank, dp)
    if g.layout.dp_enabled:
        all_sum(sums, g.dp, "each DP rank scored a disjoint share of the probe prompts")
    if g.layout.pp_enabled:
        broadcast(sums, g.last_stage_global_rank(), g.pp,
                  "only the last stage scored; every stage reports the same numbers")  # fmt: skip
    if keep:
        phase("gather")
        kept = _gather_rows(kept, g)
    return sums, kept, n


def _rows(r: dict, dp_rank: int, dp: int) -> List[_Row]:
    """Each scored sequence of one micro-batch's response as ``(prompt index, ℓθ, ℓb)``: the
    batcher's ``sample_index`` is the sample's place in this rank's share (prompt
    ``dp_rank + dp · index``); without one, the order of arrival."""
    m = r["mask"] > 0
    lt, lb = r["probe_logprobs"].double().cpu(), r["behavior_logprobs"].double().cpu()
    ids = r.get("sample_index")
    out = []
    for i in range(m.shape[0]):
        row = m[i].cpu()
        if not bool(row.any()):
            continue
        k = int(ids[i]) if ids is not None and len(ids) == m.shape[0] else i
        out.append((dp_rank + dp * k, lt[i][row].tolist(), lb[i][row].tolist()))
    return out


def _gather_rows(rows: List[_Row], g) -> List[_Row]:
    """Every DP rank's rows on every rank (objects: a few floats per token)."""
    if g.layout.dp_enabled and g.is_last_stage():
        parts = all_gather_objects(rows, g.dp, "each DP rank scored a disjoint share of the "
                                   "prompts; all of them, on each")  # fmt: skip
        rows = [x for p in parts for x in (p or [])]
    if g.layout.pp_enabled:
        box = [rows]
        broadcast_objects(box, g.last_stage_global_rank(), g.pp,
                          "only the last stage scored; every stage gets its rows")  # fmt: skip
        rows = box[0]
    return list(rows)


def _quantiles(x, qs=(50, 99)) -> List[float]:
    import numpy as np

    return [float(v) for v in np.percentile(x, qs)] if len(x) else [float("nan")] * len(qs)


def mismatch_stats(t: ProbeTokens, bins: int = 40) -> dict:
    """The probe CLI's statistics of ``t``, all in float64: per-token |Δℓ| (mean, p50, p99,
    max), the same by completion position, per-sequence |ΣΔℓ|, KL(πb‖πθ), the normalized ESS
    ``e_B = (Σρ)² / (N Σρ²)`` over every token (as the P3O loss takes it) and the histogram of
    ρ = πθ/πb in ``bins`` equal bins of log ρ, symmetric about 0 (counts sum to the tokens)."""
    import numpy as np

    dl = np.asarray(t.logp_theta, dtype=np.float64) - np.asarray(t.logp_behavior, np.float64)
    a = np.abs(dl)
    pos = np.asarray(t.position, dtype=np.int64)
    seq = np.asarray(t.sequence, dtype=np.int64)
    n_tok = int(dl.size)
    n_seq = int(seq.max()) + 1 if n_tok else 0
    seq_sum = np.abs(np.bincount(seq, weights=dl, minlength=n_seq)) if n_tok else np.zeros(0)
    rho = np.exp(dl)
    p50, p99 = _quantiles(a)
    s50, s99 = _quantiles(seq_sum)
    by_pos = []
    for p in range(int(pos.max()) + 1 if n_tok else 0):
        ap = a[pos == p]
        q50, q99 = _quantiles(ap)
        by_pos.append({"position": p, "tokens": int(ap.size), "mean": float(ap.mean()),
                       "p50": q50, "p99": q99})  # fmt: skip
    half = max(float(a.max()) if n_tok else 0.0, 1e-12)
    counts, edges = np.histogram(dl, bins=bins, range=(-half, half))
    return {
        "tokens": n_tok,
        "sequences": n_seq,
        "per_token": {
            "mean_abs_dlogp": float(a.mean()) if n_tok else float("nan"),
            "p50_abs_dlogp": p50,
            "p99_abs_dlogp": p99,
            "max_abs_dlogp": float(a.max()) if n_tok else float("nan"),
        },
        "by_position": by_pos,
        "per_sequence": {
            "mean_abs_sum_dlogp": float(seq_sum.mean()) if n_seq else float("nan"),
            "p50_abs_sum_dlogp": s50,
            "p99_abs_sum_dlogp": s99,
        },
        "kl_b_theta": float(np.mean(rho - 1.0 - dl)) if n_tok else float("nan"),
        "ess": float(rho.sum() ** 2 / (n_tok * np.sum(rho * rho))) if n_tok else float("nan"),
        "rho_histogram": {
            "log_rho_edges": [float(x) for x in edges],
            "rho_edges": [float(x) for x in np.exp(edges)],
            "counts": [int(c) for c in counts],
            "rho_min": float(rho.min()) if n_tok else float("nan"),
            "rho_max": float(rho.max()) if n_tok else float("nan"),
        },
    }
