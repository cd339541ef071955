"""Entry point: ``torchrun ... -m megatron_p3o.train RECIPE.yaml [--set key.sub=value ...]``.

Also runs as a single process. Loads and validates the recipe, builds the Trainer, reports
held-out accuracy before and after, and saves the final model checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import warnings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dry-run", action="store_true",
                    help="check layout and batch arithmetic, print a memory estimate per GPU, exit")
    ap.add_argument("--world-size", type=int, default=None,
                    help="with --dry-run: GPUs to plan for (default: parallel.world_size)")
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="with --dry-run: memory of one GPU")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if a.dry_run:
        return dry_run(a)
    import torch.distributed as dist
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from megatron_p3o.config import load_config
    from megatron_p3o.parallel import Layout, init_distributed, initialize
    from megatron_p3o.checkpoint import latest_checkpoint
    from megatron_p3o.trainer import Trainer

    cfg = load_config(a.recipe, a.set)
    init_distributed()
    cfg.validate(dist.get_world_size())
    p = cfg.parallel
    groups = initialize(Layout(p.tp, p.pp, p.cp, None, p.vpp, p.sequence_parallel), seed=cfg.run.seed)
    con = Console(quiet=groups.rank != 0)
    r = cfg.rollout
    if r.logprob_noise or r.engine_temperature is not None:
        con.print(f"[yellow]stress injection on: logprob_noise={r.logprob_noise}, engine_temperature="
                  f"{r.engine_temperature} (trainer T={r.sampling.temperature}): ℓb is deliberately wrong")
    trainer = Trainer(cfg, groups)
    acc = {}
    if trainer.resumed_from is not None:
        con.print(f"resumed from {trainer.resumed_from} (step {trainer.step_idx})")
    if cfg.data.eval_path:
        acc[trainer.step_idx] = trainer.evaluate(cfg.data.eval_path)
        con.print(f"held-out accuracy before training: {acc[trainer.step_idx]:.3f}")
    with Progress(console=con, disable=groups.rank != 0) as bar:
        task = bar.add_task(f"{cfg.loss.objective} training", total=cfg.steps, completed=trainer.step_idx)
        for _ in range(max(cfg.steps - trainer.step_idx, 0)):
            m = trainer.step()
            bar.advance(task)
            con.print(f"step {m['step']:4d}  reward {m['reward_mean']:.3f}  ess {m.get('ess', float('nan')):.3f}  "
                      f"|ℓθ−ℓb| {m.get('abs_logprob_diff', float('nan')):.4f}  loss {m.get('loss', float('nan')):+.4f}  "
                      f"rollout {m['rollout_s']:.1f}s train {m['train_s']:.1f}s")
            if cfg.data.eval_path and cfg.data.eval_every and m["step"] % cfg.data.eval_every == 0:
                acc[m["step"]] = trainer.evaluate(cfg.data.eval_path)
                con.print(f"held-out accuracy at step {m['step']}: {acc[m['step']]:.3f}")
    if cfg.data.eval_path:
        acc[trainer.step_idx] = trainer.evaluate(cfg.data.eval_path)
    ckpt = latest_checkpoint(trainer.run_dir)
    if ckpt is None or ckpt.name != f"step_{trainer.step_idx:06d}":
        ckpt = trainer.save_checkpoint()
    trainer.close()
    t = Table(title=f"{cfg.run.name}: held-out greedy accuracy ({cfg.rollout.precision} rollouts, "
                    f"{cfg.model.params_dtype} trainer, {cfg.loss.objective})")
    t.add_column("step")
    t.add_column("accuracy")
    for k, v in acc.items():
        t.add_row(str(k), f"{v:.3f}")
    con.print(t)
    if len(acc) >= 2:
        first, last = acc[min(acc)], acc[max(acc)]
        con.print(f"change: {100 * (last - first):+.1f} points; checkpoint: {ckpt}")
    return 0


def dry_run(a) -> int:
    from megatron_p3o.config import ConfigError, load_config
    from megatron_p3o.plan import describe_model, format_plan, make_plan

    try:
        cfg = load_config(a.recipe, a.set)
        world = a.world_size or cfg.parallel.world_size
        if world is None:
            raise ConfigError("--dry-run needs --world-size or parallel.world_size in the recipe")
        desc, div = describe_model(cfg)
        plan = make_plan(cfg, world, desc, div)
    except ConfigError as e:
        print(f"{a.recipe}: {e}", file=sys.stderr)
        return 2
    print(f"{a.recipe}: OK")
    print("\n".join(format_plan(cfg, plan, desc, a.gpu_gib)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
