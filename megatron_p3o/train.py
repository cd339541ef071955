"""Entry point: ``torchrun ... -m megatron_p3o.train RECIPE.yaml [--set key.sub=value ...]``.

Also runs as a single process. Loads and validates the recipe, builds the Trainer, reports
held-out accuracy before and after, and saves the final model checkpoint.
"""

from __future__ import annotations

import argparse
import os

# Before torch loads MKL: by default MKL picks each product's thread count from the machine's
# load (MKL_DYNAMIC), so two runs of one command could round matrix products differently
# (measured: 32 prompts × 8 samples on 2 threads, step-1 loss differed between runs); a fixed
# thread count keeps the same command bitwise reproducible. An explicit setting wins.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dry-run", action="store_true", help="check layout, batch, memory; exit")
    ap.add_argument("--world-size", type=int, help="with --dry-run: GPUs to plan for")
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="with --dry-run: GPU memory")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="with --dry-run: for placement")
    ap.add_argument("--nodes", type=int, help="with --dry-run: nodes the job gets (sbatch --nodes)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    a = ap.parse_args(argv)
    from megatron_p3o.config.train_config import load_config

    cfg = load_config(a.recipe, a.set)
    if a.dry_run:  # world: --world-size, else the recipe's, else torchrun's, else one process
        from megatron_p3o.config.plan import dry_run

        world = a.world_size or cfg.parallel.world_size or int(os.environ.get("WORLD_SIZE", "1"))
        return dry_run(a.recipe, cfg, world, a.gpu_gib, a.gpus_per_node, a.nodes)
    import torch
    from rich.console import Console

    from megatron_p3o.trainer import Trainer

    if _finished(cfg):
        return 0
    groups = start_groups(cfg)
    con = Console(quiet=groups.rank != 0, soft_wrap=True)  # paths are printed whole, never wrapped
    con.print(f"layout {groups.layout}; {cfg.batch_arithmetic(groups.layout.dp)}")
    r = cfg.rollout
    if (
        r.logprob_noise
        or r.logit_noise
        or r.weight_rounding_step
        or r.engine_temperature is not None
    ):
        con.print(f"[yellow]stress injection on: {r.logprob_noise=} {r.logit_noise=} "
                  f"{r.weight_rounding_step=} {r.engine_temperature=} "
                  f"(trainer T={r.sampling.temperature})")  # fmt: skip
    if r.deterministic:  # the zero-mismatch control (GPU-unverified; README)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    trainer = Trainer(cfg, groups)
    stop = None
    try:
        from megatron_p3o.runtime.parallel import new_object_group
        from megatron_p3o.runtime.preemption import GracefulStop

        stop = GracefulStop(cfg.run.exit_signals, cfg.run.exit_after_minutes, trainer.run_dir,
                            new_object_group(), groups.rank == 0)  # fmt: skip
        return _train(cfg, trainer, con, stop)
    finally:  # no SGLang server or rollout thread outlives the run, whatever happened
        if stop is not None:
            stop.close()
        trainer.close()


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


def _finished(cfg) -> bool:
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


def _train(cfg, trainer, con, stop) -> int:
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


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "megatron_p3o.train")
