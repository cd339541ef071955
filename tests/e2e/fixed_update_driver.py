"""One optimizer step of the trainer on fixed inputs (run as a subprocess by
``test_fixed_update.py``): the shipped tiny model (``data/fixed_update/hf``, converted with
``checkpoints_convert.hf_to_megatron``) and the shipped rollout batch (``batch.json``: token ids,
the engine's ℓb, rewards), fed to ``Trainer.step`` in place of a rollout.

    python fixed_update_driver.py CKPT OUT.json OBJECTIVE [--record-batch BATCH.json | KEY=VALUE...]

With ``--record-batch`` the batch is first sampled by the recipe's embedded engine and written
(how ``batch.json`` was made, once). Prints nothing; writes the step's loss, e_B, grad norm and
the new parameters' checksums to OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests/e2e/data/fixed_update"


def _count_fused_calls() -> list:
    """Count the trainer's calls of the fused log-prob kernel (model.fused_logprob), so the test
    can tell the fused and the unfused step apart."""
    from megatron_p3o.logprob import scoring

    calls, kernel = [0], scoring.fused_vocab_parallel_logprobs

    def counted(*args, **kwargs):
        calls[0] += 1
        return kernel(*args, **kwargs)

    scoring.fused_vocab_parallel_logprobs = counted
    return calls


def main(argv) -> None:
    import torch.distributed as dist

    from megatron_p3o.config.loading import load_config
    from megatron_p3o.rollout.scheduler import RolloutResult
    from megatron_p3o.runtime.parallel import init_distributed, initialize
    from megatron_p3o.trainer import Trainer
    from megatron_p3o.types import Group

    ckpt, out, objective = Path(argv[0]), Path(argv[1]), argv[2]
    record = Path(argv[4]) if len(argv) > 4 and argv[3] == "--record-batch" else None
    extra = [] if record is not None else list(argv[3:])  # config overrides (--set syntax)
    sets = [f"model.checkpoint={ckpt}", f"data.path={DATA / 'train.jsonl'}", "data.eval_path=''",
            "steps=1", f"run.dir={out.parent / 'runs'}", f"run.name={objective}",
            "checkpoint.every=0", f"loss.objective={objective}",
            "batch.prompts_per_rollout=8", *extra]  # fmt: skip
    cfg = load_config(str(ROOT / "recipes/tiny_cpu.yaml"), sets)
    fused_calls = _count_fused_calls()
    init_distributed()
    cfg.validate(dist.get_world_size())
    trainer = Trainer(cfg, initialize(cfg.parallel.layout(), seed=cfg.run.seed))
    try:
        if record is not None:
            res = trainer.rollout.next_batch()
            batch = {"groups": [g.to_dict() for g in res.groups], "stats": res.stats}
            record.write_text(json.dumps(batch) + "\n")
        batch = json.loads((DATA / "batch.json").read_text())
        groups = [Group.from_dict(d) for d in batch["groups"]]
        for gi, g in enumerate(groups):
            for s in g.samples:
                s.group_id = gi
        stats = batch["stats"]  # the rollout's own counters (tokens, seconds), as recorded
        trainer.rollout.next_batch = lambda: RolloutResult(0, groups, {}, dict(stats))
        before = [p.detach().double().clone() for c in trainer.ddp for p in c.parameters()]
        m = trainer.step()
        after = [p.detach().double() for c in trainer.ddp for p in c.parameters()]
        delta = torch.cat([(a - b).flatten() for a, b in zip(after, before)])
        theta0 = torch.cat([b.flatten() for b in before])
        res = {
            "loss": m["loss"],
            "ess": m.get("ess", float("nan")),
            "grad_norm": m["grad_norm"],
            "param_sq_sum": float(sum((a**2).sum() for a in after)),
            "delta_norm": float(delta.norm()),
            # the update along the weights it moved: sensitive to its direction and size, a sum
            # over all parameters (robust to the sign of a few near-zero gradients)
            "delta_dot_theta": float(delta @ theta0),
            "param_sq_sum_change": float(sum((a**2).sum() for a in after))
            - float(sum((b**2).sum() for b in before)),
            "n_tokens": m.get("n_tokens"),
            "fused_calls": fused_calls[0],  # calls of the fused log-prob kernel in the step
        }
        out.write_text(json.dumps(res, indent=1) + "\n")
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
