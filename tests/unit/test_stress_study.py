"""The study summary across grids (stress/study.py) from committed CSVs of synthetic cells with
planted differences, and the measured wall-time log (stress/provenance.py)."""

import math
import statistics
from pathlib import Path

from megatron_p3o.stress.grid import load_grid
from megatron_p3o.stress.provenance import grid_runs, log_grid_run, wall_text
from megatron_p3o.stress.report import write_csv
from megatron_p3o.stress.study import read_cells, write_study

ROOT = Path(__file__).resolve().parents[2]

# planted seed means: P3O falls 0.30 at σ = 0.6 and nowhere else; GRPO and TIS never move
MEANS = {
    "p3o": {"bf16": 0.70, "noise_0.3": 0.70, "noise_0.6": 0.40},
    "grpo": {"bf16": 0.70, "noise_0.3": 0.70, "noise_0.6": 0.70},
    "tis": {"bf16": 0.70, "noise_0.3": 0.70, "noise_0.6": 0.70},
}
OFFSET = {s: 0.01 * ((s * 7) % 5 - 2) for s in range(1, 9)}  # shared by a seed's cells
JITTER = {s: 0.002 * (-1) ** s for s in range(1, 9)}


def _grid(tmp_path, name):
    g = tmp_path / f"{name}.yaml"
    g.write_text(
        f"name: {name}\nbase: recipes/tiny_cpu.yaml\nout: {tmp_path / name}\n"
        f"work: {tmp_path / 'work' / name}\nset: {{optim.lr: 1.0e-4}}\n"
        "objectives: {p3o: {objective: p3o}, grpo: {objective: grpo}, tis: {objective: tis}}\n"
        "mismatch:\n  bf16: {family: baseline}\n"
        "  noise_0.6: {family: logit_noise, level: 0.6}\n"
        "  noise_0.3: {family: logit_noise, level: 0.3}\n"
        "seeds: [1, 2, 3, 4, 5, 6, 7, 8]\ncomparators: [grpo, tis]\n"
    )
    return g


def _cells(jitter_objective="p3o"):
    return [
        {
            "cell": f"{o}__{mm}__s{s}",
            "objective": o,
            "mismatch": mm,
            "family": "x",
            "level": 0.0,
            "seed": s,
            "status": "ok",
            "steps": 30,
            "acc_end": v + OFFSET[s] + (JITTER[s] if mm != "bf16" and o == jitter_objective else 0),
            "wall_s": 60.0,
            "commit": "abcdef1234567",
            "base_hash": "b1",
            "grid_hash": "g1",
            "cpu_isa": "AVX2",
        }  # fmt: skip
        for o, by in MEANS.items()
        for mm, v in by.items()
        for s in OFFSET
    ]


def test_study_summary_from_committed_csvs(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = _grid(tmp_path, "dose")
    grid = load_grid(path)
    cells = _cells()
    Path(grid.out).mkdir(parents=True)
    write_csv(Path(grid.out) / "cells.csv", cells)
    back = read_cells(Path(grid.out) / "cells.csv")
    assert back == cells  # numbers come back as numbers, the seed as an int

    Path(grid.work).mkdir(parents=True)
    log_grid_run(grid, wall_s=60.0, workers=2, cells_run=40)
    log_grid_run(grid, wall_s=120.0, workers=2, cells_run=32)
    runs = grid_runs(grid.work)
    assert [r["cells_run"] for r in runs] == [40, 32]
    assert wall_text(runs).startswith("3.0 min with 2 workers (") and "over 2 invocations" in (
        wall_text(runs)
    )
    (Path(grid.out) / "grid_runs.jsonl").write_text(
        (Path(grid.work) / "grid_runs.jsonl").read_text()
    )

    md = write_study([str(path)], tmp_path / "study.md", "T").read_text()
    assert (
        "| arithmetic | 72 (72) | p3o, grpo, tis | bf16, noise_0.6, noise_0.3 | 8 | 30 | 0.0001 "
        "| 72.0 |" in md
    )
    assert "one commit `abcdef12`, base `b1`, AVX2" in md
    assert "Measured wall time of the 1 grids with a log: 3.0 min in all." in md
    # break points: P3O's first broken level is σ = 0.6 with its planted −0.30; the others never
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line[:2] == "| "}
    assert "**0.6** (-0.30)" in rows["p3o"] and "none (" in rows["grpo"] and "none (" in rows["tis"]
    # calls: the planted −0.30 to GRPO and to TIS are corrected losses; the other 4 tests tie
    calls = [line for line in md.splitlines() if "**loss**" in line or "**win**" in line]
    assert len(calls) == 2 and all("| noise_0.6 | P3O − " in c for c in calls)
    for c in calls:
        assert math.isclose(float(c.split(" | ")[3].split()[0]), 0.40 - 0.70, abs_tol=1e-3), c
    assert "All other 4 paired tests of these grids: **tie**." in md
    # power: 4 of the 6 headline tests have the jitter's s.d., 2 (bf16) have none: median = jitter
    sd = statistics.stdev(JITTER.values())
    assert f"| dose | 8 | 6 | {sd:.3f} | 1.00 | 1.00 | 2 |" in md


def test_a_grid_without_a_report_is_named(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.chdir(ROOT)
    path = _grid(tmp_path, "never_run")
    cmd = [sys.executable, "-m", "megatron_p3o.stress.study", str(path), "--out", "x.md"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "never_run" in r.stderr and "cells.csv" in r.stderr and len(r.stderr.splitlines()) == 1
