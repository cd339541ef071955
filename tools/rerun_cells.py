"""Rerun cells of a stress grid from scratch, compare them with the grid's committed cells, and
say whether the grid's declared calls would move.

    python tools/rerun_cells.py recipes/stress_v5_tiny_cpu.yaml --random 3
    python tools/rerun_cells.py GRID.yaml --cells p3o__bf16__s1 grpo__stale_K8__s4
    python tools/rerun_cells.py GRID.yaml --random 3 --record docs/stress_v5_tiny_cpu/reruns.csv

The committed cells are the grid's ``committed:`` report (v5), else its ``out``, else
``docs/<grid name>/`` — the shipped grids write their reports under ``runs/`` and keep the
committed ``cells.csv`` in ``docs/``, so a fresh clone finds them. Each cell trains again in a
scratch work directory (never the grid's own), with the threads a ``--workers N`` grid gives each
of its workers (cores // N; ``--workers`` here, 2 by default), and every column of its summary is
compared with the committed row exactly, but for the wall time and the provenance.

Bit-for-bit equality is expected only on the **same CPU model** (``cpu_model``: vendor, family,
model, stepping) running the same kernels (``cpu_isa``), not merely on the same instruction set:
two CPUs that both report AVX512 (an AMD EPYC, an Intel Xeon) reproduced 18–24 of 39 columns of
three v4 cells. Elsewhere the tool prints the differences and checks what must survive another
machine — the calls: every declared comparison that uses a rerun cell is recomputed with the
rerun's numbers in place of the committed ones, and its call is printed before and after.
``--record FILE`` appends one row per rerun cell (its endpoint committed and rerun, the columns
equal, both CPUs, the calls it touches and moves) for the report's "Reruns" section.

Exit status: 0 when every number equals on the same CPU model, or, on another CPU model, when
every call the rerun cells touch stands; 1 otherwise; 2 on bad input.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"wall_s", "commit", "base_hash", "grid_hash", "cpu_isa", "cpu_model", "cli_set",
        "reused_from", "reused_grid_hash"}  # fmt: skip
RECORD = ("cell", "endpoint", "committed", "rerun", "columns_equal", "columns", "cpu_committed",
          "cpu_rerun", "same_cpu", "calls_touched", "calls_moved", "commit", "when")  # fmt: skip


def _same(a: str, b) -> bool:
    """A CSV text against the rerun's value, as the CSV writer would have written it."""
    if isinstance(b, float) and math.isnan(b):
        return a.lower() == "nan"
    return a == str(b)


def committed_csv(grid) -> Path:
    """Where the grid's committed cells are: ``committed:``, ``out``, ``docs/<name>``."""
    from megatron_p3o.runtime.errors import UserError

    tried = [Path(grid.committed)] if grid.committed else []
    tried += [Path(grid.out), ROOT / "docs" / grid.name]
    for d in tried:
        if (d / "cells.csv").is_file():
            return d / "cells.csv"
    raise UserError(
        "no committed cells: "
        + ", ".join(str(d / "cells.csv") for d in tried)
        + " do not exist (run the grid, or its report, first)"
    )


def calls_of(grid, rows) -> dict:
    """{(setting, arm, comparator): (call, Δ, lo, hi)} of the grid's declared comparisons."""
    if grid.sequential:
        from megatron_p3o.stress.looks import calls

        return {
            (c.setting, c.arm, c.comparator): (x.label, x.delta, x.lo, x.hi)
            for c, x in calls(grid, rows)
            if x is not None
        }
    from megatron_p3o.stress.report import _base_lr, adjust_family, v4_tests

    out = {}
    for _, mm, arm, comp, _, _, t in adjust_family(v4_tests(grid, rows, _base_lr(grid))[0]):
        if t is not None:
            out[(mm, arm, comp)] = (t.verdict(), t.mean, t.lo, t.hi)
    return out


def uses(grid, rows) -> dict:
    """{(setting, arm, comparator): the ids of the cells its data come from}: each side's label on
    the setting (v5: fixed per setting; v4: the rate chosen on the selection seeds) on the seeds
    it is tested on (v4: the test seeds)."""
    if grid.sequential:
        from megatron_p3o.stress.looks import label

        def lab(arm, mm):
            return label(grid, arm, mm)

        seeds = set(grid.sequential.seeds)
    else:
        from megatron_p3o.stress.lr_sweep import chosen_rates
        from megatron_p3o.stress.report import _base_lr

        chosen = chosen_rates(grid, rows, _base_lr(grid))

        def lab(arm, mm):
            return chosen.get((arm, mm))

        seeds = set(grid.lr_select.test_seeds if grid.lr_select else grid.seeds)
    out = {}
    for c in grid.preregistered:
        labels = {lab(c.arm, c.setting), lab(c.comparator, c.setting)}
        out[(c.setting, c.arm, c.comparator)] = {
            r["cell"] for r in rows
            if r["mismatch"] == c.setting and r["objective"] in labels and r["seed"] in seeds
        }  # fmt: skip
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grid")
    ap.add_argument("--cells", nargs="*", default=[], help="cell ids (objective__setting__sN)")
    ap.add_argument("--random", type=int, default=0, help="this many cells drawn at random")
    ap.add_argument("--draw-seed", type=int, default=None, help="seed of the random draw")
    ap.add_argument(
        "--workers", type=int, default=2, help="the --workers the grid ran with (threads)"
    )
    ap.add_argument("--record", default=None, metavar="FILE", help="append the reruns to FILE")
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
    from megatron_p3o.stress.study import read_cells

    grid = load_grid(a.grid)
    csv_path = committed_csv(grid)
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
    print(f"committed cells: {csv_path}")
    init_distributed()
    work = tempfile.mkdtemp(prefix="rerun_cells_")
    grid = replace(grid, work=work, store="")  # never reuse a stored cell: train it again
    endpoint = grid.endpoint
    rows = read_cells(csv_path)
    ok, reran, records = True, {}, []
    for cid in pick:
        cell, want = by_id[cid], committed[cid]
        cfg = cell_config(grid, cell, 1)
        got = run_cell(grid, cell, cfg, 0, provenance=provenance(a.grid, cfg.model.checkpoint))
        reran[cid] = got
        # an empty field: a column the committed cell's code did not record yet (the CSV is
        # the union of every cell's columns), not a difference
        cols = [k for k in want if k not in SKIP and k in got and want[k] != ""]
        unrecorded = [k for k in want if k not in SKIP and k in got and want[k] == ""]
        diff = [k for k in cols if not _same(want[k], got[k])]
        same_base = want.get("base_hash") == got["base_hash"]
        cpu_then = want.get("cpu_model") or f"unrecorded ({want.get('cpu_isa', '?')})"
        same_cpu = cpu_then == got["cpu_model"] and want.get("cpu_isa") == got["cpu_isa"]
        print(
            f"{cid}: {len(cols) - len(diff)}/{len(cols)} columns equal"
            f"  {endpoint} {want.get(endpoint)} vs {got.get(endpoint)}"
            f"  (base {'same' if same_base else 'DIFFERENT'}; CPU {cpu_then}"
            f" {want.get('cpu_isa', '?')} vs {got['cpu_model']} {got['cpu_isa']})"
        )
        if unrecorded:
            print(f"    not recorded by the committed cell: {', '.join(unrecorded)}")
        for k in diff[:8]:
            print(f"    {k}: committed {want[k]}  rerun {got[k]}")
        if diff and not (same_base and same_cpu):
            print("    (another base model or CPU model: bit-for-bit equality is not promised)")
        ok = ok and (not diff or not same_cpu)
        records.append(
            {"cell": cid, "endpoint": endpoint, "committed": want.get(endpoint),
             "rerun": got.get(endpoint), "columns_equal": len(cols) - len(diff),
             "columns": len(cols), "cpu_committed": f"{cpu_then} {want.get('cpu_isa', '?')}",
             "cpu_rerun": f"{got['cpu_model']} {got['cpu_isa']}",
             "same_cpu": same_cpu, "commit": got["commit"],
             "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
        )  # fmt: skip
    moved = _calls_check(grid, rows, reran)
    for r in records:
        mine = [k for k in moved if r["cell"] in moved[k][2]]
        r["calls_touched"] = len(mine)
        r["calls_moved"] = sum(1 for k in mine if moved[k][0] != moved[k][1])
    stood = all(before == after for before, after, _ in moved.values())
    other_cpu = any(not r["same_cpu"] for r in records)
    if other_cpu:
        ok = ok and stood
    if a.record:
        _append(Path(a.record), records)
        print(f"recorded: {a.record}")
    print(f"scratch work directory: {work}")
    return 0 if ok else 1


def _calls_check(grid, rows, reran) -> dict:
    """{comparison: (call before, call with the rerun numbers, the rerun cells it uses)};
    printed."""
    if not grid.preregistered:
        return {}
    data = uses(grid, rows)
    hit = [k for k, ids in data.items() if ids & set(reran)]
    if not hit:
        print("no declared comparison uses these cells")
        return {}
    swapped = [{**r, **reran[r["cell"]]} if r["cell"] in reran else r for r in rows]
    before, after = calls_of(grid, rows), calls_of(grid, swapped)
    out = {}
    for key in hit:
        b, f = before.get(key), after.get(key)
        if b is None or f is None:
            continue
        out[key] = (b[0], f[0], sorted(data[key] & set(reran)))
        verb = "stands" if b[0] == f[0] else "MOVES"
        print(
            f"call {key[0]} {key[1]} − {key[2]}: {b[0]} (Δ {b[1]:+.4f} [{b[2]:+.4f}, {b[3]:+.4f}])"
            f" → with the rerun cells {f[0]} (Δ {f[1]:+.4f} [{f[2]:+.4f}, {f[3]:+.4f}]): {verb}"
        )
    return out


def _append(path: Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.is_file()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RECORD, restval="")
        if new:
            w.writeheader()
        w.writerows(records)


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "tools/rerun_cells.py")
