"""Rerun cells of a stress grid from scratch and compare them with the grid's committed CSV.

    python tools/rerun_cells.py recipes/stress_v3_dose_stale_tiny_cpu.yaml --random 3
    python tools/rerun_cells.py GRID.yaml --cells p3o__bf16__s1 grpo__stale_K8__s4

Each cell trains again in a scratch work directory (never the grid's own), with the threads a
``--workers N`` grid gives each of its workers (cores // N; ``--workers`` here, 2 by default),
and every column of its summary is compared with the
grid's ``cells.csv`` (``out:``) exactly, but for the wall time and the provenance. The committed
cells' provenance says on which commit, base model and CPU instruction set (``cpu_isa``) they
ran: on another ISA the kernels round differently and the numbers differ (the tool says so).
Exit status 0 when every number equals, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SKIP = {"wall_s", "commit", "base_hash", "grid_hash", "cpu_isa"}


def _same(a: str, b) -> bool:
    """A CSV text against the rerun's value, as the CSV writer would have written it."""
    if isinstance(b, float) and math.isnan(b):
        return a.lower() == "nan"
    return a == str(b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grid")
    ap.add_argument("--cells", nargs="*", default=[], help="cell ids (objective__setting__sN)")
    ap.add_argument("--random", type=int, default=0, help="this many cells drawn at random")
    ap.add_argument("--draw-seed", type=int, default=None, help="seed of the random draw")
    ap.add_argument(
        "--workers", type=int, default=2, help="the --workers the grid ran with (threads)"
    )
    a = ap.parse_args(argv)
    threads = max(1, (os.cpu_count() or 1) // max(1, a.workers))  # as stress._run_workers
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    from megatron_p3o.runtime.errors import UserError
    from megatron_p3o.runtime.parallel import init_distributed
    from megatron_p3o.stress.grid import cell_config, cells, load_grid
    from megatron_p3o.stress.provenance import provenance
    from megatron_p3o.stress.runner import run_cell

    grid = load_grid(a.grid)
    csv_path = Path(grid.out) / "cells.csv"
    if not csv_path.is_file():
        raise UserError(f"{csv_path} does not exist: run the grid (or its report) first")
    committed = {r["cell"]: r for r in csv.DictReader(open(csv_path))}
    by_id = {c.id: c for c in cells(grid)}
    unknown = [c for c in a.cells if c not in by_id or c not in committed]
    if unknown:
        raise UserError(f"--cells: {unknown} are not cells of {a.grid} with a row in {csv_path}")
    pick = list(a.cells)
    if a.random:
        pool = sorted(set(committed) & set(by_id) - set(pick))
        pick += random.Random(a.draw_seed).sample(pool, min(a.random, len(pool)))
    if not pick:
        raise UserError("name cells with --cells or draw some with --random N")
    init_distributed()
    work = tempfile.mkdtemp(prefix="rerun_cells_")
    grid = replace(grid, work=work)
    ok = True
    for cid in pick:
        cell, want = by_id[cid], committed[cid]
        cfg = cell_config(grid, cell, 1)
        got = run_cell(grid, cell, cfg, 0, provenance=provenance(a.grid, cfg.model.checkpoint))
        # an empty field: a column the committed cell's code did not record yet (the CSV is
        # the union of every cell's columns), not a difference
        cols = [k for k in want if k not in SKIP and k in got and want[k] != ""]
        unrecorded = [k for k in want if k not in SKIP and k in got and want[k] == ""]
        diff = [k for k in cols if not _same(want[k], got[k])]
        # the rerun's own provenance (in its summary) against the committed row's
        same_base = want.get("base_hash") == got["base_hash"]
        same_isa = want.get("cpu_isa") == got["cpu_isa"]
        print(
            f"{cid}: {len(cols) - len(diff)}/{len(cols)} columns equal"
            f"  acc_end {want['acc_end']} vs {got['acc_end']}"
            f"  (base {'same' if same_base else 'DIFFERENT'}, ISA {want.get('cpu_isa')}"
            f" vs {got['cpu_isa']})"
        )
        if unrecorded:
            print(f"    not recorded by the committed cell: {', '.join(unrecorded)}")
        for k in diff[:8]:
            print(f"    {k}: committed {want[k]}  rerun {got[k]}")
        if diff and not (same_base and same_isa):
            print("    (another base model or instruction set: equality is not expected)")
        ok = ok and not diff
    print(f"scratch work directory: {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "tools/rerun_cells.py")
