"""Entry point: ``torchrun ... -m megatron_p3o.train RECIPE.yaml [--set key.sub=value ...]``.

Also runs as a single process. Loads and validates the recipe, builds the Trainer, reports
held-out accuracy before and after, and saves the final model checkpoint.
"""

from __future__ import annotations

import argparse
import os


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="check layout and batch arithmetic, print a memory estimate per GPU, exit",
    )
    ap.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="with --dry-run: GPUs to plan for (default: parallel.world_size)",
    )
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="with --dry-run: memory of one GPU")
    ap.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    a = ap.parse_args(argv)
    if a.dry_run:
        return dry_run(a)
    import torch.distributed as dist
    from rich.console import Console

    from megatron_p3o.config import load_config
    from megatron_p3o.parallel import Layout, init_distributed, initialize
    from megatron_p3o.trainer import Trainer

    cfg = load_config(a.recipe, a.set)
    init_distributed()
    cfg.validate(dist.get_world_size())
    p = cfg.parallel
    groups = initialize(
        Layout(p.tp, p.pp, p.cp, None, p.vpp, p.sequence_parallel), seed=cfg.run.seed
    )
    con = Console(quiet=groups.rank != 0, soft_wrap=True)  # paths are printed whole, never wrapped
    r = cfg.rollout
    if r.logprob_noise or r.engine_temperature is not None:
        con.print(
            f"[yellow]stress injection on: logprob_noise={r.logprob_noise}, engine_temperature="
            f"{r.engine_temperature} (trainer T={r.sampling.temperature}): ℓb is deliberately wrong"
        )
    trainer = Trainer(cfg, groups)
    try:
        return _train(cfg, trainer, con, groups.rank)
    finally:  # no SGLang server or rollout thread outlives the run, whatever happened
        trainer.close()


def _train(cfg, trainer, con, rank: int) -> int:
    from rich.progress import Progress
    from rich.table import Table

    from megatron_p3o.checkpoint import latest_checkpoint

    acc = {}
    if trainer.resumed_from is not None:
        con.print(f"resumed from {trainer.resumed_from} (step {trainer.step_idx})")
    if cfg.data.eval_path:
        acc[trainer.step_idx] = trainer.evaluate(cfg.data.eval_path)
        con.print(f"held-out accuracy before training: {acc[trainer.step_idx]:.3f}")
    with Progress(console=con, disable=rank != 0) as bar:
        task = bar.add_task(
            f"{cfg.loss.objective} training", total=cfg.steps, completed=trainer.step_idx
        )
        for _ in range(max(cfg.steps - trainer.step_idx, 0)):
            m = trainer.step()
            bar.advance(task)
            con.print(_step_line(m))
            if cfg.data.eval_path and cfg.data.eval_every and m["step"] % cfg.data.eval_every == 0:
                acc[m["step"]] = trainer.evaluate(cfg.data.eval_path)
                con.print(f"held-out accuracy at step {m['step']}: {acc[m['step']]:.3f}")
    if cfg.data.eval_path:
        acc[trainer.step_idx] = trainer.evaluate(cfg.data.eval_path)
    ckpt = latest_checkpoint(trainer.run_dir)
    if ckpt is None or ckpt.name != f"step_{trainer.step_idx:06d}":
        ckpt = trainer.save_checkpoint()
    t = Table(
        title=f"{cfg.run.name}: held-out greedy accuracy ({cfg.rollout.precision} rollouts, "
        f"{cfg.model.params_dtype} trainer, {cfg.loss.objective})"
    )
    t.add_column("step")
    t.add_column("accuracy")
    for k, v in acc.items():
        t.add_row(str(k), f"{v:.3f}")
    con.print(t)
    if len(acc) >= 2:
        first, last = acc[min(acc)], acc[max(acc)]
        con.print(f"change: {100 * (last - first):+.1f} points; checkpoint: {ckpt}")
    return 0


def _step_line(m: dict) -> str:
    nan = float("nan")
    return (
        f"step {m['step']:4d}  reward {m['reward_mean']:.3f}  ess {m.get('ess', nan):.3f}  "
        f"|ℓθ−ℓb| {m.get('abs_logprob_diff', nan):.4f}  loss {m.get('loss', nan):+.4f}  "
        f"rollout {m['rollout_s']:.1f}s train {m['train_s']:.1f}s"
    )


def dry_run(a) -> int:
    from megatron_p3o.config import load_config
    from megatron_p3o.plan import describe_model, format_plan, make_plan

    cfg = load_config(a.recipe, a.set)
    # --world-size, else the recipe's, else torchrun's, else one process
    world = a.world_size or cfg.parallel.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    desc, div = describe_model(cfg)
    plan = make_plan(cfg, world, desc, div)
    print(f"{a.recipe}: OK (world size {world})")
    print("\n".join(format_plan(cfg, plan, desc, a.gpu_gib)))
    return 0


if __name__ == "__main__":
    from megatron_p3o.errors import run_cli

    run_cli(main, "megatron_p3o.train")
