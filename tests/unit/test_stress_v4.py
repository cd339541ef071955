"""Stress study v4's statistics and bookkeeping (issue 43): TOST equivalence against an
independent t CDF, one Holm family of superiority and equivalence hypotheses, the study-wide
family declared in the grid files (the rest exploratory), each arm's learning rate chosen on some
seeds and tested on others, and the cells' store."""

import json
import math
import random
from pathlib import Path

import pytest

from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.stress import runner
from megatron_p3o.stress.grid import cells as grid_cells
from megatron_p3o.stress.grid import load_grid, lr_tag
from megatron_p3o.stress.lr_sweep import arm_scores, chosen_rates
from megatron_p3o.stress.report import v4_headline, v4_tests, write_csv
from megatron_p3o.stress.stats import (
    adjust_with_equivalence,
    holm,
    seed_paired,
    t_ppf,
    t_sf1,
    tost_p,
)
from megatron_p3o.stress.study import write_study

ROOT = Path(__file__).resolve().parents[2]


# -- an independent t distribution: Simpson's rule on the density, float64 ----------------------


def _t_density(x: float, df: float) -> float:
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    return c * (1 + x * x / df) ** (-(df + 1) / 2)


def _t_upper(t: float, df: float, n: int = 20000) -> float:
    """P(T ≥ t) = 1/2 − ∫_0^t f (symmetric density), Simpson with n (even) intervals."""
    h = t / n
    s = _t_density(0.0, df) + _t_density(t, df)
    s += sum((4 if i % 2 else 2) * _t_density(i * h, df) for i in range(1, n))
    return 0.5 - s * h / 3


def test_the_reference_integral_matches_the_printed_table():
    # textbook quantiles: the reference itself is right before anything is checked against it
    for q, df, t in ((0.975, 7, 2.364624), (0.95, 3, 2.353363), (0.975, 3, 3.182446)):
        assert _t_upper(t, df) == pytest.approx(1 - q, abs=2e-7)
        assert t_ppf(q, df) == pytest.approx(t, abs=1e-6)


@pytest.mark.parametrize("t,df", [(0.3, 3), (1.7, 7), (-1.2, 7), (2.9, 3), (4.5, 11)])
def test_one_sided_tail_equals_the_integral(t, df):
    ref = _t_upper(t, df) if t >= 0 else 1 - _t_upper(-t, df)
    assert t_sf1(t, df) == pytest.approx(ref, abs=1e-9)


def _stats(d):
    n = len(d)
    m = sum(d) / n
    return m, math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1)), n


def test_tost_is_the_larger_one_sided_p_by_the_integral():
    d = [0.004, -0.006, 0.011, 0.002, -0.003, 0.007, 0.000, 0.005]
    m, sd, n = _stats(d)
    se = sd / math.sqrt(n)
    p_low = _t_upper((m + 0.02) / se, n - 1)  # H0: Δ ≤ −0.02
    p_high = _t_upper((0.02 - m) / se, n - 1)  # H0: Δ ≥ +0.02
    assert tost_p(m, sd, n, 0.02) == pytest.approx(max(p_low, p_high), abs=1e-9)
    # a wider margin is easier to show; a margin inside the mean impossible
    assert tost_p(m, sd, n, 0.05) < tost_p(m, sd, n, 0.02) < 0.05 < tost_p(m, sd, n, 0.001)
    # equivalence at level α ⇔ the (1 − 2α) t-interval lies inside ±margin
    half = t_ppf(0.95, n - 1) * se
    assert (tost_p(m, sd, n, 0.02) < 0.05) == (-0.02 < m - half and m + half < 0.02)


def _test(diffs, margin=0.02):
    a = {s + 1: 0.5 + d for s, d in enumerate(diffs)}
    b = {s + 1: 0.5 for s in range(len(diffs))}
    return seed_paired(a, b, "x", margin=margin)


def test_calls_better_worse_equivalent_inconclusive():
    better = _test([0.10, 0.12, 0.09, 0.11, 0.10, 0.13, 0.08, 0.11])
    worse = _test([-0.10, -0.12, -0.09, -0.11, -0.10, -0.13, -0.08, -0.11])
    same = _test([0.004, -0.006, 0.011, 0.002, -0.003, 0.007, 0.000, 0.005])
    unsure = _test([0.06, -0.05, 0.04, -0.03])  # 4 test seeds, wide: neither
    assert [t.verdict() for t in (better, worse, same, unsure)] == [
        "better",
        "worse",
        "equivalent",
        "inconclusive",
    ]
    # the v3 word stays where it was, and never in a v4 call
    assert unsure.call() == "tie" and "tie" not in {t.verdict() for t in (better, same, unsure)}
    # a tiny, precise difference is both significant and within the margin: called by its sign
    tiny = _test([0.010, 0.011, 0.009, 0.010, 0.011, 0.010, 0.009, 0.010])
    assert tiny.p_t < 1e-6 and tiny.p_tost < 1e-6 and tiny.verdict() == "better"


def test_holm_with_a_logical_bound_by_hand():
    p = [0.01, 0.04, 0.03, 0.005]
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])  # 4·0.005, 3·0.01, 2·0.03, …
    # at most 2 true together: multipliers 2, 2, 2, 1 → 0.01, 0.02, 0.06, max(0.06, 0.04)
    assert holm(p, max_true=2) == pytest.approx([0.02, 0.06, 0.06, 0.01])
    assert holm(p, max_true=10) == holm(p)


def test_one_family_of_superiority_and_equivalence():
    tests = [
        _test([0.10, 0.12, 0.09, 0.11, 0.10, 0.13, 0.08, 0.11]),
        None,  # an untestable comparison keeps its place and is not counted
        _test([0.004, -0.006, 0.011, 0.002, -0.003, 0.007, 0.000, 0.005]),
        _test([0.06, -0.05, 0.04, -0.03]),
    ]
    adj = adjust_with_equivalence(tests)
    assert adj[1] is None
    live = [t for t in tests if t is not None]
    ps = [t.p_t for t in live] + [t.p_tost for t in live]
    want = holm(ps, max_true=3)
    got = [t.p_adj for t in adj if t] + [t.p_tost_adj for t in adj if t]
    assert got == pytest.approx(want)
    # the family's first step multiplies by the number of comparisons (3), not hypotheses (6)
    assert min(got) == pytest.approx(3 * min(ps))
    assert [t.verdict() for t in adj if t] == ["better", "equivalent", "inconclusive"]


def test_the_bounded_family_controls_the_family_wise_error():
    """Simulated: 6 comparisons, 3 with Δ = 0 (superiority null true), 3 with Δ = 0.03 beyond
    the 0.02 margin (equivalence null true): no wrong 'better'/'worse'/'equivalent' call in
    more than ~5% of studies."""
    rng = random.Random(4)
    wrong, studies = 0, 800
    for _ in range(studies):
        tests = [
            _test([delta + rng.gauss(0, 0.03) for _ in range(4)])
            for delta in (0, 0, 0, 0.03, 0.03, 0.03)
        ]
        adj = adjust_with_equivalence(tests)
        bad = any(t.verdict() != "inconclusive" for t in adj[:3])  # Δ = 0: no claim is true
        bad |= any(t.verdict() == "equivalent" for t in adj[3:])
        wrong += bad
    assert wrong / studies < 0.065


# -- grids with a declared family and an lr split -----------------------------------------------


def _v4_grid(tmp_path, name, prereg, lr_select=True, extra=""):
    g = tmp_path / f"{name}.yaml"
    sel = (
        "lr_select: {seeds: [1, 2, 3, 4], test_seeds: [5, 6, 7, 8], lrs: [1e-4, 3e-4]}\n"
        if lr_select
        else "seeds: [1, 2, 3, 4, 5, 6, 7, 8]\n"
    )
    g.write_text(
        f"name: {name}\nbase: recipes/tiny_cpu.yaml\nout: {tmp_path / name}\n"
        f"work: {tmp_path / 'work' / name}\n"
        "objectives: {p3o: {objective: p3o}, grpo: {objective: grpo}, tis: {objective: tis}}\n"
        "mismatch:\n  bf16: {family: baseline}\n  noise: {family: logit_noise, level: 0.6}\n"
        + sel
        + "preregistered:\n"
        + "".join(f"  - {{setting: {s}, arm: {a}, comparator: p3o}}\n" for s, a in prereg)
        + extra
    )
    return g


def test_grid_keys_expand_and_are_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    g = load_grid(_v4_grid(tmp_path, "a", [("bf16", "grpo"), ("noise", "tis")]))
    assert g.v4 and g.seeds == [1, 2, 3, 4, 5, 6, 7, 8]
    assert list(g.objectives) == [
        "p3o@lr1e-4",
        "p3o@lr3e-4",
        "grpo@lr1e-4",
        "grpo@lr3e-4",
        "tis@lr1e-4",
        "tis@lr3e-4",
    ]
    assert g.objectives["grpo@lr3e-4"].set == {"optim.lr": 3e-4}
    assert [(c.setting, c.arm, c.comparator) for c in g.preregistered] == [
        ("bf16", "grpo", "p3o"),
        ("noise", "tis", "p3o"),
    ]
    assert len(grid_cells(g)) == 6 * 2 * 8 and lr_tag(2.5e-4) == "2.5e-4"
    for prereg, extra, msg in (
        ([("nope", "grpo")], "", "not a mismatch label"),
        ([("bf16", "ppo")], "", "not an objective"),
        ([("bf16", "p3o")], "", "arm and comparator"),
        ([("bf16", "grpo"), ("bf16", "grpo")], "", "declared twice"),
        ([("bf16", "grpo")], "equivalence_margin: 0\n", "equivalence_margin"),
    ):
        with pytest.raises(ConfigError, match=msg):
            load_grid(_v4_grid(tmp_path, "bad", prereg, extra=extra))
    bad = tmp_path / "overlap.yaml"
    bad.write_text(
        _v4_grid(tmp_path, "x", [("bf16", "grpo")])
        .read_text()
        .replace("test_seeds: [5, 6, 7, 8]", "test_seeds: [4, 5, 6, 7, 8]")
    )
    with pytest.raises(ConfigError, match="both 'seeds' and 'test_seeds'"):
        load_grid(bad)


# planted: on bf16 GRPO is best at 3e-4, on noise at 1e-4; P3O best at 1e-4 everywhere. On the
# test seeds the chosen rates give GRPO − P3O = +0.10 on bf16 and TIS − P3O ≈ 0 on noise. The
# selection seeds carry a different, large effect that must not leak into the tests.
SEL = {
    ("p3o", 1e-4): {"bf16": 0.60, "noise": 0.50},
    ("p3o", 3e-4): {"bf16": 0.40, "noise": 0.30},
    ("grpo", 1e-4): {"bf16": 0.50, "noise": 0.65},
    ("grpo", 3e-4): {"bf16": 0.70, "noise": 0.45},
    ("tis", 1e-4): {"bf16": 0.55, "noise": 0.62},
    ("tis", 3e-4): {"bf16": 0.50, "noise": 0.40},
}
TEST = {  # on the test seeds, at every rate (only the chosen one may matter)
    "p3o": {"bf16": 0.50, "noise": 0.50},
    "grpo": {"bf16": 0.60, "noise": 0.50},
    "tis": {"bf16": 0.50, "noise": 0.500},
}
SEED = {s: 0.01 * ((s * 7) % 5 - 2) for s in range(1, 9)}
JIT = {s: 0.003 * (-1) ** s for s in range(1, 9)}


def _v4_cells(grid_name="a"):
    out = []
    for (arm, lr), by in SEL.items():
        for mm, v in by.items():
            for s in range(1, 9):
                acc = v if s <= 4 else TEST[arm][mm] + (0 if lr == 1e-4 else -0.2)
                if arm != "p3o" and s > 4:
                    acc += JIT[s] if (arm, mm) == ("tis", "noise") else 0.01 * JIT[s]
                out.append(
                    {
                        "cell": f"{arm}@lr{lr_tag(lr)}__{mm}__s{s}",
                        "objective": f"{arm}@lr{lr_tag(lr)}",
                        "mismatch": mm,
                        "family": "x",
                        "level": 0.0,
                        "seed": s,
                        "status": "ok",
                        "steps": 30,
                        "acc_end": acc + SEED[s],
                        "wall_s": 1.0,
                        "grid_hash": grid_name,
                    }
                )
    return out


def test_rates_are_chosen_on_the_selection_seeds_and_tested_on_the_others(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    g = load_grid(_v4_grid(tmp_path, "a", [("bf16", "grpo"), ("noise", "tis")]))
    cs = _v4_cells()
    chosen = chosen_rates(g, cs)
    assert chosen[("grpo", "bf16")] == "grpo@lr3e-4" and chosen[("grpo", "noise")] == "grpo@lr1e-4"
    assert chosen[("p3o", "bf16")] == chosen[("p3o", "noise")] == "p3o@lr1e-4"
    got = arm_scores(g, cs, "grpo", "bf16", chosen)
    assert sorted(got) == [5, 6, 7, 8]  # the test seeds only
    declared, exploratory = v4_tests(g, cs)
    (_, _, _, _, a, b, t1), (_, _, _, _, _, _, t2) = declared
    # grpo at 3e-4 on its test seeds: 0.60 − 0.2 = 0.40, against P3O's 0.50 → −0.10
    assert t1.seeds == (5, 6, 7, 8) and t1.mean == pytest.approx(-0.10, abs=1e-3)
    assert t2.mean == pytest.approx(0.0, abs=1e-9)
    # a failed selection cell demotes its rate: P3O at 1e-4 fails once on bf16
    bad = [dict(c) for c in cs]
    for c in bad:
        if c["cell"] == "p3o@lr1e-4__bf16__s2":
            c.update(status="failed: nan", acc_end=float("nan"))
    assert chosen_rates(g, bad)[("p3o", "bf16")] == "p3o@lr3e-4"
    # per: control — chosen on bf16, held on noise
    gc = load_grid(_ctrl(tmp_path))
    assert chosen_rates(gc, cs)[("grpo", "noise")] == "grpo@lr3e-4"
    # exploratory: every other arm − P3O where not declared; never adjusted with the family
    assert {(r[1], r[2]) for r in exploratory} == {("bf16", "tis"), ("noise", "grpo")}
    table, text = v4_headline(g, cs)
    md = "\n".join(table + text)
    assert "| bf16 | grpo (lr 3e-4) − p3o (lr 1e-4) |" in md and "**worse**" in md
    assert "(exploratory)" in md and "tie" not in md.replace("testable", "")


def _ctrl(tmp_path):
    p = _v4_grid(tmp_path, "c", [("bf16", "grpo")])
    p.write_text(p.read_text().replace("lrs: [1e-4, 3e-4]}", "lrs: [1e-4, 3e-4], per: control}"))
    return p


def test_the_study_adjusts_every_grids_declared_comparisons_together(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    paths = [
        _v4_grid(tmp_path, "a", [("bf16", "grpo"), ("noise", "tis")]),
        _v4_grid(tmp_path, "b", [("bf16", "grpo")]),
    ]
    grids = [load_grid(p) for p in paths]
    for g in grids:
        Path(g.out).mkdir(parents=True)
        write_csv(Path(g.out) / "cells.csv", _v4_cells(g.name))
    md = write_study([str(p) for p in paths], tmp_path / "study.md", "v4").read_text()
    fam = [ln for ln in md.splitlines() if ln[:4] in ("| a ", "| b ") and " − " in ln]
    declared = [ln for ln in fam if "(exploratory)" not in ln]
    assert len(declared) == 3 and "One family: the 3 comparisons" in md
    assert "| a | bf16 | grpo (lr 3e-4) − p3o (lr 1e-4) |" in declared[0]
    # the study's p Holm of a declared test is that of the 3-comparison family (6 hypotheses)
    cs = _v4_cells()
    rows = v4_tests(grids[0], cs)[0] + v4_tests(grids[1], cs)[0]
    ts = [r[-1] for r in rows]
    want = adjust_with_equivalence(ts)
    assert f"{want[0].p_adj:.3g} | {ts[0].p_tost:.3g} | {want[0].p_tost_adj:.3g}" in declared[0]
    # within grid a alone the same test has a smaller adjustment (a family of 2)
    alone = adjust_with_equivalence(ts[:2])
    assert alone[0].p_adj < want[0].p_adj
    assert "Declared calls over the study: 0 better, 2 worse, 1 equivalent, 0 inconclusive" in md
    assert "tie" not in md.replace("testable", "")
    # the cells ran under another grid file than the one now declaring the family: said
    assert "its declared family may have changed after the runs" in md


# -- the cells' store ---------------------------------------------------------------------------


def _store_grid(tmp_path, name, label="p3o", store="store", extra=""):
    g = tmp_path / f"{name}.yaml"
    g.write_text(
        f"name: {name}\nbase: recipes/tiny_cpu.yaml\nout: {tmp_path / name / 'out'}\n"
        f"work: {tmp_path / name / 'work'}\nstore: {tmp_path / store}\n"
        "set: {steps: 2}\n"
        f"objectives: {{{label}: {{objective: p3o}}, grpo: {{objective: grpo}}}}\n"
        "mismatch:\n  bf16: {family: baseline}\n"
        "seeds: [1, 2]\n" + extra
    )
    return load_grid(g)


def _fake_run(grid, cell, trained):
    """What run_cell leaves, without training: cell.json, metrics.jsonl, the store entry."""
    from megatron_p3o.stress.grid import cell_config

    cfg = cell_config(grid, cell)
    run_dir = Path(grid.work) / cell.id
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    summary = runner.summarize(cell, [{"reward_mean": 0.25}], 0.1, 0.3 + 0.01 * cell.seed, 5.0)
    summary.update(commit="c1", grid_hash="orig")
    (run_dir / runner.SUMMARY).write_text(json.dumps(summary))
    runner.file_in_store(grid, cfg, run_dir, summary)
    trained.append((grid.name, cell.id))
    return summary


def _run_grid(grid, trained):
    """The run loop of ``python -m megatron_p3o.stress``: finished cells (or stored) are skipped."""
    for c in grid_cells(grid):
        if runner.finished(grid, c):
            continue
        _fake_run(grid, c, trained)
    return {c.id: runner.finished(grid, c) for c in grid_cells(grid)}


def test_two_grids_sharing_cells_train_them_once(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(runner, "code_key", lambda: "commit-x")
    trained = []
    a = _store_grid(tmp_path, "a")
    rec_a = _run_grid(a, trained)
    assert len(trained) == 4 and len(list((tmp_path / "store").iterdir())) == 4
    # grid b: P3O under another label, another work dir, plus a cell of its own (grpo at lr 1e-3)
    b = _store_grid(
        tmp_path, "b", label="p3o_again",
        extra="mismatch:\n  bf16: {family: baseline}\n  lr: {family: x, set: {optim.lr: 1.0e-3}}\n",
    )  # fmt: skip
    rec_b = _run_grid(b, trained)
    assert trained[4:] == [
        ("b", "p3o_again__lr__s1"),
        ("b", "p3o_again__lr__s2"),
        ("b", "grpo__lr__s1"),
        ("b", "grpo__lr__s2"),
    ]
    r = rec_b["p3o_again__bf16__s1"]
    assert r["reused_from"].startswith(str(Path(a.work) / "p3o__bf16__s1"))
    assert r["cell"] == "p3o_again__bf16__s1" and r["objective"] == "p3o_again"
    skip = ("cell", "objective", "reused_from", "grid_hash", "reused_grid_hash")
    orig = rec_a["p3o__bf16__s1"]
    assert {k: v for k, v in r.items() if k not in skip} == {
        k: v for k, v in orig.items() if k not in skip
    }
    assert r["reused_grid_hash"] == "orig" and r["grid_hash"] != "orig"
    assert (Path(b.work) / "p3o_again__bf16__s1" / "metrics.jsonl").read_text() == (
        Path(a.work) / "p3o__bf16__s1" / "metrics.jsonl"
    ).read_text()
    # a second pass of b trains nothing
    _run_grid(b, trained)
    assert len(trained) == 8


def test_the_store_key_ignores_outputs_and_ports_but_not_what_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(runner, "code_key", lambda: "commit-x")
    from megatron_p3o.stress.grid import cell_config

    a = _store_grid(tmp_path, "a")
    c = grid_cells(a)[0]
    key = runner.store_key(runner.store_material(a, cell_config(a, c)))
    other = _store_grid(
        tmp_path, "o", extra="set: {steps: 2, rollout.sglang.port: 31000, wandb.project: z}\n"
    )
    c2 = grid_cells(other)[0]
    assert runner.store_key(runner.store_material(other, cell_config(other, c2))) == key
    for extra in (
        "set: {steps: 3}\n",  # what trains
        "eval_limit: 7\n",  # what it is scored on
        "probe_prompts: 4\n",
    ):
        g = _store_grid(tmp_path, "d", extra=extra)
        assert runner.store_key(runner.store_material(g, cell_config(g, grid_cells(g)[0]))) != key
    assert runner.store_key(runner.store_material(a, cell_config(a, grid_cells(a)[1]))) != key
    # other code: another key, unless the grid reuses across commits
    monkeypatch.setattr(runner, "code_key", lambda: "commit-y")
    assert runner.store_key(runner.store_material(a, cell_config(a, c))) != key
    across = _store_grid(tmp_path, "x", extra="store_across_commits: true\n")
    k1 = runner.store_key(runner.store_material(across, cell_config(across, c)))
    monkeypatch.setattr(runner, "code_key", lambda: "commit-x")
    assert runner.store_key(runner.store_material(across, cell_config(across, c))) == k1


def test_failed_cells_are_not_stored_and_no_store_means_no_reuse(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(runner, "code_key", lambda: "commit-x")
    from megatron_p3o.stress.grid import cell_config

    a = _store_grid(tmp_path, "a")
    c = grid_cells(a)[0]
    s = runner.summarize(c, [], math.nan, math.nan, 1.0, status="failed: nan")
    runner.file_in_store(a, cell_config(a, c), tmp_path, s)
    assert not (tmp_path / "store").exists() and runner.finished(a, c) is None
    plain = load_grid(_plain(tmp_path, a))
    assert plain.store == "" and runner.finished(plain, c) is None


def _plain(tmp_path, g):
    p = tmp_path / "plain.yaml"
    p.write_text(Path(g.path).read_text().replace(f"store: {tmp_path / 'store'}\n", ""))
    return p


def test_a_v4_grid_report_has_the_family_table_and_the_chosen_rates(tmp_path, monkeypatch):
    from megatron_p3o.stress.report import write_report

    monkeypatch.chdir(ROOT)
    g = load_grid(_v4_grid(tmp_path, "a", [("bf16", "grpo"), ("noise", "tis")]))
    cs = [
        {**c, "acc_start": 0.1, "acc_delta": c["acc_end"] - 0.1, "ess_mean": 0.9}
        for c in _v4_cells()
    ]
    md = write_report(g, cs, {}, 60.0, "grid.yaml").read_text()
    assert "## Headline: the declared comparisons (paired by seed)" in md
    assert "on the test seeds 5, 6, 7, 8 at each arm's rate chosen on the others" in md
    assert "## Learning rates chosen on the selection seeds" in md
    assert "| grpo | bf16 | 0.0001: 0.505; **0.0003: 0.705** | 0.0003 |" in md
    assert "**worse**" in md and "**equivalent**" in md
    assert " tie" not in md and "**win**" not in md and "**loss**" not in md
