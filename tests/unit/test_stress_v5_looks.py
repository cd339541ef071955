"""Stress study v5's tool (issue 54): a sequential grid's looks — which cells each look adds,
only where a declared comparison is undecided — resumed from committed cells on a fresh clone;
``calls.csv``; the endpoint averaged over evaluations; the CPU model in the provenance;
``tools/rerun_cells.py`` finding the committed cells; one-line errors before any worker starts;
figures with one colour per arm and no library warning on a user's console."""

import csv
import importlib.util
import warnings
from pathlib import Path

import pytest

from megatron_p3o.runtime.errors import ConfigError, UserError
from megatron_p3o.stress import runner
from megatron_p3o.stress.grid import load_grid
from megatron_p3o.stress.looks import CALLS_COLUMNS, calls_rows, next_look, states

ROOT = Path(__file__).resolve().parents[2]
LABELS = {"p3o": "p3o@lr1e-4", "tis": "tis@lr3e-4", "grpo": "grpo@lr1e-4"}


def _grid(tmp_path, extra="", committed=None, sequential=None):
    objs = (
        "  p3o@lr1e-4: {objective: p3o, set: {optim.lr: 1.0e-4}}\n"
        "  tis@lr3e-4: {objective: tis, set: {optim.lr: 3.0e-4}}\n"
        "  grpo@lr1e-4: {objective: grpo, set: {optim.lr: 1.0e-4}}\n"
    )
    labels = ", ".join(LABELS.values())
    seq = sequential or "{seeds: [11, 12, 13, 14, 15, 16, 17, 18], looks: [4, 8], alpha: 0.05}"
    p = tmp_path / "v5.yaml"
    p.write_text(
        f"name: v5t\nbase: recipes/tiny_cpu.yaml\nout: {tmp_path / 'out'}\n"
        f"work: {tmp_path / 'work'}\n"
        + (f"committed: {committed}\n" if committed else "")
        + "set: {steps: 30}\nendpoint_steps: [26, 28, 30]\n"
        f"objectives:\n{objs}"
        "mismatch:\n"
        f"  bf16: {{family: baseline, objectives: [{labels}]}}\n"
        f"  noise: {{family: logit_noise, level: 0.9, objectives: [{labels}]}}\n"
        f"sequential: {seq}\n"
        "equivalence_margin: 0.02\n"
        "preregistered:\n"
        "  - {setting: bf16, arm: tis}\n  - {setting: bf16, arm: grpo}\n"
        "  - {setting: noise, arm: tis}\n  - {setting: noise, arm: grpo}\n" + extra
    )
    return p


# planted truths per (arm, setting): tis on noise far ahead (decided at look 1); grpo on bf16
# the same as P3O to ±0.001 (equivalent); the other two noisy near zero (undecided)
TRUTH = {("tis", "noise"): 0.30, ("grpo", "bf16"): 0.0, ("tis", "bf16"): 0.0,
         ("grpo", "noise"): 0.01}  # fmt: skip
NOISE = {("tis", "noise"): 0.01, ("grpo", "bf16"): 0.0005, ("tis", "bf16"): 0.08,
         ("grpo", "noise"): 0.08}  # fmt: skip
WOBBLE = {11: 1, 12: -1, 13: 0.5, 14: -0.5, 15: 1.5, 16: -1.5, 17: 0.2, 18: -0.2}


def _rows(seeds, arms=("p3o", "tis", "grpo"), settings=("bf16", "noise")):
    out = []
    for mm in settings:
        for arm in arms:
            for s in seeds:
                acc = 0.5 + (0 if arm == "p3o" else TRUTH[(arm, mm)])
                if arm != "p3o":
                    acc += NOISE[(arm, mm)] * WOBBLE[s] * (1 if arm == "tis" else -1)
                out.append({"cell": f"{LABELS[arm]}__{mm}__s{s}", "objective": LABELS[arm],
                            "mismatch": mm, "family": "x", "level": 0.0, "seed": s,
                            "status": "ok", "steps": 30, "acc_end": acc, "acc_mean_end": acc,
                            "acc_start": 0.478, "acc_delta": acc - 0.478, "ess_mean": 0.9,
                            "wall_s": 1.0})  # fmt: skip
    return out


def test_looks_add_seeds_only_where_a_comparison_is_undecided(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    g = load_grid(_grid(tmp_path))
    assert g.v5 and g.endpoint == "acc_mean_end" and g.seeds == list(range(11, 19))
    k, todo = next_look(g, [])
    assert k == 0 and len(todo) == 3 * 2 * 4 and {c.seed for c in todo} == {11, 12, 13, 14}
    first = _rows([11, 12, 13, 14])
    st = {(c.setting, c.arm): call for c, call, _ in states(g, first)}
    assert st[("noise", "tis")].call == "better" and st[("noise", "tis")].look == 1
    assert st[("bf16", "grpo")].call == "equivalent"
    assert st[("bf16", "tis")].call == "undecided" and not st[("bf16", "tis")].final
    k, todo = next_look(g, first)
    # look 2: TIS and P3O on bf16, GRPO and P3O on noise, seeds 15-18; not the decided arms
    assert k == 1 and {(c.objective, c.mismatch) for c in todo} == {
        ("p3o@lr1e-4", "bf16"), ("tis@lr3e-4", "bf16"),
        ("p3o@lr1e-4", "noise"), ("grpo@lr1e-4", "noise"),
    }  # fmt: skip
    assert {c.seed for c in todo} == {15, 16, 17, 18}
    both = first + [r for r in _rows([15, 16, 17, 18]) if any(r["cell"] == c.id for c in todo)]
    assert next_look(g, both) == (None, [])
    rows = calls_rows(g, both)
    assert tuple(rows[0]) == CALLS_COLUMNS
    assert list(CALLS_COLUMNS[:9]) == [
        "setting", "arm", "look", "test_seeds", "delta", "ci_lo", "ci_hi", "p_adjusted", "call"
    ]  # fmt: skip
    by = {(r["setting"], r["arm"]): r for r in rows}
    assert by[("noise", "tis")]["look"] == 1 and by[("noise", "tis")]["test_seeds"] == 4
    assert by[("bf16", "tis")]["call"] == "undecided at cap" and by[("bf16", "tis")]["look"] == 2
    assert int(by[("bf16", "tis")]["seeds_needed"]) > 8


def test_a_fresh_clone_resumes_from_the_committed_cells(tmp_path, monkeypatch):
    """The committed cells.csv counts as finished cells: with no local work directory the next
    look is the one after the committed ones, and the report rewrites calls.csv."""
    from megatron_p3o.stress.report import write_csv, write_report

    monkeypatch.chdir(ROOT)
    committed = tmp_path / "docs_v5"
    committed.mkdir()
    write_csv(committed / "cells.csv", _rows([11, 12, 13, 14]))
    g = load_grid(_grid(tmp_path, committed=committed))
    from megatron_p3o.stress.grid import cells

    done = [runner.finished(g, c) for c in cells(g)]
    rows = [r for r in done if r is not None]
    assert len(rows) == 24 and not (tmp_path / "work").exists()
    k, todo = next_look(g, rows)
    assert k == 1 and len(todo) == 16
    md = write_report(g, rows, {}, 60.0, "v5.yaml").read_text()
    assert "repeated confidence interval" in md and "| noise | tis − p3o | 1 | 4 |" in md
    got = list(csv.DictReader(open(tmp_path / "out" / "calls.csv")))
    assert [r["call"] for r in got].count("better") == 1 and len(got) == 4


@pytest.mark.parametrize(
    "extra,seq,msg",
    [
        ("lr_select: {seeds: [11], test_seeds: [12]}\n", None, "exclude each other"),
        ("", "{seeds: [11, 12], looks: [4, 8]}", "distinct seeds needed"),
        ("", "{seeds: [11, 12, 13, 14, 15, 16, 17, 18], looks: [8, 4]}", "increasing"),
        ("", "{seeds: [11, 12, 13, 14, 15, 16, 17, 18], looks: [4, 8], spending: x}", "spending"),
    ],
)
def test_a_sequential_grid_is_checked(tmp_path, monkeypatch, extra, seq, msg):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=msg):
        load_grid(_grid(tmp_path, extra=extra, sequential=seq))


def test_an_arm_must_have_one_rate_per_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    p = _grid(tmp_path)
    text = p.read_text().replace(
        "  grpo@lr1e-4: {objective: grpo, set: {optim.lr: 1.0e-4}}\n",
        "  grpo@lr1e-4: {objective: grpo, set: {optim.lr: 1.0e-4}}\n"
        "  grpo@lr3e-4: {objective: grpo, set: {optim.lr: 3.0e-4}}\n",
    )
    text = text.replace("grpo@lr1e-4]}\n  noise", "grpo@lr1e-4, grpo@lr3e-4]}\n  noise")
    p.write_text(text)
    with pytest.raises(ConfigError, match="exactly one"):
        load_grid(p)


def test_the_shipped_v5_grid_loads_and_its_first_look_is_affordable(monkeypatch):
    """The pre-registered grid: every cell a valid recipe, every declared arm one rate per
    setting, and the first look's cells the plan counts."""
    from megatron_p3o.stress.grid import cell_config, cells

    monkeypatch.chdir(ROOT)
    g = load_grid(ROOT / "recipes/stress_v5_tiny_cpu.yaml")
    assert g.sequential and g.committed == "docs/stress_v5_tiny_cpu"
    assert not set(g.seeds) & set(range(1, 9)) and not set(g.seeds) & set(range(901, 909))
    for c in cells(g)[:: max(1, len(cells(g)) // 40)]:
        cell_config(g, c)  # validated as a full TrainConfig
    k, todo = next_look(g, [])
    settings = {c.setting for c in g.preregistered}
    assert k == 0 and len(todo) == 4 * len(settings) * g.sequential.looks[0]
    chain = load_grid(ROOT / "recipes/stress_v5_chain_tiny_cpu.yaml")
    assert chain.sequential and not set(chain.seeds) & (set(g.seeds) | set(range(1, 9)))
    cell_config(chain, cells(chain)[0])
    assert len(next_look(chain, [])[1]) == 4 * 2 * chain.sequential.looks[0]


def test_the_cpu_model_names_the_part(tmp_path):
    from megatron_p3o.stress.provenance import cpu_model, mixed

    f = tmp_path / "cpuinfo"
    f.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
        "model name\t: Intel(R) Xeon(R) Platinum 8480+\nstepping\t: 8\n\n"
        "processor\t: 1\nvendor_id\t: GenuineIntel\n"
    )
    assert (
        cpu_model(f)
        == "Intel(R) Xeon(R) Platinum 8480+ (GenuineIntel family 6 model 143 stepping 8)"
    )
    a = [{"cell": "a", "cpu_isa": "AVX512", "cpu_model": "AMD EPYC (x)"}]
    b = [{"cell": "b", "cpu_isa": "AVX512", "cpu_model": "Intel Xeon (y)"}]
    (msg,) = mixed(a + b)
    assert "2 CPU models" in msg


def _rerun_tool():
    spec = importlib.util.spec_from_file_location("rerun_cells", ROOT / "tools/rerun_cells.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rerun_cells_finds_the_committed_cells_of_a_fresh_clone(tmp_path, monkeypatch):
    """The shipped grids write their reports under runs/ and commit their cells in docs/."""
    import dataclasses

    monkeypatch.chdir(ROOT)
    tool = _rerun_tool()
    g = dataclasses.replace(
        load_grid(ROOT / "recipes/stress_v4_tiny_cpu.yaml"), out=str(tmp_path / "nothing")
    )
    assert tool.committed_csv(g) == ROOT / "docs/stress_v4_tiny_cpu/cells.csv"
    with pytest.raises(UserError, match="no committed cells"):
        tool.committed_csv(dataclasses.replace(g, name="nope"))


def test_a_missing_base_is_one_line_before_any_worker_starts(tmp_path, monkeypatch, capsys):
    from megatron_p3o.stress.__main__ import main

    monkeypatch.chdir(ROOT)
    smoke = ROOT / "recipes/stress_smoke_cpu.yaml"
    with pytest.raises(UserError, match="checkpoint directory .*/nope/ckpt does not exist"):
        main([str(smoke), "--workers", "2", "--out", str(tmp_path / "o"),
              "--set", f"model.checkpoint={tmp_path / 'nope' / 'ckpt'}"])  # fmt: skip
    assert not (tmp_path / "o" / "cells").exists()  # no worker was started


def test_figures_one_colour_per_arm_and_no_warning_for_one_setting(tmp_path, monkeypatch):
    from megatron_p3o.stress.plots import arm_styles, plot_acc_vs_measured, plot_final_vs_level

    monkeypatch.chdir(ROOT)
    v4 = load_grid(ROOT / "recipes/stress_v4_tiny_cpu.yaml")
    st = arm_styles(v4)
    assert len(set(st.values())) == len(v4.objectives)  # no two labels alike
    for label, (colour, _) in st.items():
        same_arm = [k for k in st if k.split("@")[0] == label.split("@")[0]]
        assert {st[k][0] for k in same_arm} == {colour}  # one colour per arm
    assert {ls for _, ls in st.values()} == {"-", "--"}  # one style per rate
    smoke = load_grid(ROOT / "recipes/stress_smoke_cpu.yaml")  # one setting, one seed
    rows = [
        {"cell": f"{o}__bf16__s1", "objective": o, "mismatch": "bf16", "seed": 1,
         "status": "ok", "acc_end": 0.5, "abs_diff_run": 0.01}
        for o in smoke.objectives
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any library warning fails the test
        plot_acc_vs_measured(tmp_path, smoke, rows)
        plot_final_vs_level(tmp_path, smoke, rows)


def test_the_probe_levels_come_from_a_v5_studys_calls(tmp_path, monkeypatch):
    """tools/verdict_levels.py reads a sequential study's calls.csv (issue 54, item 9's input):
    P3O failed where an arm is called better, the arm failed where it is called worse."""
    from megatron_p3o.stress.report import write_csv, write_report

    monkeypatch.chdir(ROOT)
    rows = [{**r, "probe_abs_dlogp": 0.3, "probe_abs_seq_dlogp": 0.8, "probe_kl_b_theta": 0.1}
            for r in _rows([11, 12, 13, 14, 15, 16, 17, 18])]  # fmt: skip
    committed = tmp_path / "docs_v5"
    committed.mkdir()
    write_csv(committed / "cells.csv", rows)
    g = load_grid(_grid(tmp_path, committed=committed))
    write_report(g, rows, {}, 60.0, "v5.yaml")
    spec = importlib.util.spec_from_file_location("vl", ROOT / "tools/verdict_levels.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    (bf16, noise) = tool.levels_v5(str(_grid(tmp_path, committed=committed)), tmp_path / "out")
    assert noise["calls"]["tis"] == "better" and "p3o" in noise["failed"]
    assert bf16["calls"]["grpo"] == "equivalent"
    # one meaning of held (issue 65): GRPO called equivalent held; TIS undecided at the cap, so
    # P3O (held only when every arm is called equivalent or worse) is undecided, not held
    assert bf16["held"] == ("grpo",) and set(bf16["undecided"]) == {"p3o", "tis"}
    assert bf16["per_token"] == 0.3


def test_rerun_cells_knows_which_calls_a_cell_touches_and_the_wall_time_log_merges(
    tmp_path, monkeypatch
):
    import json

    from megatron_p3o.stress.provenance import GRID_RUNS, merged_runs

    monkeypatch.chdir(ROOT)
    g = load_grid(_grid(tmp_path))
    rows = _rows([11, 12, 13, 14])
    tool = _rerun_tool()
    uses = tool.uses(g, rows)
    assert "p3o@lr1e-4__noise__s12" in uses[("noise", "tis", "p3o")]
    assert "tis@lr3e-4__noise__s12" not in uses[("noise", "grpo", "p3o")]
    calls = tool.calls_of(g, rows)
    assert calls[("noise", "tis", "p3o")][0] == "better"
    # the committed log (earlier looks, elsewhere) and this machine's, each line once
    a, b = tmp_path / "committed", tmp_path / "work"
    a.mkdir()
    b.mkdir()
    one = {"finished": "2026-01-01T00:00:00", "wall_s": 10.0, "look": 1}
    two = {"finished": "2026-01-02T00:00:00", "wall_s": 20.0, "look": 2}
    (a / GRID_RUNS).write_text(json.dumps(one) + "\n")
    (b / GRID_RUNS).write_text(json.dumps(one) + "\n" + json.dumps(two) + "\n")
    assert merged_runs(a, b) == [one, two]
