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
    from megatron_p3o.config.loading import load_config

    cfg = load_config(a.recipe, a.set).with_task_files()
    if a.dry_run:  # world: --world-size, else the recipe's, else torchrun's, else one process
        from megatron_p3o.config.plan import dry_run

        world = a.world_size or cfg.parallel.world_size or int(os.environ.get("WORLD_SIZE", "1"))
        return dry_run(a.recipe, cfg, world, a.gpu_gib, a.gpus_per_node, a.nodes)
    import torch
    from rich.console import Console

    from megatron_p3o.loop import finished, start_groups, train_loop
    from megatron_p3o.trainer import Trainer

    if finished(cfg):
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
        return train_loop(cfg, trainer, con, stop)
    finally:  # no SGLang server or rollout thread outlives the run, whatever happened
        if stop is not None:
            stop.close()
        trainer.close()


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "megatron_p3o.train")
