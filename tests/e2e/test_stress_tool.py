"""The stress tool end to end on a 4-cell grid with two workers: every cell trains, the report,
CSVs and plots are written, a second run skips the finished cells, and a rerun from scratch
reproduces the table exactly."""

import csv
import json
import subprocess
import sys

import pytest
import yaml

from .cli import ENV, ROOT


@pytest.mark.e2e
def test_small_grid_runs_resumes_and_reports(base, tmp_path):
    grid = {
        "name": "mini",
        "base": str(ROOT / "recipes/tiny_cpu.yaml"),
        "out": str(tmp_path / "out"),
        "work": str(tmp_path / "work"),
        "eval_limit": 20,
        "probe_prompts": 16,
        "seeds": [1],
        "set": {
            "steps": 2,
            "batch.prompts_per_rollout": 8,
            "data.eval_every": 0,
            "checkpoint.every": 0,
            "optim.log_update_size": True,
            # a long run's curves: eval sets at the base weights, every step and at the end;
            # the reference model for the KL to it
            "reference.enabled": True,
            "eval.every": 1,
            "eval.sets": {
                "h": {"path": str(base / "heldout.jsonl"), "n": 2, "k": [1, 2], "limit": 8}
            },
            "model.checkpoint": str(base / "ckpt"),
            "data.path": str(base / "train.jsonl"),
            "data.eval_path": str(base / "heldout.jsonl"),
        },
        "objectives": {"p3o": {"objective": "p3o"}, "tis": {"objective": "tis"}},
        "mismatch": {
            "bf16": {"family": "baseline", "level": 0, "set": {}},
            "noise": {
                "family": "logit_noise",
                "level": 1.0,
                "set": {"rollout.logit_noise": 1.0},
            },
        },
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    cmd = [sys.executable, "-m", "megatron_p3o.stress", str(path), "--workers", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "out" / "cells.csv")))
    assert sorted(x["cell"] for x in rows) == [
        "p3o__bf16__s1",
        "p3o__noise__s1",
        "tis__bf16__s1",
        "tis__noise__s1",
    ]
    assert all(x["status"] == "ok" and x["steps"] == "2" for x in rows)
    # the invocation's wall time is logged, copied next to the report and stated in it
    logged = [
        json.loads(x) for x in (tmp_path / "out" / "grid_runs.jsonl").read_text().splitlines()
    ]
    assert len(logged) == 1 and logged[0]["cells_run"] == 4 and logged[0]["workers"] == 2
    assert "measured wall time" in (tmp_path / "out" / "report.md").read_text()
    noisy = {x["objective"]: x for x in rows if x["mismatch"] == "noise"}
    clean = {x["objective"]: x for x in rows if x["mismatch"] == "bf16"}
    for o in noisy:  # engine logit noise: a measured mismatch far above bf16's, lower e_B
        assert float(noisy[o]["ess_mean"]) < float(clean[o]["ess_mean"])
        assert float(noisy[o]["abs_diff_first"]) > 10 * float(clean[o]["abs_diff_first"])
        for k in ("probe_abs_dlogp", "probe_abs_seq_dlogp", "probe_kl_b_theta"):
            assert float(noisy[o][k]) > 10 * float(clean[o][k]) > 0, (k, noisy[o][k], clean[o][k])
    # the probe is exogenous: measured before training, it is the setting's, not the objective's
    for setting in (noisy, clean):
        probes = {tuple(x[k] for k in x if k.startswith("probe_")) for x in setting.values()}
        assert len(probes) == 1, probes
    for f in (
        "report.md",
        "steps.csv",
        "reward_vs_step.png",
        "ess_vs_step.png",
        "ratio_hist.png",
        "final_acc_vs_mismatch.png",
        "acc_vs_measured_mismatch.png",
        "entropy_vs_step.png",
    ):
        assert (tmp_path / "out" / f).stat().st_size > 0, f
    report = (tmp_path / "out" / "report.md").read_text()
    assert "mean Δ [95% t-CI]" in report and "| bf16 | P3O − tis |" in report
    # the mechanisms: clip share a fraction, an update under Adam (lr 2e-4 per coordinate: a
    # relative size well below 1), the policy's entropy, one table row per setting × objective
    for x in rows:
        assert 0.0 <= float(x["grad_clipped_run"]) <= 1.0
        assert 0.0 < float(x["update_rel_run"]) < 0.1 and float(x["update_norm_run"]) > 0
        assert float(x["entropy_first5"]) > 0
    assert "## Mechanisms" in report and "| noise | tis |" in report
    for x in rows:  # the eval set's last point, and the KL to the (initial-policy) reference
        assert 0.0 <= float(x["h_pass@1_mean_end"]) <= float(x["h_pass@2_end"]) <= 1.0
        assert float(x["kl_ref_last5"]) > 0 and float(x["completion_len_last5"]) >= 1
    assert "## Long runs" in report and (tmp_path / "out" / "eval_curves.png").stat().st_size
    cell = json.loads((tmp_path / "work" / "p3o__bf16__s1" / "cell.json").read_text())
    assert len(cell["final_per_prompt"]) == 20 and cell["opt_steps"] == 2
    assert [p["step"] for p in cell["eval_curve"]] == [0, 1, 2]
    marks = {p: p.stat().st_mtime_ns for p in (tmp_path / "work").glob("*/cell.json")}
    again = subprocess.run(cmd + ["--list"], capture_output=True, text=True, env=ENV, timeout=600)
    assert again.stdout.count("done ") == 4 and "0 to run" in again.stdout
    rerun = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in marks} == marks  # finished cells are not rerun
    assert json.loads(next(iter(marks)).read_text())["status"] == "ok"
    # a rerun from scratch (same --workers) reproduces every number but the wall time
    import shutil

    first = (tmp_path / "out" / "cells.csv").read_text()
    shutil.rmtree(tmp_path / "work")
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    def table(text):
        rows = list(csv.DictReader(text.splitlines()))
        return [{k: v for k, v in x.items() if k != "wall_s"} for x in rows]

    assert table((tmp_path / "out" / "cells.csv").read_text()) == table(first)
    # tools/rerun_cells.py: one cell again from scratch equals its committed row, every column
    tool = [sys.executable, str(ROOT / "tools/rerun_cells.py"), str(path)]
    r = subprocess.run(
        tool + ["--cells", "tis__noise__s1"], capture_output=True, text=True, env=ENV, timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("tis__noise__s1:")]
    n = line.split()[1]
    assert n.split("/")[0] == n.split("/")[1] and int(n.split("/")[0]) > 30, line
    bad = subprocess.run(tool + ["--cells", "nope"], capture_output=True, text=True, env=ENV)
    assert bad.returncode == 2 and "nope" in bad.stderr and "Traceback" not in bad.stderr


def _stress(*args, timeout=600):
    cmd = [sys.executable, "-m", "megatron_p3o.stress", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.e2e
def test_help_shows_the_whole_description_and_the_prog():
    from megatron_p3o.stress import __main__ as tool

    r = _stress("--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage: python -m megatron_p3o.stress ")
    first = tool.description(tool.__doc__)
    assert first.endswith("and the plots.") and _words(first) in _words(r.stdout)
    for flag in ("--out DIR", "--set KEY=VALUE", "--workers", "--list", "--report-only"):
        assert flag in r.stdout, flag
    # the serving CLI the Slurm script runs: its description is a whole sentence, not a cut line
    serve = [sys.executable, "-m", "megatron_p3o.cli.serve", "--help"]
    s = subprocess.run(serve, capture_output=True, text=True, env=ENV, timeout=300)
    assert s.returncode == 0, s.stderr[-2000:]
    assert "for a batch script that places them on other nodes" in _words(s.stdout)


@pytest.mark.e2e
def test_out_and_set_and_docs_are_never_written_unasked(tmp_path, monkeypatch):
    """Where cells and reports go (the shipped grids' committed reports in docs/ only with an
    explicit --out), and what --set changes, checked on the shipped grids without running."""
    from megatron_p3o.runtime.errors import ConfigError
    from megatron_p3o.stress import __main__ as tool
    from megatron_p3o.stress.grid import cell_config, cells, load_grid

    monkeypatch.chdir(ROOT)
    shipped = sorted(ROOT.glob("recipes/stress_*.yaml"))
    assert len(shipped) > 5
    for path in shipped:  # no shipped grid writes into docs/ by default
        grid, where = tool.resolve(load_grid(path))
        assert not tool.in_docs(grid.out) and not tool.in_docs(grid.work), (path, where)
    tiny = load_grid(ROOT / "recipes/stress_tiny_cpu.yaml")
    assert tool.in_docs(tiny.out)  # the committed report...
    grid, where = tool.resolve(tiny)
    assert grid.out == "runs/stress_tiny_cpu/report" and grid.work == tiny.work
    assert f"--out {tiny.out}" in where  # ...says how to replace it
    grid, _ = tool.resolve(tiny, out=tiny.out)  # asked: the report there, the cells in runs/
    assert grid.out == tiny.out and grid.work == tiny.work
    grid, _ = tool.resolve(tiny, out=tmp_path / "mine", sets=["steps=2", "optim.lr=1e-4"])
    assert grid.out == str(tmp_path / "mine") and grid.work == str(tmp_path / "mine" / "cells")
    assert grid.set["steps"] == 2  # a YAML value, as a recipe's
    assert grid.set["batch.prompts_per_rollout"] == 16  # the grid's other keys stay
    by_id = {c.id: c for c in cells(grid)}
    cfg = cell_config(grid, by_id["p3o__fp8__s1"])
    assert cfg.steps == 2 and cfg.optim.lr == 1e-4
    assert cfg.rollout.precision == "fp8_w8a8"  # a setting's own set: still wins
    assert cfg.run.dir == str(tmp_path / "mine" / "cells")
    for bad in ("steps", "=2", "steps=[1"):
        with pytest.raises(ConfigError, match="--set"):
            tool.resolve(tiny, sets=[bad])
    # through the CLI: --list says where things go; a key no recipe has is one line, exit 2
    smoke = ROOT / "recipes/stress_smoke_cpu.yaml"
    r = _stress(smoke, "--list", "--out", tmp_path / "o", "--set", "steps=1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"cells: {tmp_path / 'o' / 'cells'}  report: {tmp_path / 'o'}" in r.stdout
    assert "2 cells, 2 to run" in r.stdout
    r = _stress(smoke, "--list", "--set", "optim.no_such_key=1")
    assert r.returncode == 2 and "no_such_key" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.e2e
def test_smoke_grid_runs_with_out_and_set(base, tmp_path):
    """The shipped smoke grid end to end with --out and --set (the test's base model, 2 steps);
    a later invocation with other --set items is refused instead of mixing cells."""
    smoke = ROOT / "recipes/stress_smoke_cpu.yaml"
    sets = [
        f"model.checkpoint={base / 'ckpt'}",
        f"data.path={base / 'train.jsonl'}",
        f"data.eval_path={base / 'heldout.jsonl'}",
        "steps=2",
    ]
    flags = [x for s in sets for x in ("--set", s)]
    out = tmp_path / "smoke"
    r = _stress(smoke, "--out", out, "--workers", "2", *flags)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "cells.csv")))
    assert sorted(x["cell"] for x in rows) == ["grpo__bf16__s1", "p3o__bf16__s1"]
    assert all(x["status"] == "ok" and x["steps"] == "2" for x in rows)
    assert all(x["cli_set"] == " ".join(sets) for x in rows)
    assert (out / "cells" / "p3o__bf16__s1" / "cell.json").is_file()
    assert (out / "report.md").stat().st_size and (out / "reward_vs_step.png").stat().st_size
    assert "--set steps=2" in (out / "report.md").read_text().splitlines()[2]
    again = _stress(smoke, "--out", out, "--report-only", *flags[:-2])
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert "was run with --set" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.e2e
def test_a_cell_of_the_store_is_reused_and_equals_a_fresh_run(base, tmp_path):
    """The cells' store for real: grid A trains a cell and files it; grid B (another name, label
    and work directory, same store) reuses it without training; grid C (no store) trains the same
    cell again, and its record equals B's reused one in every column but the wall time and the
    labels — the resolved config, not the grid, decides the numbers."""

    def grid(name, label, store=True):
        g = {
            "name": name,
            "base": str(ROOT / "recipes/tiny_cpu.yaml"),
            "out": str(tmp_path / name / "out"),
            "work": str(tmp_path / name / "work"),
            "eval_limit": 20,
            "seeds": [1],
            "set": {
                "steps": 2,
                "batch.prompts_per_rollout": 8,
                "data.eval_every": 0,
                "checkpoint.every": 0,
                "model.checkpoint": str(base / "ckpt"),
                "data.path": str(base / "train.jsonl"),
                "data.eval_path": str(base / "heldout.jsonl"),
            },
            "objectives": {label: {"objective": "p3o"}},
            "mismatch": {"bf16": {"family": "baseline", "level": 0, "set": {}}},
        }
        if store:  # across commits: other edits of the tree between the runs keep the key
            g.update(store=str(tmp_path / "store"), store_across_commits=True)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(g))
        return path

    runs = {}
    for name, label, store in (("a", "p3o", True), ("b", "p3o_b", True), ("c", "p3o_b", False)):
        r = _stress(grid(name, label, store))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        runs[name] = r.stdout
        cell = f"{label}__bf16__s1"
        runs[name + "_rec"] = json.loads(
            (tmp_path / name / "work" / cell / "cell.json").read_text()
        )
    assert "p3o__bf16__s1: ok" in runs["a"] and "p3o_b__bf16__s1: ok" not in runs["b"]
    assert "p3o_b__bf16__s1: ok" in runs["c"]  # trained again without the store
    a, b, c = runs["a_rec"], runs["b_rec"], runs["c_rec"]
    assert b["reused_from"].startswith(str(tmp_path / "a" / "work" / "p3o__bf16__s1"))
    assert "reused_from" not in a and "reused_from" not in c
    assert len(list((tmp_path / "store").iterdir())) == 1
    labels = ("cell", "objective", "wall_s", "grid_hash", "reused_from", "reused_grid_hash",
              "reused_grid_commit")  # fmt: skip
    assert {k: v for k, v in b.items() if k not in labels} == {
        k: v for k, v in a.items() if k not in labels
    }
    assert {k: v for k, v in b.items() if k not in labels} == {
        k: v for k, v in c.items() if k not in labels
    }
    assert b["final_per_prompt"] and b["steps"] == 2
    rows = list(csv.DictReader(open(tmp_path / "b" / "out" / "cells.csv")))
    assert rows[0]["reused_from"] and (tmp_path / "b" / "out" / "steps.csv").stat().st_size
