"""Stress study v6's additions to the grid (issue 65), all data the tool reads: a comparison
whose comparator runs on another setting (the same arm with and without a mismatch), a call
predicted before the runs and scored exactly, and the loop mismatch ``retokenize`` that is no
trainer option (its store key differs, it needs a multi-turn recipe, and it changes what the
engine is given but never what is trained or how it is scored)."""

import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.stress import runner
from megatron_p3o.stress.grid import cell_config, cells, load_grid
from megatron_p3o.stress.looks import CALLS_COLUMNS_V6, calls_rows, next_look

ROOT = Path(__file__).resolve().parents[2]
SEEDS = [11, 12, 13, 14, 15, 16, 17, 18]


def _grid(tmp_path, prereg: str, base="recipes/tiny_cpu_tools.yaml", loop="retokenize"):
    p = tmp_path / "v6.yaml"
    p.write_text(
        f"name: v6t\nbase: {base}\nout: {tmp_path / 'out'}\nwork: {tmp_path / 'work'}\n"
        "set: {steps: 30}\nendpoint_steps: [30]\n"
        "objectives:\n  p3o: {objective: p3o}\n  tis: {objective: tis}\n"
        "mismatch:\n  tito: {family: baseline}\n"
        f"  retok: {{family: history, level: 1, loop: {loop}}}\n"
        f"sequential: {{seeds: {SEEDS}, looks: [4, 8], alpha: 0.05}}\n"
        "equivalence_margin: 0.02\npreregistered:\n" + prereg
    )
    return p


PREREG = (
    "  - {setting: retok, arm: p3o, comparator: p3o, comparator_setting: tito,"
    " prediction: worse}\n"
    "  - {setting: retok, arm: tis, comparator: p3o, prediction: better}\n"
)
# planted per-seed endpoints: p3o on retok 0.10 below p3o on tito with a small wobble; tis on
# retok as p3o on retok plus noise around +0.01 (not decidable with 8 seeds)
WOBBLE = dict(zip(SEEDS, [1, -1, 0.5, -0.5, 1.5, -1.5, 0.2, -0.2]))


def _acc(label, setting, seed):
    if setting == "tito":
        return 0.6 + 0.01 * WOBBLE[seed]
    if label == "p3o":
        return 0.5 + 0.013 * WOBBLE[seed]
    return 0.51 + 0.2 * WOBBLE[seed]


def _rows(seeds):
    return [{"cell": f"{o}__{m}__s{s}", "objective": o, "mismatch": m, "family": "x",
             "level": 0.0, "seed": s, "status": "ok", "steps": 30,
             "acc_mean_end": _acc(o, m, s), "acc_end": _acc(o, m, s), "wall_s": 1.0}
            for m in ("tito", "retok") for o in ("p3o", "tis") for s in seeds]  # fmt: skip


def _interval(d, n_look, looks=(4, 8), alpha=0.05 / 2):
    """Look k's repeated CI, from scipy and the spending function written out here."""
    k = looks.index(n_look)

    def f(t):  # Hwang-Shih-DeCani, gamma = -2
        return (1 - math.exp(2 * t)) / (1 - math.exp(2))

    a = alpha * (f(looks[k] / looks[-1]) - (f(looks[k - 1] / looks[-1]) if k else 0.0))
    d = np.asarray(d, dtype=np.float64)
    h = scipy.stats.t.isf(a / 2, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return d.mean(), d.mean() - h, d.mean() + h


def test_a_comparison_across_settings_is_paired_by_seed_and_scored_against_its_prediction(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(ROOT)
    g = load_grid(_grid(tmp_path, PREREG))
    k, todo = next_look(g, [])  # look 1 wants both sides: p3o on tito too
    assert (
        k == 0
        and {(c.objective, c.mismatch) for c in todo}
        == {("p3o", "retok"), ("p3o", "tito"), ("tis", "retok")}
        and {c.seed for c in todo} == set(SEEDS[:4])
    )
    rows = _rows(SEEDS[:4])
    out = {(r["setting"], r["arm"]): r for r in calls_rows(g, rows)}
    assert tuple(next(iter(out.values()))) == CALLS_COLUMNS_V6
    first = out[("retok", "p3o")]
    d = [_acc("p3o", "retok", s) - _acc("p3o", "tito", s) for s in SEEDS[:4]]
    mean, lo, hi = _interval(d, 4)
    assert float(first["delta"]) == pytest.approx(mean, abs=2e-6)
    assert (float(first["ci_lo"]), float(first["ci_hi"])) == pytest.approx((lo, hi), abs=2e-6)
    assert hi < 0 and first["call"] == "worse" and first["as_predicted"] == "yes"
    assert first["comparator_setting"] == "tito" and first["prediction"] == "worse"
    tis = out[("retok", "tis")]
    assert tis["call"] == "undecided after look 1" and tis["as_predicted"] == "pending"
    k, todo = next_look(g, rows)  # only the open comparison's two sides get look 2's seeds
    assert k == 1 and {(c.objective, c.mismatch) for c in todo} == {
        ("p3o", "retok"),
        ("tis", "retok"),
    }
    out = {(r["setting"], r["arm"]): r for r in calls_rows(g, _rows(SEEDS))}
    d = [_acc("tis", "retok", s) - _acc("p3o", "retok", s) for s in SEEDS]
    mean, lo, hi = _interval(d, 8)
    assert lo < 0 < hi and not (-0.02 < lo and hi < 0.02)
    assert out[("retok", "tis")]["call"] == "undecided at cap"
    assert out[("retok", "tis")]["as_predicted"] == "no"  # "better" was predicted: exact only


@pytest.mark.parametrize(
    "prereg, match",
    [
        ("  - {setting: retok, arm: tis, prediction: likely}\n", r"preregistered\[0\].prediction"),
        ("  - {setting: retok, arm: tis, prediction: better}\n  - {setting: tito, arm: tis}\n",
         "predict every comparison's call or none"),
        ("  - {setting: retok, arm: p3o, comparator_setting: nope}\n",
         r"preregistered\[0\].comparator_setting: 'nope'"),
        ("  - {setting: retok, arm: p3o, comparator: p3o}\n", "arm and comparator are both"),
    ],
)  # fmt: skip
def test_bad_v6_declarations_are_one_line_naming_the_key(tmp_path, monkeypatch, prereg, match):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=match):
        load_grid(_grid(tmp_path, prereg))


def test_the_loop_mismatch_needs_a_multi_turn_base_and_keys_its_own_cells(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match="mismatch.retok.loop: 'shuffle'"):
        load_grid(_grid(tmp_path, PREREG, loop="shuffle"))
    single = load_grid(_grid(tmp_path, PREREG, base="recipes/tiny_cpu.yaml"))
    cell = next(c for c in cells(single) if c.mismatch == "retok")
    with pytest.raises(ConfigError, match="has no rollout.multi_turn"):
        cell_config(single, cell)
    g = load_grid(_grid(tmp_path, PREREG))
    by = {(c.objective, c.mismatch, c.seed): c for c in cells(g)}
    a, b = by[("p3o", "tito", 11)], by[("p3o", "retok", 11)]
    ca, cb = cell_config(g, a), cell_config(g, b)
    assert ca.rollout == cb.rollout  # the same trainer configuration ...
    ka = runner.store_key(runner.store_material(g, ca, ""))
    kb = runner.store_key(runner.store_material(g, cb, "retokenize"))
    assert ka != kb  # ... never reused for one another


class _Tok:
    """A tokenizer whose decode/encode is not a bijection: ids 5, 6 decode to "a", "b" and
    "ab" encodes as the single id 7 (a BPE merge)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join({5: "a", 6: "b", 7: "ab", 1: "<s>"}[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            for piece, t in (("<s>", 1), ("ab", 7), ("a", 5), ("b", 6)):
                if text.startswith(piece, i):
                    out.append(t)
                    i += len(piece)
                    break
        return out


def test_retokenize_changes_the_engine_input_only_in_rollouts():
    from megatron_p3o.rollout.trajectory import Trajectory
    from megatron_p3o.stress.loop_mismatch import apply_loop_mismatch

    class Loop:
        tok = _Tok()

        def engine_input(self, t):
            return t.prompt + t.ids

    seen = []

    class Trainer:
        turns = Loop()

        def evaluate_detail(self, path, limit=0):
            seen.append(self.turns.engine_input(t))
            return 0.5, []

    tr = Trainer()
    hook = apply_loop_mismatch("retokenize", tr)
    t = Trajectory(0, 0, [1, 5])
    t.append([6, 5], True, [-0.1, -0.2], [0, 0])
    assert tr.turns.engine_input(t) == [1, 7, 5]  # "a"+"b" re-merged: not what was sampled
    assert t.prompt + t.ids == [1, 5, 6, 5]  # the trajectory (what is trained) keeps its ids
    assert tr.evaluate_detail("x") == (0.5, []) and seen == [[1, 5, 6, 5]]  # scored as kept
    t2 = Trajectory(1, 0, [1, 6])
    assert tr.turns.engine_input(t2) == [1, 6]
    assert hook.summary() == {"loop_turns": 2, "loop_changed_share": 0.5,
                              "loop_longer_share": 0.0}  # fmt: skip
    assert apply_loop_mismatch("", tr) is None


def test_each_cell_records_the_commit_of_its_grid_the_plan(tmp_path):
    """``grid_commit``: the commit that last changed the grid file (the plan's, committed with
    it), ``uncommitted`` once the file is edited, ``unknown`` outside a checkout (git itself
    is the reference)."""
    import subprocess

    from megatron_p3o.stress.provenance import grid_commit

    def git(*a):
        return subprocess.run(["git", "-C", str(tmp_path), *a], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    g = tmp_path / "recipes" / "g.yaml"
    g.parent.mkdir()
    g.write_text("name: a\n")
    git("add", ".")
    git("commit", "-qm", "plan")
    plan = git("rev-parse", "HEAD")
    (tmp_path / "other.txt").write_text("x")
    git("add", ".")
    git("commit", "-qm", "later")
    assert grid_commit(g, tmp_path) == plan != git("rev-parse", "HEAD")
    g.write_text("name: b\n")
    assert grid_commit(g, tmp_path) == "uncommitted"
    assert grid_commit(tmp_path / "elsewhere.yaml", tmp_path / "nope") == "unknown"


def test_the_v6_families_share_the_study_error_as_the_plan_declares(monkeypatch):
    """docs/stress_v6_plan.md: four grids, 35 declared comparisons, each at α/35 (each grid's
    alpha its share), every one with a predicted call; P(any wrong call) ≤ 0.05 by the union
    bound over all of them."""
    monkeypatch.chdir(ROOT)
    grids = [load_grid(ROOT / f"recipes/stress_v6_{f}_tiny_cpu.yaml")
             for f in ("p4o", "k3", "switch", "tools")]  # fmt: skip
    m = [len(g.preregistered) for g in grids]
    assert m == [18, 8, 4, 5]
    each = [g.sequential.alpha / len(g.preregistered) for g in grids]
    assert each == pytest.approx([0.05 / 35] * 4, rel=1e-6)
    assert sum(g.sequential.alpha for g in grids) == pytest.approx(0.05, rel=1e-6)
    for g in grids:
        assert all(c.prediction for c in g.preregistered)
        assert g.sequential.seeds == list(range(301, 341)) and g.sequential.looks == [8, 16, 24, 40]
