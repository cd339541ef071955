"""``python -m megatron_p3o.stress GRID.yaml [--list] [--report-only] [--workers N]`` (also
under torchrun).

Runs every cell of the grid that has no ``cell.json`` yet, then writes the report. Interrupt it
at any time: the same command continues with the unfinished cells. ``--workers N`` runs N cells
at a time in separate single-process workers (each with cores/N threads: the tiny CPU models are
overhead-bound, so two one-thread workers beat one two-thread process); each worker logs to
``<work>/worker<i>.log``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grid")
    ap.add_argument(
        "--list", action="store_true", help="validate every cell and list them; run nothing"
    )
    ap.add_argument(
        "--report-only", action="store_true", help="write the report from finished cells"
    )
    ap.add_argument("--workers", type=int, default=1, help="cells run at a time (processes)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "i/N": internal
    ap.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from megatron_p3o.stress.grid import cell_config, cells, load_grid
    from megatron_p3o.stress.provenance import provenance
    from megatron_p3o.stress.report import write_report
    from megatron_p3o.stress.runner import finished, run_cell, step_rows

    grid = load_grid(a.grid)
    todo = cells(grid)
    con = Console(soft_wrap=True)
    for c in todo:
        cell_config(grid, c)  # every cell must be a valid recipe before anything runs
    if a.worker:
        i, n = (int(x) for x in a.worker.split("/"))
        todo = todo[i::n]
    elif a.workers > 1 and not (a.list or a.report_only):
        _run_workers(a, grid, todo, con)
        todo = cells(grid)
        a.report_only = True
    if a.list or a.report_only:
        if a.list:
            for c in todo:
                con.print(f"{'done' if finished(grid, c) else 'todo'}  {c.id}")
            con.print(f"{len(todo)} cells, {sum(finished(grid, c) is None for c in todo)} to run")
            return 0
    else:
        import torch.distributed as dist

        from megatron_p3o.parallel import init_distributed

        init_distributed()
        rank, world = dist.get_rank(), dist.get_world_size()
        con = Console(quiet=rank != 0, soft_wrap=True)
        t0 = time.perf_counter()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=con,
            disable=rank != 0,
        ) as bar:
            grid_task = bar.add_task("cells", total=len(todo))
            for c in todo:
                if finished(grid, c):
                    bar.advance(grid_task)
                    continue
                cfg = cell_config(grid, c, world)
                st = bar.add_task(f"  {c.id}", total=cfg.steps)
                prov = provenance(a.grid, cfg.model.checkpoint)
                s = run_cell(
                    grid, c, cfg, rank, on_step=lambda m, st=st: bar.advance(st), provenance=prov
                )
                bar.remove_task(st)
                bar.advance(grid_task)
                con.print(
                    f"{c.id}: {s['status']}  acc {s['acc_start']:.3f} → {s['acc_end']:.3f}  "
                    f"ess {s['ess_mean']:.3f}  {s['wall_s']:.0f}s"
                )
        con.print(f"ran the grid in {(time.perf_counter() - t0) / 60:.1f} min")
        if rank != 0 or a.worker:
            return 0
    done = [(c, finished(grid, c)) for c in todo]
    rows = [s for _, s in done if s is not None]
    if not rows:
        con.print("no finished cells yet")
        return 1
    steps = {c.id: step_rows(grid, c) for c, s in done if s is not None}
    path = write_report(grid, rows, steps, sum(r["wall_s"] for r in rows), a.grid)
    con.print(f"report: {path}  ({len(rows)}/{len(todo)} cells)")
    return 0


def _run_workers(a, grid, todo, con) -> None:
    """Start ``a.workers`` worker processes over disjoint cells and follow their progress."""
    from pathlib import Path

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from megatron_p3o.stress.runner import finished

    n = a.workers
    work = Path(grid.work)
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    procs = []
    for i in range(n):
        log = open(work / f"worker{i}.log", "a")
        cmd = [sys.executable, "-m", "megatron_p3o.stress", a.grid, "--worker", f"{i}/{n}"]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    t0 = time.perf_counter()
    before = sum(finished(grid, c) is not None for c in todo)
    with Progress(
        TextColumn("cells"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=con,
    ) as bar:  # fmt: skip
        task = bar.add_task("cells", total=len(todo))
        while any(p.poll() is None for p, _ in procs):
            bar.update(task, completed=sum(finished(grid, c) is not None for c in todo))
            time.sleep(2)
        bar.update(task, completed=sum(finished(grid, c) is not None for c in todo))
    for i, (p, log) in enumerate(procs):
        log.close()
        if p.returncode:
            con.print(f"[red]worker {i} exited {p.returncode}: see {work}/worker{i}.log")
    wall = time.perf_counter() - t0
    con.print(f"ran the grid in {wall / 60:.1f} min with {n} workers")
    from megatron_p3o.stress.provenance import log_grid_run

    ran = sum(finished(grid, c) is not None for c in todo) - before
    log_grid_run(grid, wall_s=wall, workers=n, cells_run=ran)


_DIST_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


if __name__ == "__main__":
    from megatron_p3o.errors import run_cli

    run_cli(main, "megatron_p3o.stress")
