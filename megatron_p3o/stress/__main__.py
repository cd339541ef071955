"""Run a stress grid (objectives × mismatch settings × seeds, each cell a full training run) and
write its report: ``report.md``, ``cells.csv``, ``steps.csv`` and the plots.

``python -m megatron_p3o.stress GRID.yaml [--out DIR] [--set KEY=VALUE ...] [--list]
[--report-only] [--workers N] [--until-decided | --looks N]``, also under torchrun.

Runs every cell of the grid that has no ``cell.json`` yet, then writes the report. Interrupt it
at any time: the same command continues with the unfinished cells. ``--workers N`` runs N cells
at a time in separate single-process workers (each with cores/N threads: the tiny CPU models are
overhead-bound, so two one-thread workers beat one two-thread process); each worker logs to
``<work>/worker<i>.log``.

Where things go: cells in the grid's ``work`` and the report in its ``out`` — except that a
grid's ``out`` inside the repository's ``docs/`` (the committed results) is never written
unless asked: the report then goes to ``<work>/report``, and ``--out docs/...`` writes there.
``--out DIR`` puts the report in DIR and the cells in ``DIR/cells`` (in the grid's ``work`` when
DIR is inside ``docs/``: committed results hold reports, not run directories). ``--set
KEY=VALUE`` (repeatable) is added to the grid's ``set:`` (the overrides on its base recipe, for
every cell), replacing a key it has; an objective's or a setting's own ``set:`` still wins, so
the grid's axes stay what they are. Cells remember their ``--set``: a finished cell run with
other ``--set`` items is refused, not mixed into the report. A sequential grid (``sequential:``,
stress study v5) runs one look per invocation — the cells its undecided comparisons need next —
``--looks N`` looks, or with ``--until-decided`` every look until each declared comparison is
decided or at its seed cap; it resumes from the finished cells (its committed ``cells.csv``
included), so a study can span machines, a look committed at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

PROG = "python -m megatron_p3o.stress"
ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"  # committed results: written only when --out names a folder in it


def description(doc: str) -> str:
    """The whole first paragraph of ``doc`` on one line (argparse re-wraps it)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def in_docs(path) -> bool:
    """Whether ``path`` (relative to the working directory) lies in the repository's docs/."""
    return Path(path).resolve().is_relative_to(DOCS.resolve())


def parse_sets(items) -> dict:
    """``["steps=2", "optim.lr=1e-4"]`` → ``{"steps": 2, "optim.lr": 1e-4}`` (values are YAML)."""
    import yaml

    from megatron_p3o.runtime.errors import ConfigError

    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE (e.g. --set steps=2)")
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {e}") from None
    return out


def resolve(grid, out=None, sets=()):
    """``grid`` with the command line's ``--out`` and ``--set`` applied, and a sentence saying
    where its cells and report go."""
    if out:
        work = grid.work if in_docs(out) else str(Path(out) / "cells")
        grid = dataclasses.replace(grid, out=str(out), work=work)
    elif in_docs(grid.out):
        report = str(Path(grid.work) / "report")
        note = (
            f" (the grid's out, {grid.out}, holds committed results: --out {grid.out} to replace)"
        )
        grid = dataclasses.replace(grid, out=report)
        return _with_sets(grid, sets), f"cells: {grid.work}  report: {report}{note}"
    grid = _with_sets(grid, sets)
    return grid, f"cells: {grid.work}  report: {grid.out}"


def _with_sets(grid, sets):
    return dataclasses.replace(grid, set={**grid.set, **parse_sets(sets)}) if sets else grid


def sets_text(sets) -> str:
    """How a cell records the ``--set`` items it was run with ("" for none)."""
    return " ".join(sets)


def check_same_sets(grid, todo, sets) -> None:
    """Refuse finished cells whose recorded ``--set`` items differ from this invocation's."""
    from megatron_p3o.runtime.errors import ConfigError
    from megatron_p3o.stress.runner import finished

    want = sets_text(sets)
    for c in todo:
        s = finished(grid, c)
        if s is not None and s.get("cli_set", "") != want:
            raise ConfigError(
                f"cell {c.id} in {grid.work} was run with --set {s.get('cli_set', '') or '(none)'}"
                f", this invocation has --set {want or '(none)'}: give the same --set items, or "
                "another --out"
            )


def check_base(grid, checkpoint: str) -> None:
    """The grid's ``base_hash``: the cells must start from that base (the shipped one), not from
    one trained on this CPU, whose weights differ on another instruction set. One line if not."""
    from megatron_p3o.runtime.errors import ConfigError
    from megatron_p3o.stress.provenance import tree_hash

    if not Path(checkpoint).exists():
        raise ConfigError(
            f"grid {grid.path}: base checkpoint {checkpoint} is missing (install the shipped base: "
            "python tools/make_tiny_base.py --out runs/tiny_base)"
        )
    got = tree_hash(checkpoint)
    if got != grid.base_hash:
        raise ConfigError(
            f"grid {grid.path}: base_hash: {checkpoint} hashes to {got}, the grid expects "
            f"{grid.base_hash} (the shipped base: python tools/make_tiny_base.py --out DIR)"
        )


def check_inputs(grid, configs) -> None:
    """What every cell reads before it trains — its base checkpoint and its data files — exists:
    one line naming the first that does not, before any worker starts (a worker would otherwise
    fail on it and leave the reason in its log)."""
    from megatron_p3o.runtime.errors import InputFileError

    hint = " (install the shipped base: python tools/make_tiny_base.py --out runs/tiny_base)"
    seen = set()
    for cfg in configs:
        key = (cfg.model.checkpoint, cfg.data.path, cfg.data.eval_path)
        if key in seen:
            continue
        seen.add(key)
        ckpt = cfg.model.checkpoint
        if ckpt and not Path(ckpt).is_dir():
            what = "is a file, not a directory" if Path(ckpt).exists() else "does not exist"
            base = hint if "tiny_base" in ckpt else ""
            raise InputFileError(f"grid {grid.path}: checkpoint directory {ckpt} {what}{base}")
        for k, f in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)):
            if f and Path(f).suffix in (".jsonl", ".json", ".parquet") and not Path(f).is_file():
                base = hint if "tiny_base" in f else ""
                raise InputFileError(f"grid {grid.path}: {k}={f} does not exist{base}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=description(__doc__))
    ap.add_argument("grid", help="the grid file (e.g. recipes/stress_smoke_cpu.yaml)")
    ap.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="the report goes to DIR and the cells to DIR/cells (default: the grid's out and "
        "work; a grid out inside docs/ is replaced by <work>/report unless --out names it)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override on the base recipe of every cell, added to the grid's set: (repeatable)",
    )
    ap.add_argument(
        "--list", action="store_true", help="validate every cell and list them; run nothing"
    )
    ap.add_argument(
        "--report-only", action="store_true", help="write the report from finished cells"
    )
    ap.add_argument("--workers", type=int, default=1, help="cells run at a time (processes)")
    ap.add_argument(
        "--until-decided",
        action="store_true",
        help="a sequential grid: run look after look until every declared comparison is decided "
        "or at its seed cap (default: the next look only)",
    )
    ap.add_argument(
        "--looks", type=int, default=0, metavar="N", help="a sequential grid: run at most N looks"
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "i/N": internal
    ap.add_argument("--cells-file", default=None, help=argparse.SUPPRESS)  # a look's cells
    ap.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    a = ap.parse_args(argv)
    from rich.console import Console

    from megatron_p3o.runtime.errors import ConfigError
    from megatron_p3o.stress.grid import cell_config, cells, load_grid
    from megatron_p3o.stress.runner import finished

    grid, where = resolve(load_grid(a.grid), a.out, a.set)
    todo = cells(grid)
    con = Console(soft_wrap=True)
    configs = [cell_config(grid, c) for c in todo]  # every cell a valid recipe before anything runs
    if (a.until_decided or a.looks) and not grid.sequential:
        raise ConfigError(f"--until-decided/--looks: grid {a.grid} has no sequential: design")
    running = not (a.list or a.report_only or a.worker)
    if grid.base_hash and running:  # the base first: the hint that installs it comes first
        check_base(grid, configs[0].model.checkpoint)
    if running:
        check_inputs(grid, configs)
    if a.worker:
        i, n = (int(x) for x in a.worker.split("/"))
        if a.cells_file:
            ids = set(Path(a.cells_file).read_text().split())
            todo = [c for c in todo if c.id in ids]
        todo = todo[i::n]
    elif grid.sequential and running:
        _run_looks(a, grid, con)
        todo = cells(grid)
        a.report_only = True
    elif a.workers > 1 and running:
        _run_workers(a, grid, todo, con)
        todo = cells(grid)
        a.report_only = True
    if not a.list:
        check_same_sets(grid, todo, a.set)
    if a.list:
        con.print(where)
        if grid.sequential:
            return _list_looks(grid, todo, con)
        for c in todo:
            con.print(f"{'done' if finished(grid, c) else 'todo'}  {c.id}")
        con.print(f"{len(todo)} cells, {sum(finished(grid, c) is None for c in todo)} to run")
        return 0
    if not a.report_only:
        _run_here(a, grid, todo, con)
        if a.worker:
            return 0
    return _report(a, grid, todo, con)


def _run_here(a, grid, todo, con) -> None:
    """Run ``todo`` in this process (or on every torchrun rank), one cell after another."""
    import torch.distributed as dist
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from megatron_p3o.runtime.parallel import init_distributed
    from megatron_p3o.stress.grid import cell_config
    from megatron_p3o.stress.provenance import provenance
    from megatron_p3o.stress.runner import finished, run_cell

    if not dist.is_initialized():
        init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    con = Console(quiet=rank != 0, soft_wrap=True) if rank else con
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
            if a.set:  # a finished cell remembers them (check_same_sets)
                prov["cli_set"] = sets_text(a.set)
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


def _report(a, grid, todo, con) -> int:
    import torch.distributed as dist

    from megatron_p3o.stress.report import write_report
    from megatron_p3o.stress.runner import finished, step_rows

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return 0
    done = [(c, finished(grid, c)) for c in todo]
    rows = [s for _, s in done if s is not None]
    if not rows:
        con.print("no finished cells yet")
        return 1
    steps = {c.id: step_rows(grid, c) for c, s in done if s is not None}
    how = " ".join([a.grid] + [f"--set {x}" for x in a.set])
    path = write_report(grid, rows, steps, sum(r["wall_s"] for r in rows), how)
    con.print(f"report: {path}  ({len(rows)}/{len(todo)} cells)")
    return 0


def _rows(grid, todo):
    from megatron_p3o.stress.runner import finished

    return [s for s in (finished(grid, c) for c in todo) if s is not None]


def _list_looks(grid, todo, con) -> int:
    """A sequential grid's state: each declared comparison's call so far and the next look."""
    from megatron_p3o.stress.looks import next_look, states

    rows = _rows(grid, todo)
    looks = grid.sequential.looks
    for c, call, _ in states(grid, rows):
        what = "not started" if call is None else (
            f"{call.label} at look {call.look} ({call.n} seeds, Δ {call.delta:+.3f})"
            if call.final else f"undecided after look {call.look}"
        )  # fmt: skip
        on = f" on {c.against}" if c.against != c.setting else ""
        con.print(f"{c.setting:>12}  {c.arm} − {c.comparator}{on}: {what}")
    k, need = next_look(grid, rows)
    if k is None:
        con.print("every declared comparison is decided or at its cap: nothing to run")
    else:
        con.print(f"next: look {k + 1} of {len(looks)} ({looks[k]} seeds): {len(need)} cells")
    return 0


def _run_looks(a, grid, con) -> None:
    """Run a sequential grid's looks: the next one, ``--looks N`` of them, or with
    ``--until-decided`` until no comparison waits for a look."""
    from megatron_p3o.stress.grid import cells
    from megatron_p3o.stress.looks import next_look

    budget = len(grid.sequential.looks) if a.until_decided else max(1, a.looks)
    for _ in range(budget):
        k, need = next_look(grid, _rows(grid, cells(grid)))
        if k is None:
            con.print("every declared comparison is decided or at its cap: nothing to run")
            return
        con.print(
            f"look {k + 1} of {len(grid.sequential.looks)} ({grid.sequential.looks[k]} seeds): "
            f"{len(need)} cells to run"
        )
        t0 = time.perf_counter()
        if a.workers > 1:
            _run_workers(a, grid, need, con, look=k + 1)
        else:
            import torch.distributed as dist

            from megatron_p3o.runtime.collectives import barrier
            from megatron_p3o.stress.provenance import log_grid_run

            _run_here(a, grid, need, con)
            barrier(dist.group.WORLD, "every rank sees the look's cells before choosing the next")
            if dist.get_rank() == 0:
                log_grid_run(grid, time.perf_counter() - t0, 1, len(need), look=k + 1)
        k2, _ = next_look(grid, _rows(grid, cells(grid)))
        if k2 == k:  # the look's cells did not all finish (a worker died): say so, stop
            from megatron_p3o.runtime.errors import UserError

            raise UserError(f"look {k + 1} did not finish its cells (see {grid.work}/worker*.log)")


def _run_workers(a, grid, todo, con, look=None) -> None:
    """Start ``a.workers`` worker processes over disjoint cells and follow their progress."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from megatron_p3o.stress.runner import finished

    n = a.workers
    work = Path(grid.work)
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    listed = None
    if look is not None:  # the workers run exactly this look's cells
        listed = work / f"look{look}_cells.txt"
        listed.write_text("\n".join(c.id for c in todo) + "\n")
    procs = []
    for i in range(n):
        log = open(work / f"worker{i}.log", "a")
        cmd = [sys.executable, "-m", "megatron_p3o.stress", a.grid, "--worker", f"{i}/{n}"]
        cmd += (["--out", a.out] if a.out else []) + [x for s in a.set for x in ("--set", s)]
        cmd += ["--cells-file", str(listed)] if listed else []
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
            con.print(
                f"[red]worker {i} exited {p.returncode}: {_last_error(work / f'worker{i}.log')}"
                f" (log: {work}/worker{i}.log)"
            )
    wall = time.perf_counter() - t0
    con.print(f"ran the grid in {wall / 60:.1f} min with {n} workers")
    from megatron_p3o.stress.provenance import log_grid_run

    ran = sum(finished(grid, c) is not None for c in todo) - before
    log_grid_run(grid, wall_s=wall, workers=n, cells_run=ran, look=look)


def _last_error(log: Path) -> str:
    """The worker's one-line error (``PROG: error: …``), else its log's last line."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    errs = [x for x in lines if x.startswith(f"{PROG}: error: ")]
    return errs[-1].removeprefix(f"{PROG}: error: ") if errs else lines[-1] if lines else ""


_DIST_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "megatron_p3o.stress")
