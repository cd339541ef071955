"""Run the cells of a stress grid in this process (or on every torchrun rank), resumably.

A finished cell leaves ``<work>/<cell>/cell.json`` (its summary); a rerun of the grid skips it.
A cell that was interrupted is started again from scratch (its run directory is cleared). A cell
that fails (a NaN, a diverged run) is recorded as failed with its message and the grid goes on —
a stress experiment is expected to break some configurations, and the report says which.

The cells' store (a grid's ``store: DIR``): every cell that finishes ``ok`` is also filed under
``DIR/<key>/`` (its ``cell.json``, ``metrics.jsonl`` and the key's material, ``key.json``), where
the key is a hash of what the cell's numbers depend on: its full resolved recipe less its output
paths, ports and W&B naming (:data:`STORE_SKIP`), the grid's ``eval_limit`` and
``probe_prompts``, the bytes of the base checkpoint and of the data files, the CPU's instruction
set and — unless ``store_across_commits`` — the code (commit, and the diff of a dirty tree). A
cell of any grid with the same store whose key is filed there is not trained again:
:func:`finished` copies the record into the cell's run directory, marked ``reused_from``.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from megatron_p3o.config.train_config import TrainConfig
from megatron_p3o.runtime.collectives import barrier
from megatron_p3o.stress.grid import Cell, GridConfig
from megatron_p3o.stress.loop_mismatch import apply_loop_mismatch

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
    final_per_prompt: Optional[List[float]] = None,
) -> dict:
    """One CSV row: the cell's settings and what its run showed. The measured mismatch is taken
    twice: at the first optimizer step, before any update (``*_first``: what the rollout
    precision/noise alone does), and averaged over every optimizer step of the run (``*_run``:
    what the objective faced, reuse and staleness included)."""

    def col(k):
        return [m.get(k) for m in steps if isinstance(m.get(k), (int, float))]

    per = [p for m in steps for p in m.get("per_step", [])]

    def first(k):
        return per[0].get(k, float("nan")) if per else float("nan")

    def run(k):
        return _mean([p.get(k) for p in per])

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
        "abs_diff_first": first("abs_logprob_diff"),
        "abs_diff_p99_first": first("abs_log_ratio_p99"),
        "kl_b_theta_first": first("kl_behavior_theta"),
        "abs_diff_run": run("abs_logprob_diff"),
        "kl_b_theta_run": run("kl_behavior_theta"),
        "k3_to_behavior_run": run("k3_to_behavior"),
        "ess_step_min": min((p["ess"] for p in per if "ess" in p), default=float("nan")),
        "clip_frac_run": run("clip_frac"),
        # mechanisms: how hard each optimizer step pushed (gradient norm before clipping, the
        # share of steps that clip_grad cut, the update's size under Adam) and the entropy
        "grad_clipped_run": run("grad_clipped"),
        "update_norm_run": run("update_norm"),
        "update_rel_run": run("update_rel"),
        "entropy_first5": _mean(col("entropy")[:5]),
        "entropy_last5": _mean(col("entropy")[-5:]),
        "kl_ref_last5": _mean(col("kl_ref_k3")[-5:]),
        "completion_len_last5": _mean(col("completion_len")[-5:]),
        "opt_steps": len(per),
        "wall_s": wall_s,
        "final_per_prompt": final_per_prompt or [],
    }


def run_cell(
    grid: GridConfig,
    cell: Cell,
    cfg: TrainConfig,
    rank: int,
    on_step: Optional[Callable[[dict], None]] = None,
    provenance: Optional[dict] = None,
) -> dict:
    """Train one cell (``cfg`` = ``cell_config(grid, cell, world_size)``); returns its summary
    (also written to ``cell.json`` on rank 0)."""
    import torch.distributed as dist

    from megatron_p3o.evaluation.heldout import sets_due
    from megatron_p3o.runtime.parallel import initialize
    from megatron_p3o.trainer import Trainer

    run_dir = Path(cfg.run.dir) / cfg.run.name
    if rank == 0 and run_dir.exists():
        shutil.rmtree(run_dir)  # an interrupted cell starts again from scratch
    if dist.is_initialized():
        barrier(dist.group.WORLD, "nobody opens the run directory before rank 0 cleared it")
    p = cfg.parallel
    groups = initialize(p.layout(), seed=cfg.run.seed)
    t0 = time.perf_counter()
    steps: List[dict] = []
    curve: List[dict] = []  # eval sets (pass@k, greedy) every eval.every steps
    trainer = Trainer(cfg, groups)
    probe: Dict[str, float] = {}
    loop = grid.mismatch[cell.mismatch].loop
    hook = apply_loop_mismatch(loop, trainer)  # a loop mismatch that is no trainer option
    try:
        if grid.probe_prompts:  # the setting's exogenous mismatch, before any step
            from megatron_p3o.stress.probe import probe_mismatch

            probe = probe_mismatch(trainer, grid.probe_prompts)
            if hook is not None:  # the probe saw the loop mismatch; the counts are training's
                hook.reset()
        acc0 = _start_accuracy(grid, cfg, trainer)
        if cfg.eval.sets:  # long runs: the eval sets' curve starts at the base weights
            curve.append({"step": 0, **trainer.evaluate_sets()})
        due = eval_steps(grid, cfg.steps)
        held: Dict[int, float] = {}  # held-out accuracy after the grid's eval_steps
        for i in range(1, cfg.steps + 1):
            m = trainer.step()
            steps.append(m)
            if sets_due(cfg.eval, i, i == cfg.steps):
                curve.append({"step": i, **trainer.evaluate_sets()})
            if i in due and i != cfg.steps:
                held[i] = trainer.evaluate(cfg.data.eval_path, grid.eval_limit)
            if on_step:
                on_step(m)
        acc1, per_prompt = trainer.evaluate_detail(cfg.data.eval_path, grid.eval_limit)
        if cfg.steps in due:
            held[cfg.steps] = acc1
        summary = summarize(
            cell, steps, acc0, acc1, time.perf_counter() - t0, final_per_prompt=per_prompt
        )
        summary.update(curve_summary(curve))
        summary.update(endpoint_summary(grid, held))
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
    summary.update(probe)
    if hook is not None:
        summary.update(hook.summary())
    summary.update(provenance or {})  # commit, base model and grid hashes (stress.provenance)
    if rank == 0:
        tmp = run_dir / (SUMMARY + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        tmp.replace(run_dir / SUMMARY)  # the marker appears whole or not at all
        file_in_store(grid, cfg, run_dir, summary, loop)
    if grid.store and dist.is_initialized():
        barrier(dist.group.WORLD, "every rank sees the stored cell before the next finished()")
    return summary


def eval_steps(grid: GridConfig, steps: int) -> List[int]:
    """The steps after which a cell also scores the held-out set (``eval_steps`` and
    ``endpoint_steps`` of the grid, within the run)."""
    return sorted({int(s) for s in (*grid.eval_steps, *grid.endpoint_steps) if 1 <= s <= steps})


def endpoint_summary(grid: GridConfig, held: Dict[int, float]) -> dict:
    """CSV columns of the held-out curve: ``acc_s<step>`` per evaluation and, with
    ``endpoint_steps``, the endpoint ``acc_mean_end`` (their mean: a step-to-step wobble of the
    policy averages out; docs/stress_v5_plan.md chose it on pilot data)."""
    out = {f"acc_s{s}": a for s, a in sorted(held.items())}
    if grid.endpoint_steps:
        at = [held[s] for s in grid.endpoint_steps if s in held]
        out["acc_mean_end"] = sum(at) / len(at) if len(at) == len(grid.endpoint_steps) else math.nan
    return out


def curve_summary(curve: List[dict]) -> dict:
    """The eval-set curve (kept whole in ``cell.json``, not in the CSV) and its last point as
    CSV columns: ``eval/heldout/pass@8`` at the end → ``heldout_pass@8_end``."""
    if not curve:
        return {}
    last = {
        k.removeprefix("eval/").replace("/", "_") + "_end": v
        for k, v in curve[-1].items()
        if k.startswith("eval/") and not k.endswith("/prompts")
    }
    return {**last, "eval_curve": curve}


def _start_accuracy(grid: GridConfig, cfg: TrainConfig, trainer) -> float:
    """The base model's held-out accuracy. Evaluated in the trainer's precision it is the same
    for every cell of a grid (same checkpoint, greedy), so it is computed once and kept in
    ``<work>/start_eval/`` (single-process cells, as ``--workers`` runs them); in the rollout
    precision it depends on the cell and is not cached."""
    import hashlib

    import torch.distributed as dist

    if cfg.data.eval_precision != "trainer" or dist.get_world_size() > 1:  # one rank: no race
        return trainer.evaluate(cfg.data.eval_path, grid.eval_limit)
    key = json.dumps(
        [cfg.model.checkpoint, cfg.data.eval_path, grid.eval_limit, cfg.model.params_dtype]
    )
    f = Path(grid.work) / "start_eval" / (hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
    if f.is_file():
        return float(json.loads(f.read_text())["acc"])
    acc = trainer.evaluate(cfg.data.eval_path, grid.eval_limit)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "acc": acc}))
    tmp.replace(f)  # workers may race: either write is the same number
    return acc


def finished(grid: GridConfig, cell: Cell) -> Optional[Dict]:
    """The cell's summary if it has finished — or, with a store, if a cell of the same key has
    (the record is then copied into this cell's run directory, see :func:`reuse`)."""
    f = Path(grid.work) / cell.id / SUMMARY
    if f.is_file():
        return json.loads(f.read_text())
    got = reuse(grid, cell) if grid.store else None
    if got is None and grid.committed:
        got = committed_rows(grid.committed).get(cell.id)
    return got


_committed: Dict[tuple, Dict[str, dict]] = {}


def committed_rows(report_dir: str) -> Dict[str, dict]:
    """cell id -> its row of ``<report_dir>/cells.csv`` (numbers parsed), read once per (file,
    mtime): the grid's committed cells, finished wherever they ran."""
    from megatron_p3o.stress.study import read_cells

    f = Path(report_dir) / "cells.csv"
    if not f.is_file():
        return {}
    k = (str(f.resolve()), f.stat().st_mtime_ns)
    if k not in _committed:
        _committed[k] = {r["cell"]: r for r in read_cells(f)}
    return _committed[k]


# -- the cells' store ----------------------------------------------------------------------------

STORE_SKIP = (
    "run.name",
    "run.dir",
    "run.exit_signals",
    "run.exit_after_minutes",
    "wandb",
    "rollout.sglang.port",
    "rollout.sglang.router_port",
    "rollout.sglang.log_dir",
    "rollout.weight_sync_port",
    "rollout.weight_sync_dir",
)
STORE_KEY = "key.json"
_LABELS = ("cell", "objective", "mismatch", "family", "level", "seed")  # the cell's, not its key's
_hash_cache: Dict[tuple, str] = {}


def _file_hash(path: str) -> str:
    """tree_hash of a checkpoint or data file, once per process and (path, mtime, size)."""
    from megatron_p3o.stress.provenance import tree_hash

    if not path:
        return "none"
    p = Path(path)
    st = p.stat() if p.exists() else None
    k = (str(p.resolve()), st.st_mtime_ns if st else 0, st.st_size if st else 0)
    if k not in _hash_cache:
        _hash_cache[k] = tree_hash(p)
    return _hash_cache[k]


def code_key() -> str:
    """The commit, plus the hash of ``git diff HEAD`` (outside docs/) when the tree is dirty:
    two dirty trees with other edits are other code."""
    import hashlib
    import subprocess

    from megatron_p3o.stress.provenance import _ROOT, code_commit

    if "code" in _hash_cache:
        return _hash_cache["code"]
    commit = code_commit()
    if commit.endswith("+dirty"):
        diff = subprocess.run(
            ["git", "-C", str(_ROOT), "diff", "HEAD", "--", ".", ":(exclude)docs"],
            capture_output=True, timeout=60,
        ).stdout  # fmt: skip
        commit += ":" + hashlib.sha256(diff).hexdigest()[:16]
    _hash_cache["code"] = commit
    return commit


def store_material(grid: GridConfig, cfg: TrainConfig, loop: str = "") -> dict:
    """What a cell's numbers depend on (the store's key is its hash); ``loop``: the cell's loop
    mismatch (:mod:`.loop_mismatch`), which its config does not show."""
    from megatron_p3o.config.loading import to_dict
    from megatron_p3o.stress.provenance import cpu_isa

    conf = to_dict(cfg)
    for dotted in STORE_SKIP:
        *parents, last = dotted.split(".")
        node = conf
        for k in parents:
            node = node.get(k, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
    extra = {}
    if grid.eval_steps or grid.endpoint_steps:  # v5: the held-out curve and the endpoint's steps
        extra = {"eval_steps": eval_steps(grid, cfg.steps), "endpoint_steps": grid.endpoint_steps}
    if loop:  # v6 (absent otherwise: earlier cells keep their keys)
        extra["loop"] = loop
    return {
        **extra,
        "config": conf,
        "eval_limit": grid.eval_limit,
        "probe_prompts": grid.probe_prompts,
        "base_hash": _file_hash(cfg.model.checkpoint),
        "data_hash": [_file_hash(cfg.data.path), _file_hash(cfg.data.eval_path)],
        "cpu_isa": cpu_isa(),
        "code": None if grid.store_across_commits else code_key(),
    }


def store_key(material: dict) -> str:
    import hashlib

    text = json.dumps(material, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


_key_cache: Dict[tuple, tuple] = {}


def _cell_key(grid: GridConfig, cell: Cell) -> tuple:
    """(key, material) of a cell of ``grid`` (its config as :func:`~.grid.cell_config` makes it
    for the grid's world size), cached per process: :func:`finished` is called often."""
    from megatron_p3o.stress.grid import cell_config

    k = (grid.work, grid.store, cell.id, tuple(cell.overrides), grid.eval_limit, grid.probe_prompts)
    if k not in _key_cache:
        mat = store_material(grid, cell_config(grid, cell), grid.mismatch[cell.mismatch].loop)
        _key_cache[k] = (store_key(mat), mat)
    return _key_cache[k]


def _copy_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


def file_in_store(
    grid: GridConfig, cfg: TrainConfig, run_dir: Path, summary: dict, loop: str = ""
) -> None:
    """File a finished ``ok`` cell under its key (first one wins; a failed cell is not filed:
    a failure may be the machine's, and the next grid should try again)."""
    if not grid.store or summary.get("status") != "ok" or summary.get("reused_from"):
        return
    mat = store_material(grid, cfg, loop)
    d = Path(grid.store) / store_key(mat)
    if (d / SUMMARY).is_file():
        return
    d.mkdir(parents=True, exist_ok=True)
    (d / STORE_KEY).write_text(json.dumps(mat, indent=1, sort_keys=True, default=str))
    if (run_dir / "metrics.jsonl").is_file():
        _copy_atomic(run_dir / "metrics.jsonl", d / "metrics.jsonl")
    rec = {**summary, "stored_from": str(run_dir)}
    tmp = d / f"{SUMMARY}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(rec, indent=1))
    tmp.replace(d / SUMMARY)  # the entry exists once its record is whole


def reuse(grid: GridConfig, cell: Cell) -> Optional[Dict]:
    """The stored record of a cell with this cell's key, copied into ``<work>/<cell>/`` (with
    its metrics.jsonl) under this cell's labels and marked ``reused_from`` (the stored run
    directory, and the key); None when the store has none."""
    key, _ = _cell_key(grid, cell)
    d = Path(grid.store) / key
    if not (d / SUMMARY).is_file():
        return None
    rec = json.loads((d / SUMMARY).read_text())
    origin = rec.pop("stored_from", "")
    rec.update(
        cell=cell.id,
        objective=cell.objective,
        mismatch=cell.mismatch,
        family=cell.family,
        level=cell.level,
        seed=cell.seed,
        reused_from=f"{origin} (store key {key})",
    )
    if grid.path:  # the grid it now belongs to (the original grid's hash is kept beside it)
        from megatron_p3o.stress.provenance import grid_commit, tree_hash

        rec["reused_grid_hash"] = rec.get("grid_hash", "unrecorded")
        rec["grid_hash"] = tree_hash(grid.path)
        if "grid_commit" in rec:  # v6 cells: the plan's commit of the grid it now belongs to
            rec["reused_grid_commit"] = rec["grid_commit"]
            rec["grid_commit"] = grid_commit(grid.path)
    run_dir = Path(grid.work) / cell.id
    run_dir.mkdir(parents=True, exist_ok=True)
    if (d / "metrics.jsonl").is_file():
        _copy_atomic(d / "metrics.jsonl", run_dir / "metrics.jsonl")
    tmp = run_dir / f"{SUMMARY}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(rec, indent=1))
    tmp.replace(run_dir / SUMMARY)
    return rec


def step_rows(grid: GridConfig, cell: Cell) -> List[dict]:
    """The cell's per-step metrics (from its metrics.jsonl)."""
    f = Path(grid.work) / cell.id / "metrics.jsonl"
    if not f.is_file():
        return []
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
