"""The stress grid: a base recipe, objectives × mismatch settings × seeds, loaded strictly.

A grid file (see ``recipes/stress_tiny_cpu.yaml``)::

    name: stress_tiny_cpu
    base: recipes/tiny_cpu.yaml          # the recipe every cell starts from
    out: docs/stress_tiny_cpu            # CSV, plots, report.md
    work: runs/stress_tiny_cpu           # one run directory per cell
    set: {steps: 25, ...}                # overrides for every cell (dotted keys)
    objectives:                          # label -> objective name + hyper-parameters
      p3o: {objective: p3o}
      grpo_eps0.2: {objective: grpo, hyper: {eps_low: 0.2, eps_high: 0.2}}
      p3o@lr1e-3: {objective: p3o, set: {optim.lr: 1.0e-3}}   # "name@..." = a variant of name
    mismatch:                            # label -> family, numeric level, overrides
      bf16: {family: baseline, level: 0, set: {}}
      noise_0.5: {family: logprob_noise, level: 0.5, set: {rollout.logprob_noise: 0.5}}
      temp_0.8: {family: engine_temperature, level: 0.8, set: {...},
                 objectives: [p3o, grpo_eps0.2]}   # only these objectives on this setting
    seeds: [1, 2]
    comparators: [grpo_eps0.2]           # P3O is tested against these (named before the runs)
    eval_limit: 200                      # held-out prompts per evaluation (0 = all)
    probe_prompts: 64                    # the setting's mismatch at the base weights (0 = off)
    notes: |                             # your reading of the results, kept in the report
      ...
    # v4 (any of the next two makes the report's headline the declared family's, with TOST):
    preregistered:                       # the confirmatory comparisons, arm − comparator
      - {setting: bf16, arm: grpo_eps0.2, comparator: p3o}
    equivalence_margin: 0.02             # TOST's ±margin (an "equivalent" call)
    lr_select: {seeds: [1, 2, 3, 4], test_seeds: [5, 6, 7, 8], lrs: [1.0e-4, 3.0e-4],
                per: setting}            # or per: control; arms are then objective families
    store: runs/stress_store             # cells already run (same resolved config) are reused
    store_across_commits: false          # true: reuse cells of other code too
    # v5 (docs/stress_v5_plan.md): the endpoint, and seeds added look by look until decided
    eval_steps: [10, 20]                 # held-out accuracy also after these steps (acc_s10, …)
    endpoint_steps: [24, 27, 30]         # the endpoint acc_mean_end: the mean at these steps
    sequential: {seeds: [101, …, 164], looks: [8, 16, 32, 64], alpha: 0.05,
                 spending: hsd, gamma: -2}   # stress/sequential.py: repeated CIs, Bonferroni
    committed: docs/stress_v5_tiny_cpu   # its cells.csv rows count as finished cells
    # v6 (docs/stress_v6_plan.md): in preregistered, comparator_setting (the comparator's cells
    # on another setting) and prediction (the call expected, scored exactly); in a setting,
    # loop: retokenize (stress/loop_mismatch.py: a multi-turn loop mismatch, no trainer option)

Families are the mismatch axes: rollout precision, reuse (epochs), staleness (sync every L /
async K), engine logit noise (a perturbed sampling distribution with honest ℓb), corrupted
reported ℓb, engine/trainer temperature mismatch. An objective's ``set`` overrides the grid's
``set`` for its cells (a learning-rate sweep: ``p3o@lr1e-4``, ``p3o@lr1e-3``, … with their own
``optim.lr``); the part of a label before ``@`` names the objective the report groups them
under (their learning-rate table). A setting's ``objectives`` runs only those labels there (a
cheaper axis for a subset); the control setting runs every objective, since each level is
compared with the objective's own control. Every cell is validated as a full
``TrainConfig`` before anything runs, so a typo fails in the first second, not after an hour.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from megatron_p3o.config.loading import _build, load_config, load_yaml_mapping
from megatron_p3o.config.train_config import TrainConfig
from megatron_p3o.runtime.errors import ConfigError


@dataclass(frozen=True)
class ObjectiveSpec:
    objective: str
    hyper: Dict[str, Any] = field(default_factory=dict)
    set: Dict[str, Any] = field(default_factory=dict)  # overrides for this objective's cells


@dataclass(frozen=True)
class MismatchSpec:
    family: str = "baseline"
    level: float = 0.0
    set: Dict[str, Any] = field(default_factory=dict)
    objectives: List[str] = field(default_factory=list)  # labels run on this setting (empty: all)
    # a mismatch of the multi-turn loop that is no trainer option (:mod:`.loop_mismatch`):
    # "retokenize" renders the history to text and encodes it again before every turn
    loop: str = ""


@dataclass(frozen=True)
class Comparison:
    """One pre-registered comparison: ``arm`` − ``comparator`` on ``setting`` (final held-out
    accuracy, paired by seed). Arms are objective labels, or, under ``lr_select``, objective
    families (the part of a label before ``@``) each at its chosen rate."""

    setting: str
    arm: str
    comparator: str = "p3o"
    # v6: the comparator's setting when it is another one (the same arm on two settings: what a
    # mismatch costs that arm); empty: ``setting``
    comparator_setting: str = ""
    # v6: the call predicted before the runs (better / worse / equivalent / undecided), scored
    # exactly in calls.csv (``as_predicted``); empty: none declared
    prediction: str = ""

    @property
    def against(self) -> str:
        """The setting the comparator's cells run on."""
        return self.comparator_setting or self.setting


@dataclass(frozen=True)
class LrSelect:
    """Each arm's learning rate chosen on ``seeds`` and tested on ``test_seeds`` (disjoint).

    ``lrs``: the rates; each objective label L of the grid then runs as ``L@lr<rate>`` with
    ``optim.lr`` set (empty: the grid's own ``NAME@…`` labels with their ``optim.lr``).
    ``per``: ``setting`` (each arm's rate chosen separately on every setting) or ``control``
    (once, on the control setting, and held fixed on the others)."""

    seeds: List[int] = field(default_factory=list)
    test_seeds: List[int] = field(default_factory=list)
    lrs: List[float] = field(default_factory=list)
    per: str = "setting"


LR_SELECT_PER = ("setting", "control")


@dataclass(frozen=True)
class Sequential:
    """Seeds added look by look until every declared comparison is decided (v5,
    ``stress/sequential.py``). ``seeds``: the ordered pool; look k uses its first ``looks[k]``
    seeds. ``alpha``: the error rate over the grid's whole declared family (Bonferroni: α/m per
    comparison), spent over the looks by ``spending`` (``hsd``: Hwang–Shih–DeCani with
    ``gamma``; ``obf``: Lan–DeMets O'Brien–Fleming; ``pocock``: Lan–DeMets Pocock)."""

    seeds: List[int] = field(default_factory=list)
    looks: List[int] = field(default_factory=list)
    alpha: float = 0.05
    spending: str = "hsd"
    gamma: float = -2.0


SPENDING = ("hsd", "obf", "pocock")

REPORTING_NOISE = "reporting noise, not a distribution shift"
PREDICTIONS = ("better", "worse", "equivalent", "undecided")
LOOP_MISMATCHES = ("", "retokenize")


def reports_noise(m: MismatchSpec) -> bool:
    """Whether a setting corrupts the ℓb the engine *reports* (``rollout.logprob_noise``) rather
    than the distribution it samples from: such a setting's mismatch is reporting noise, not a
    shift of πb (the probe, which measures the engine, does not see it), and reports label it."""
    return float(m.set.get("rollout.logprob_noise", 0.0) or 0.0) > 0.0


def family_label(grid: "GridConfig", family: str) -> str:
    """``family``, with :data:`REPORTING_NOISE` appended when its settings corrupt reported ℓb."""
    noisy = any(reports_noise(m) for m in grid.mismatch.values() if m.family == family)
    return f"{family} ({REPORTING_NOISE})" if noisy else family


@dataclass(frozen=True)
class GridConfig:
    name: str = "stress"
    base: str = ""
    out: str = "docs/stress"
    work: str = "runs/stress"
    set: Dict[str, Any] = field(default_factory=dict)
    objectives: Dict[str, ObjectiveSpec] = field(default_factory=dict)
    mismatch: Dict[str, MismatchSpec] = field(default_factory=dict)
    seeds: List[int] = field(default_factory=lambda: [1])
    # objective labels P3O is tested against, named before the runs (empty: every baseline)
    comparators: List[str] = field(default_factory=list)
    eval_limit: int = 0
    # held-out prompts of the exogenous-mismatch probe, run before each cell trains (0 = off)
    probe_prompts: int = 0
    world_size: int = 1  # ranks each cell runs on (checked by --list on a laptop)
    notes: str = ""  # the experimenter's reading, printed in the report above the computed findings
    # v4: the confirmatory comparisons, declared before the runs (one Holm family per study,
    # equivalence by TOST at ±equivalence_margin); every other comparison is exploratory
    preregistered: List[Comparison] = field(default_factory=list)
    equivalence_margin: float = 0.02
    lr_select: Optional[LrSelect] = (
        None  # v4: learning rates chosen on some seeds, tested on others
    )
    # the cells' store: a cell whose resolved config already ran (here or in another grid with
    # the same store) is reused from it instead of trained again ("" = no store)
    store: str = ""
    store_across_commits: bool = False  # reuse cells of another commit (of a dirty tree's diff)
    # the base checkpoint's tree hash (provenance.tree_hash) every cell must start from, checked
    # before any cell runs: a grid written for a shipped base (bases/) refuses another one
    base_hash: str = ""
    # v5: held-out accuracy also after these steps (cell.json's acc_curve, CSV acc_s<step>), and
    # the endpoint: the mean accuracy after ``endpoint_steps`` (``acc_mean_end``; empty: acc_end)
    eval_steps: List[int] = field(default_factory=list)
    endpoint_steps: List[int] = field(default_factory=list)
    sequential: Optional[Sequential] = None  # v5: seeds added look by look until decided
    # a committed report (e.g. docs/stress_v5_tiny_cpu) whose cells.csv rows count as finished
    # cells: a fresh clone resumes the grid from them and reruns find them
    committed: str = ""
    path: str = ""  # the grid file (set by load_grid)

    @property
    def v5(self) -> bool:
        """A v5 grid (an endpoint over several evaluations, or seeds added look by look): its
        settings may each run their own labels (each arm at the rate fixed for the setting)."""
        return bool(self.sequential) or bool(self.endpoint_steps)

    @property
    def endpoint(self) -> str:
        """The cell column the declared comparisons compare: ``acc_mean_end`` or ``acc_end``."""
        return "acc_mean_end" if self.endpoint_steps else "acc_end"

    @property
    def v4(self) -> bool:
        """Whether the grid's reports use the v4 statistics (declared family, TOST calls)."""
        return bool(self.preregistered) or self.lr_select is not None or bool(self.sequential)


@dataclass(frozen=True)
class Cell:
    objective: str
    mismatch: str
    seed: int
    family: str
    level: float
    overrides: List[str]

    @property
    def id(self) -> str:
        return f"{self.objective}__{self.mismatch}__s{self.seed}"


def _items(d: Dict[str, Any]) -> List[str]:
    return [
        f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
        for k, v in d.items()
    ]


def _mapping(p: Path, key: str, v: Any) -> dict:
    """A cell setting's value must be a mapping (or empty): ``objectives: {p3o: 3}`` is one line,
    not a TypeError from deep in the loader."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"grid {p}: {key}: expected a mapping, got {v!r}")
    return v


def load_grid(path: str | Path) -> GridConfig:
    p = Path(path)
    data = load_yaml_mapping(p, "grid")  # missing, a directory, not UTF-8: one line naming it
    for key in ("objectives", "mismatch"):
        if not isinstance(data.get(key), dict) or not data[key]:
            raise ConfigError(f"grid {p}: '{key}' must be a non-empty mapping of label -> settings")
    objectives = {
        k: _build(ObjectiveSpec, _mapping(p, f"objectives.{k}", v), f"objectives.{k}")
        for k, v in data.pop("objectives").items()
    }
    mismatch = {
        k: _build(MismatchSpec, _mapping(p, f"mismatch.{k}", v), f"mismatch.{k}")
        for k, v in data.pop("mismatch").items()
    }
    if "path" in data:  # a field, set below to where the grid was read from
        raise ConfigError(f"grid {p}: unknown grid key 'path'")
    prereg = data.pop("preregistered", None) or []
    if not isinstance(prereg, list):
        raise ConfigError(
            f"grid {p}: preregistered: expected a list of {{setting, arm, comparator}}"
        )
    prereg = [
        _build(Comparison, _mapping(p, f"preregistered[{i}]", v), f"preregistered[{i}]")
        for i, v in enumerate(prereg)
    ]
    seq = data.pop("sequential", None)
    seq = None if seq is None else _build(Sequential, _mapping(p, "sequential", seq), "sequential")
    if seq is not None and "seeds" not in data:
        data["seeds"] = list(seq.seeds)
    lr_sel = data.pop("lr_select", None)
    lr_sel = (
        None if lr_sel is None else _build(LrSelect, _mapping(p, "lr_select", lr_sel), "lr_select")
    )
    if lr_sel is not None:
        objectives = _lr_select_objectives(p, lr_sel, objectives)
        for m in mismatch.values():  # a setting's subset names arms: run each at every rate
            m.objectives[:] = [o for a in m.objectives for o in _expand(a, objectives)]
        if "seeds" not in data:
            data["seeds"] = sorted(set(lr_sel.seeds) | set(lr_sel.test_seeds))
    grid = _build(GridConfig, data)
    for key, v, lo in (
        ("eval_limit", grid.eval_limit, 0),
        ("probe_prompts", grid.probe_prompts, 0),
        ("world_size", grid.world_size, 1),
    ):
        if v < lo:
            raise ConfigError(f"grid {p}: {key}={v} must be >= {lo}")
    grid = GridConfig(
        **{
            **grid.__dict__,
            "objectives": objectives,
            "mismatch": mismatch,
            "preregistered": prereg,
            "lr_select": lr_sel,
            "sequential": seq,
            "path": str(p),
        }
    )
    _check_v4(p, grid)
    if not grid.base:
        raise ConfigError(f"grid {p}: 'base' (the recipe every cell starts from) is required")
    if not grid.seeds:
        raise ConfigError(f"grid {p}: 'seeds' is empty")
    for c in grid.comparators:
        if c not in objectives and not (lr_sel and any(arm_of(k) == c for k in objectives)):
            raise ConfigError(
                f"grid {p}: comparators: {c!r} is not an objective label ({sorted(objectives)})"
            )
    for k, m in mismatch.items():
        if m.loop not in LOOP_MISMATCHES:
            raise ConfigError(
                f"grid {p}: mismatch.{k}.loop: {m.loop!r} is not a loop mismatch "
                f"({', '.join(x for x in LOOP_MISMATCHES if x)})"
            )
        for o in m.objectives:
            if o not in objectives:
                raise ConfigError(
                    f"grid {p}: mismatch.{k}.objectives: {o!r} is not an objective label "
                    f"({sorted(objectives)})"
                )
    _check_v5(p, grid)
    control = control_setting(grid)
    if mismatch[control].objectives and not grid.v5:  # v5: each arm's rate fixed per setting
        raise ConfigError(
            f"grid {p}: mismatch.{control}.objectives: the control setting runs every objective "
            "(each level is compared with the objective's own control)"
        )
    return grid


def lr_tag(lr: float) -> str:
    """``1e-4`` for 1.0e-4, ``2.5e-4`` for 2.5e-4: the rate in an objective label."""
    mant, exp = f"{float(lr):.6e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def arm_of(label: str) -> str:
    """The arm (objective family) a label belongs to: ``p3o@lr1e-4`` → ``p3o``."""
    return label.split("@", 1)[0]


def _expand(arm: str, objectives: Dict[str, ObjectiveSpec]) -> List[str]:
    """The labels of ``arm`` (itself if it is a label, else its ``arm@…`` variants)."""
    if arm in objectives:
        return [arm]
    return [k for k in objectives if arm_of(k) == arm] or [arm]


def _lr_select_objectives(p: Path, sel: LrSelect, objectives: Dict[str, ObjectiveSpec]):
    """The objectives under ``lr_select``: with ``lrs``, each label L becomes ``L@lr<rate>`` per
    rate (``optim.lr`` set); without, the grid's own labels."""
    if not sel.lrs:
        return objectives
    out = {}
    for k, o in objectives.items():
        if "@" in k or "optim.lr" in o.set:
            raise ConfigError(
                f"grid {p}: objectives.{k}: with lr_select.lrs the rates come from lr_select "
                "(name each arm once, without '@' and without its own optim.lr)"
            )
        for lr in sel.lrs:
            out[f"{k}@lr{lr_tag(lr)}"] = ObjectiveSpec(
                o.objective, dict(o.hyper), {**o.set, "optim.lr": float(lr)}
            )
    return out


def _check_v4(p: Path, grid: GridConfig) -> None:
    """The declared family names settings and arms of the grid; the lr split is disjoint and
    inside the grid's seeds."""
    # under lr_select an arm is an objective family (each at its chosen rate), else a label
    families = grid.lr_select or grid.sequential
    arms = {arm_of(k) for k in grid.objectives} if families else set(grid.objectives)
    for i, c in enumerate(grid.preregistered):
        if c.setting not in grid.mismatch:
            raise ConfigError(
                f"grid {p}: preregistered[{i}].setting: {c.setting!r} is not a mismatch label "
                f"({sorted(grid.mismatch)})"
            )
        if c.against not in grid.mismatch:
            raise ConfigError(
                f"grid {p}: preregistered[{i}].comparator_setting: {c.against!r} is not a "
                f"mismatch label ({sorted(grid.mismatch)})"
            )
        for key in ("arm", "comparator"):
            v = getattr(c, key)
            if v not in arms:
                raise ConfigError(
                    f"grid {p}: preregistered[{i}].{key}: {v!r} is not an objective "
                    f"({sorted(arms)})"
                )
        if c.arm == c.comparator and c.against == c.setting:
            raise ConfigError(
                f"grid {p}: preregistered[{i}]: arm and comparator are both {c.arm!r}"
            )
        if c.prediction not in ("", *PREDICTIONS):
            raise ConfigError(
                f"grid {p}: preregistered[{i}].prediction: {c.prediction!r} is not one call "
                f"({', '.join(PREDICTIONS)})"
            )
    if len({bool(c.prediction) for c in grid.preregistered}) > 1:
        raise ConfigError(
            f"grid {p}: preregistered: predict every comparison's call or none (each is scored)"
        )
    seen = [(c.setting, c.arm, c.comparator, c.against) for c in grid.preregistered]
    if len(set(seen)) < len(seen):
        raise ConfigError(f"grid {p}: preregistered: a comparison is declared twice")
    if not 0 < grid.equivalence_margin < 1:
        raise ConfigError(
            f"grid {p}: equivalence_margin={grid.equivalence_margin} must be in (0, 1)"
        )
    sel = grid.lr_select
    if sel is None:
        return
    if not sel.seeds or not sel.test_seeds:
        raise ConfigError(f"grid {p}: lr_select: 'seeds' and 'test_seeds' must both be non-empty")
    if set(sel.seeds) & set(sel.test_seeds):
        raise ConfigError(
            f"grid {p}: lr_select: seeds {sorted(set(sel.seeds) & set(sel.test_seeds))} are in "
            "both 'seeds' and 'test_seeds' (the rate must be chosen on other seeds than it is "
            "tested on)"
        )
    missing = sorted((set(sel.seeds) | set(sel.test_seeds)) - set(grid.seeds))
    if missing:
        raise ConfigError(f"grid {p}: lr_select: seeds {missing} are not in the grid's seeds")
    if sel.per not in LR_SELECT_PER:
        raise ConfigError(f"grid {p}: lr_select.per={sel.per!r}: one of {LR_SELECT_PER}")
    if any(not float(lr) > 0 for lr in sel.lrs):
        raise ConfigError(f"grid {p}: lr_select.lrs: every rate must be > 0")


def _check_v5(p: Path, grid: GridConfig) -> None:
    """The evaluation steps lie within the run; the sequential design is well formed, and each
    declared arm runs exactly one label on its setting (its rate is fixed by the grid)."""
    steps = int(grid.set.get("steps", 0) or 0)
    for key in ("eval_steps", "endpoint_steps"):
        bad = [s for s in getattr(grid, key) if not 1 <= int(s) <= (steps or int(s))]
        if bad:
            raise ConfigError(f"grid {p}: {key}: steps {bad} are not within 1..{steps}")
    seq = grid.sequential
    if seq is None:
        if any(c.comparator_setting or c.prediction for c in grid.preregistered):
            raise ConfigError(
                f"grid {p}: preregistered: comparator_setting and prediction are read by the "
                "sequential design (sequential:)"
            )
        return
    if grid.lr_select is not None:
        raise ConfigError(f"grid {p}: sequential and lr_select exclude each other (fix the rates)")
    if not grid.preregistered:
        raise ConfigError(f"grid {p}: sequential: declare the comparisons (preregistered:)")
    looks = list(seq.looks)
    if not looks or looks != sorted(set(looks)) or looks[0] < 3:
        raise ConfigError(f"grid {p}: sequential.looks={looks}: increasing, the first >= 3 seeds")
    if len(set(seq.seeds)) != len(seq.seeds) or len(seq.seeds) < looks[-1]:
        raise ConfigError(
            f"grid {p}: sequential.seeds: {len(seq.seeds)} distinct seeds needed >= the last look "
            f"({looks[-1]})"
        )
    if sorted(seq.seeds) != sorted(grid.seeds):
        raise ConfigError(f"grid {p}: sequential.seeds and seeds must be the same seeds")
    if not 0 < seq.alpha < 0.5 or seq.spending not in SPENDING:
        raise ConfigError(
            f"grid {p}: sequential: alpha={seq.alpha} in (0, 0.5), spending one of {SPENDING}"
        )
    for i, c in enumerate(grid.preregistered):
        for arm, setting in ((c.arm, c.setting), (c.comparator, c.against)):
            labels = arm_labels(grid, arm, setting)
            if len(labels) != 1:
                raise ConfigError(
                    f"grid {p}: preregistered[{i}]: arm {arm!r} runs {len(labels)} labels on "
                    f"{setting} ({labels}): exactly one (its fixed rate) is needed"
                )


def arm_labels(grid: GridConfig, arm: str, setting: str) -> List[str]:
    """The objective labels of ``arm`` (the label itself, or its ``arm@…`` variants) that run on
    ``setting``."""
    m = grid.mismatch[setting]
    on = [k for k in grid.objectives if not m.objectives or k in m.objectives]
    return [k for k in on if arm_of(k) == arm]


def cells(grid: GridConfig) -> List[Cell]:
    """Every (objective, mismatch, seed) — a setting with ``objectives`` only for those — in a
    stable order (objective-major)."""
    out = []
    for (ol, o), (ml, m), seed in itertools.product(
        grid.objectives.items(), grid.mismatch.items(), grid.seeds
    ):
        if m.objectives and ol not in m.objectives:
            continue
        ov = _items(grid.set) + [f"loss.objective={o.objective}"]
        ov += _items({f"loss.hyper.{k}": v for k, v in o.hyper.items()}) + _items(o.set)
        ov += _items(m.set)
        ov += [f"run.seed={seed}"]
        out.append(Cell(ol, ml, seed, m.family, float(m.level), ov))
    return out


def control_setting(grid: GridConfig) -> str:
    """The setting every other one is compared with (dose break points, the learning-rate
    choice): the one of family ``baseline``, else the grid's first."""
    return next((k for k, m in grid.mismatch.items() if m.family == "baseline"), None) or next(
        iter(grid.mismatch)
    )


def cell_config(grid: GridConfig, cell: Cell, world_size: int = 0) -> TrainConfig:
    """The cell's full, validated configuration (run directory under ``grid.work``), for
    ``world_size`` ranks (0 = the grid's ``world_size``)."""
    try:  # a bad value in a cell's settings names the cell
        return _cell_config(grid, cell, world_size or grid.world_size)
    except ConfigError as e:
        raise ConfigError(f"cell {cell.id}: {e}") from None


def _cell_config(grid: GridConfig, cell: Cell, world_size: int) -> TrainConfig:
    # with W&B on, the cells of a grid are runs of one group, each named after its cell
    run = [f"run.dir={grid.work}", f"run.name={cell.id}", f"wandb.group={grid.name}"]
    cfg = load_config(grid.base, cell.overrides + run)
    if cfg.rollout.engine == "sglang" and world_size == 1:
        # Single-process cells run side by side (--workers): each launches its own SGLang
        # server and opens its own weight-update rendezvous, so each gets free ports unless the
        # grid pins them. (Multi-rank cells run one at a time, on the recipe's ports: every
        # rank must agree on them.)
        from megatron_p3o.runtime.ports import free_port

        pinned = {o.split("=", 1)[0] for o in cell.overrides}
        ports = [
            f"{k}={free_port()}"
            for k in ("rollout.sglang.port", "rollout.weight_sync_port")
            if k not in pinned
        ]
        cfg = load_config(grid.base, cell.overrides + run + ports)
    m = grid.mismatch[cell.mismatch]
    if m.loop and cfg.rollout.multi_turn is None:
        raise ConfigError(
            f"mismatch.{cell.mismatch}.loop={m.loop}: the base recipe has no rollout.multi_turn "
            "(a loop mismatch changes the multi-turn loop)"
        )
    return cfg.with_task_files().validate(world_size)
