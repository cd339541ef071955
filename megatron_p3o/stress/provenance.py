"""Where a stress cell's numbers come from: the code's commit, the base model's hash, the grid
file's hash, the CPU's vector instruction set and its model, recorded in every ``cell.json`` so
that a report can refuse to mix them silently.

Why: a grid resumes cell by cell over days; cells of another commit (or of another base model,
re-made on another CPU) would otherwise be averaged with the rest without a trace. The
instruction set decides which kernels run, but not everything about their rounding: two CPUs
that both report AVX512 (an AMD EPYC and an Intel Xeon) gave 18–24 of 39 columns equal for the
same v4 cells (issue 54). So a cell is expected to reproduce bit for bit only on the same
``cpu_model`` (vendor, family, model, stepping), and what must hold elsewhere is the calls, not
the bits (``tools/rerun_cells.py``).
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Dict, List

_ROOT = Path(__file__).resolve().parents[2]


def code_commit(root: str | Path = _ROOT) -> str:
    """``git rev-parse HEAD`` of this checkout, ``+dirty`` when tracked files outside ``docs/``
    differ; "unknown" outside a git checkout (an installed package). ``docs/`` is left out: the
    grids write their reports there, and a regenerated report is not a change of the code."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
            timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", ".",
             ":(exclude)docs"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


# torch.distributed.checkpoint's index: it records a random ``save_id`` of every save, so the
# same weights saved twice differ there (the shards and common.pt hold the weights)
_PER_SAVE = {".metadata"}


def tree_hash(path: str | Path) -> str:
    """sha256 (first 16 hex digits) over the relative names and bytes of every file under
    ``path`` (a checkpoint directory, less the per-save ``.metadata`` index) or of the file
    itself; "missing" when it does not exist."""
    p = Path(path)
    if not p.exists():
        return "missing"
    h = hashlib.sha256()
    files = (
        [p]
        if p.is_file()
        else sorted(f for f in p.rglob("*") if f.is_file() and f.name not in _PER_SAVE)
    )
    for f in files:
        h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def cpu_isa() -> str:
    """The widest x86 vector extension torch's CPU kernels use here (``torch.backends.cpu.
    get_cpu_capability()``: "AVX512", "AVX2", "DEFAULT", or the ARM equivalent)."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's model as the kernel names it, with what tells two parts of one name apart:
    ``AMD EPYC (AuthenticAMD family 25 model 17 stepping 1)``; the platform's processor string
    where there is no /proc/cpuinfo (macOS), else "unknown"."""
    import platform

    fields: Dict[str, str] = {}
    try:
        for line in Path(cpuinfo).read_text(errors="replace").splitlines():
            k, sep, v = line.partition(":")
            if not sep:
                if fields:
                    break  # the first processor's block is enough
                continue
            fields.setdefault(k.strip(), v.strip())
    except OSError:
        return platform.processor() or "unknown"
    name = fields.get("model name") or fields.get("Model") or platform.processor() or "unknown"
    ids = [fields.get("vendor_id", "")]
    keys = (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
    ids += [f"{k} {fields[x]}" for k, x in keys if x in fields]
    ids = [i for i in ids if i]
    return f"{name} ({' '.join(ids)})" if ids else name


def grid_commit(grid_path: str | Path, root: str | Path = _ROOT) -> str:
    """The commit that last changed the grid file — for a pre-registered grid, the plan's commit
    (committed together, never edited after a cell ran); ``uncommitted`` when the file differs
    from it or is not tracked, ``unknown`` outside a git checkout."""
    try:
        rel = str(Path(grid_path).resolve().relative_to(Path(root).resolve()))
        last = subprocess.run(
            ["git", "-C", str(root), "log", "-1", "--format=%H", "--", rel],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
        changed = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", rel],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, ValueError, subprocess.SubprocessError):
        return "unknown"
    return "uncommitted" if changed or not last else last


def provenance(grid_path: str | Path, base_checkpoint: str) -> Dict[str, str]:
    return {
        "commit": code_commit(),
        "grid_commit": grid_commit(grid_path),
        "base_hash": tree_hash(base_checkpoint) if base_checkpoint else "none",
        "grid_hash": tree_hash(grid_path),
        "cpu_isa": cpu_isa(),
        "cpu_model": cpu_model(),
    }


def mixed(cells: List[dict]) -> List[str]:
    """One sentence per provenance key whose value differs between the cells (empty: one
    commit, one base model, one grid file)."""
    out = []
    for key, what in (
        ("commit", "commits"),
        ("base_hash", "base models"),
        ("grid_hash", "grid files"),
        ("grid_commit", "grid (plan) commits"),
        ("cpu_isa", "CPU instruction sets"),
        ("cpu_model", "CPU models"),
    ):
        values: Dict[str, List[str]] = {}
        for c in cells:
            values.setdefault(str(c.get(key, "unrecorded")), []).append(c["cell"])
        if len(values) > 1:
            parts = [f"{v} ({len(ids)} cells, e.g. {ids[0]})" for v, ids in sorted(values.items())]
            out.append(f"cells come from {len(values)} {what}: " + "; ".join(parts))
    return out


GRID_RUNS = "grid_runs.jsonl"  # in the grid's work directory, copied next to its report


def log_grid_run(grid, wall_s: float, workers: int, cells_run: int, look=None) -> None:
    """Append one ``--workers`` invocation of ``grid`` (its wall-clock time, the cells it
    finished, where it ran; a sequential grid's ``look``) to ``<work>/grid_runs.jsonl``: a grid
    that resumed over several invocations sums them, and the report states the total as the
    grid's measured wall time."""
    import json
    import time

    line = {
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "wall_s": round(wall_s, 1),
        "workers": workers,
        "cells_run": cells_run,
        "commit": code_commit(),
        "cpu_isa": cpu_isa(),
        "cpu_model": cpu_model(),
        **({} if look is None else {"look": int(look)}),
    }
    Path(grid.work).mkdir(parents=True, exist_ok=True)
    with open(Path(grid.work) / GRID_RUNS, "a") as f:
        f.write(json.dumps(line) + "\n")


def grid_runs(*dirs: str | Path) -> List[dict]:
    """The logged invocations from the first of ``dirs`` that has a log (work, then out)."""
    import json

    for d in dirs:
        f = Path(d) / GRID_RUNS
        if f.is_file():
            return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return []


def merged_runs(*dirs: str | Path) -> List[dict]:
    """Every logged invocation in any of ``dirs`` once (the committed log and this machine's),
    in the order they finished."""
    import json

    seen: Dict[str, dict] = {}
    for d in dirs:
        f = Path(d) / GRID_RUNS
        if f.is_file():
            for x in f.read_text().splitlines():
                if x.strip():
                    r = json.loads(x)
                    seen.setdefault(json.dumps(r, sort_keys=True), r)
    return sorted(seen.values(), key=lambda r: str(r.get("finished", "")))


def wall_text(runs: List[dict]) -> str:
    """ "34.5 min with 2 workers (AVX2)": the grid's measured wall time, "" when none is logged."""
    if not runs:
        return ""
    total = sum(r["wall_s"] for r in runs) / 60
    workers = sorted({r["workers"] for r in runs})
    isas = sorted({r.get("cpu_model", r["cpu_isa"]) for r in runs})
    parts = f"{total:.1f} min with {'/'.join(map(str, workers))} workers ({', '.join(isas)})"
    return parts + (f" over {len(runs)} invocations" if len(runs) > 1 else "")


RERUNS = "reruns.csv"  # tools/rerun_cells.py --record: cells trained again, here or elsewhere


def reruns_section(*dirs: str | Path) -> List[str]:
    """The report's record of reruns (``tools/rerun_cells.py --record``, the first of ``dirs``
    with a ``reruns.csv``): per rerun cell its endpoint committed and rerun, the columns equal,
    both CPU models, and the declared calls it touches and moves."""
    import csv

    f = next((Path(d) / RERUNS for d in dirs if (Path(d) / RERUNS).is_file()), None)
    if f is None:
        return []
    rows = list(csv.DictReader(open(f)))
    lines = [
        "## Reruns: what survives another machine",
        "",
        f"`tools/rerun_cells.py` trained these cells again from scratch (`{RERUNS}`). Bits are "
        "promised only on the same CPU model; elsewhere what must hold is the calls: each "
        "declared comparison that uses a rerun cell was recomputed with the rerun's numbers.",
        "",
        "| cell | endpoint committed → rerun | columns equal | CPU committed → rerun | "
        "calls touched | calls moved |",
        "|---" * 6 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cell']} | {r['committed']} → {r['rerun']} | {r['columns_equal']}/"
            f"{r['columns']} | {r['cpu_committed']} → {r['cpu_rerun']} | "
            f"{r['calls_touched']} | {r['calls_moved']} |"
        )
    same = [r for r in rows if r["same_cpu"] == "True"]
    exact = sum(r["columns_equal"] == r["columns"] for r in same)
    moved = sum(int(r["calls_moved"] or 0) for r in rows)
    diffs = [abs(float(r["rerun"]) - float(r["committed"])) for r in rows
             if r["same_cpu"] != "True" and r["rerun"] not in ("", "nan")]  # fmt: skip
    lines += [
        "",
        f"Same CPU model: {exact} of {len(same)} cells bit for bit. Other CPU models: "
        f"{len(rows) - len(same)} cells"
        + (f", endpoint moved by at most {max(diffs):.3f}" if diffs else "")
        + f"; calls moved by the reruns: {moved}.",
    ]
    return lines
