"""What a training run prints on rank 0: one line per step and the final accuracy table."""

from __future__ import annotations

from typing import Dict, Optional

from megatron_p3o.observability.turn_metrics import turn_line


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def step_line(m: Dict, total: Optional[int] = None, eta_s: Optional[float] = None) -> str:
    """Reward, e_B, mismatch, loss and times of one trainer step (``Trainer.step``'s record),
    as ``step N/total`` with the time left (``eta_s``) when given."""
    nan, skip = float("nan"), m.get("skipped_steps", 0)
    if m.get("r2po_head_phase"):  # R2PO's head phase: the head's loss, ℓμ against the engine's
        m = {**m, **{k.removeprefix("head/"): v for k, v in m.items() if k.startswith("head/")}}
    of = f"/{total}" if total else ""
    eta = f"  ETA {_clock(eta_s)}" if eta_s is not None else ""
    return (
        f"step {m['step']:4d}{of}  reward {m['reward_mean']:.3f}  ess {m.get('ess', nan):.3f}  "
        f"|ℓθ−ℓb| {m.get('abs_logprob_diff', nan):.4f}  loss {m.get('loss', nan):+.4f}  "
        f"rollout {m['rollout_s']:.1f}s train {m['train_s']:.1f}s{eta}"
        + turn_line(m)
        + (f"  [red]{skip:.0f} optimizer step(s) skipped: non-finite gradients" if skip else "")
        + ("  (R2PO head phase)" if m.get("r2po_head_phase") else "")
    )


def accuracy_table(cfg, acc: Dict[int, float]):
    """A rich table of held-out greedy accuracy by step."""
    from rich.table import Table

    t = Table(
        title=f"{cfg.run.name}: held-out greedy accuracy ({cfg.rollout.precision} rollouts, "
        f"{cfg.model.params_dtype} trainer, {cfg.loss.objective})"
    )
    t.add_column("step")
    t.add_column("accuracy")
    for k, v in acc.items():
        t.add_row(str(k), f"{v:.3f}")
    return t


def eval_line(step: int, metrics: dict) -> str:
    """One line per evaluation: every set's pass@k / greedy accuracy."""
    parts = [f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items() if "prompts" not in k]
    return f"eval @ step {step}: " + ", ".join(parts)
