"""Run the cells of a stress grid in this process (or on every torchrun rank), resumably.

A finished cell leaves ``<work>/<cell>/cell.json`` (its summary); a rerun of the grid skips it.
A cell that was interrupted is started again from scratch (its run directory is cleared). A cell
that fails (a NaN, a diverged run) is recorded as failed with its message and the grid goes on —
a stress experiment is expected to break some configurations, and the report says which.
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ..config import TrainConfig
from .grid import Cell, GridConfig

SUMMARY = "cell.json"


def _mean(xs: List[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(
    cell: Cell,
    steps: List[dict],
    acc_start: float,
    acc_end: float,
    wall_s: float,
    status: str = "ok",
) -> dict:
    """One CSV row: the cell's settings and what its run showed."""

    def col(k):
        return [m.get(k) for m in steps if isinstance(m.get(k), (int, float))]

    r = col("reward_mean")
    return {
        "cell": cell.id,
        "objective": cell.objective,
        "mismatch": cell.mismatch,
        "family": cell.family,
        "level": cell.level,
        "seed": cell.seed,
        "status": status,
        "steps": len(steps),
        "acc_start": acc_start,
        "acc_end": acc_end,
        "acc_delta": acc_end - acc_start,
        "reward_first5": _mean(r[:5]),
        "reward_last5": _mean(r[-5:]),
        "ess_mean": _mean(col("ratio_ess")),
        "ess_min": min(col("ratio_ess"), default=float("nan")),
        "abs_logprob_diff_mean": _mean(col("abs_logprob_diff")),
        "ratio_p99_mean": _mean(col("ratio_p99")),
        "staleness_mean": _mean(col("staleness_mean")),
        "grad_norm_mean": _mean(col("grad_norm")),
        "wall_s": wall_s,
    }


def run_cell(
    grid: GridConfig,
    cell: Cell,
    cfg: TrainConfig,
    rank: int,
    on_step: Optional[Callable[[dict], None]] = None,
) -> dict:
    """Train one cell (``cfg`` = ``cell_config(grid, cell, world_size)``); returns its summary
    (also written to ``cell.json`` on rank 0)."""
    import torch.distributed as dist

    from ..parallel import Layout, initialize
    from ..trainer import Trainer

    run_dir = Path(cfg.run.dir) / cfg.run.name
    if rank == 0 and run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted cell starts again from scratch
    if dist.is_initialized():
        # World: nobody may open the run directory before rank 0 has cleared it.
        dist.barrier()
    p = cfg.parallel
    groups = initialize(
        Layout(p.tp, p.pp, p.cp, None, p.vpp, p.sequence_parallel), seed=cfg.run.seed
    )
    t0 = time.perf_counter()
    steps: List[dict] = []
    trainer = Trainer(cfg, groups)
    try:
        acc0 = trainer.evaluate(cfg.data.eval_path, grid.eval_limit)
        for _ in range(cfg.steps):
            m = trainer.step()
            steps.append(m)
            if on_step:
                on_step(m)
        acc1 = trainer.evaluate(cfg.data.eval_path, grid.eval_limit)
        summary = summarize(cell, steps, acc0, acc1, time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a broken configuration is a result, not a crash
        summary = summarize(
            cell,
            steps,
            float("nan"),
            float("nan"),
            time.perf_counter() - t0,
            status=f"failed: {type(e).__name__}: {str(e)[:200]}",
        )
    finally:
        trainer.close()
        del trainer
        gc.collect()
    if rank == 0:
        tmp = run_dir / (SUMMARY + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(run_dir / SUMMARY)  # the marker appears whole or not at all
    return summary


def finished(grid: GridConfig, cell: Cell) -> Optional[Dict]:
    f = Path(grid.work) / cell.id / SUMMARY
    return json.loads(f.read_text()) if f.is_file() else None


def step_rows(grid: GridConfig, cell: Cell) -> List[dict]:
    """The cell's per-step metrics (from its metrics.jsonl)."""
    f = Path(grid.work) / cell.id / "metrics.jsonl"
    if not f.is_file():
        return []
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
