"""The run around the trainer: its process groups (after the checks that need the world
size), whether it already finished, and the step loop — held-out evaluation, progress lines,
graceful stops (:mod:`megatron_p3o.runtime.preemption`) and the final checkpoint. Used by
``python -m megatron_p3o.train`` (and ``start_groups`` by ``megatron_p3o.probe``)."""

from __future__ import annotations

import os


def start_groups(cfg):
    """The process groups of a run (torchrun's world, else one process), after the checks that
    need the world size; shared by the trainer and ``megatron_p3o.probe``."""
    import torch.distributed as dist

    from megatron_p3o.runtime.parallel import init_distributed, initialize

    if cfg.parallel.tp > 1:  # Megatron's TP comm/compute overlap needs one CUDA queue
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    init_distributed()
    cfg.validate(dist.get_world_size()).check_rollout_gpus(dist.get_world_size())
    return initialize(cfg.parallel.layout(), seed=cfg.run.seed)


def finished(cfg) -> bool:
    """A finished run says so and builds nothing (no model, no servers, no new eval rows)."""
    from pathlib import Path

    from megatron_p3o.checkpoint.state import finished_checkpoint

    run = Path(cfg.run.dir) / cfg.run.name
    done = finished_checkpoint(run, cfg.steps, bool(cfg.data.eval_path))
    if done is not None and os.environ.get("RANK", "0") == "0":
        print(f"{run} finished: {done.name} is checkpointed at steps={cfg.steps} ({done}); "
              "nothing to do (--set steps=N to train on)")  # fmt: skip
    return done is not None


def _stopped(trainer, con, reason: str) -> int:
    """A graceful stop (megatron_p3o.runtime.preemption): a checkpoint of this step, then exit
    75."""
    from megatron_p3o.checkpoint.state import latest_checkpoint
    from megatron_p3o.runtime.preemption import EXIT_PREEMPTED

    ckpt = latest_checkpoint(trainer.run_dir)
    if trainer.step_idx and (ckpt is None or ckpt.name != f"step_{trainer.step_idx:06d}"):
        ckpt = trainer.save_checkpoint()
    con.print(f"stopped after step {trainer.step_idx} ({reason}); checkpoint: {ckpt}; "
              f"the same command resumes (exit status {EXIT_PREEMPTED})")  # fmt: skip
    return EXIT_PREEMPTED


def train_loop(cfg, trainer, con, stop) -> int:
    from megatron_p3o.runtime.preemption import RolloutInterrupted

    try:
        return _steps(cfg, trainer, con, stop)
    except RolloutInterrupted:  # a stop signal inside a multi-turn rollout (every rank)
        return _stopped(trainer, con, stop.signal or "signal")


def _steps(cfg, trainer, con, stop) -> int:
    import time

    from rich.progress import Progress

    from megatron_p3o.checkpoint.state import latest_checkpoint
    from megatron_p3o.evaluation.heldout import sets_due
    from megatron_p3o.observability.console import accuracy_table, eval_line, step_line

    reason = stop.agreed()
    if reason is not None:  # e.g. the batch script's STOP file: torchrun restarted us after it
        return _stopped(trainer, con, reason)
    acc, d = {}, cfg.data
    if trainer.resumed_from is not None:
        con.print(f"resumed from {trainer.resumed_from} (step {trainer.step_idx})")
    if d.eval_path:
        acc[trainer.step_idx] = trainer.evaluate(d.eval_path)
        con.print(f"held-out accuracy before training: {acc[trainer.step_idx]:.3f}")
    start, first = time.monotonic(), trainer.step_idx
    with Progress(console=con, disable=con.quiet) as bar:
        task = bar.add_task(f"{cfg.loss.objective}", total=cfg.steps, completed=trainer.step_idx)
        for _ in range(max(cfg.steps - trainer.step_idx, 0)):
            m = trainer.step()
            bar.advance(task)
            per_step = (time.monotonic() - start) / (m["step"] - first)
            con.print(step_line(m, cfg.steps, per_step * (cfg.steps - m["step"])))
            if d.eval_path and d.eval_every and m["step"] % d.eval_every == 0:
                acc[m["step"]] = trainer.evaluate(d.eval_path)
                con.print(f"held-out accuracy at step {m['step']}: {acc[m['step']]:.3f}")
            if sets_due(cfg.eval, m["step"], m["step"] == cfg.steps):
                con.print(eval_line(m["step"], trainer.evaluate_sets()))
            reason = stop.agreed()
            if reason is not None and m["step"] < cfg.steps:
                return _stopped(trainer, con, reason)
    if d.eval_path and trainer.step_idx not in acc:  # not twice when eval_every divides steps
        acc[trainer.step_idx] = trainer.evaluate(d.eval_path)
    ckpt = latest_checkpoint(trainer.run_dir)
    if ckpt is None or ckpt.name != f"step_{trainer.step_idx:06d}":
        ckpt = trainer.save_checkpoint()
    con.print(accuracy_table(cfg, acc))
    change = f"change: {100 * (acc[max(acc)] - acc[min(acc)]):+.1f} points; " if acc else ""
    con.print(f"{change}checkpoint: {ckpt}")
    return 0
