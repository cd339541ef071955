"""Which objectives held at which train–rollout mismatch level: the stress studies' findings as
data, for ``python -m megatron_p3o.probe`` to place a measured engine against.

Source: the **v5 study** (issue 54; ``docs/stress_v5.md``, pre-registered in
``docs/stress_v5_plan.md``): the tiny addition model, 30 steps, P3O against TIS, GRPO with ℓold
recomputed and P3O with ``kl_scale: 0`` at the rates v4 chose, seeds paired across arms, looks at
8 → 16 → 24 → 40 test seeds, repeated confidence intervals with each comparison's α/33 spent over
the looks (Hwang–Shih–DeCani, γ −2); calls better / worse / equivalent (inside ±0.02) / undecided
at cap. Its chain_sum replication (27–61-token completions, cap 16 seeds) is its own family.
Its engine-side levels (bf16; logit noise σ 0.9, 1.2; per-channel rounding of the engine's
weights at three steps; chain σ 0.6, 1.2) come from ``tools/verdict_levels.py`` on the
committed ``calls.csv`` and ``cells.csv``: each level's mismatch is the mean of its cells' probe
columns (``probe_abs_dlogp``, ``probe_abs_seq_dlogp``, ``probe_kl_b_theta``, at the base
weights on 64 held-out prompts). Engines v5 did not run keep the **v3 study**'s calls
(``docs/stress_v3.md``): the real SGLang bf16 server, simulated FP8, engine temperature, logit
σ 0.3 / 0.6 and the 150-step σ 1.2 run. (v4's levels are all re-run by v5 and give way to it.)

Only engine-side (exogenous) levels are here: what a probe can measure. Staleness, reuse and
corrupted reported ℓb are not an engine's mismatch (the probe does not see them).

One meaning of *held* (issue 65): at a v5 level an arm **held** when it is called equivalent
(±0.02) or better than its comparator (P3O) there, **failed** when called worse, and is
**undecided** when undecided at the cap; P3O held when every arm is called equivalent or worse,
failed when any is called better, and is undecided otherwise. v3 had no equivalence margin: an
objective with no Holm-corrected loss there is **undecided** (no loss detected, none excluded),
never held.

Where the table applies (:func:`verdict`): only to an engine of a kind of mismatch a study ran
(:func:`engine_kind`: embedded bf16 / fp8, the SGLang bf16 server, logit noise, weight rounding,
engine temperature) on the model and task it ran (:func:`studied_task`: the shipped tiny
addition or chain_sum base, by its ``base.json``); anything else is "not studied". Within a kind,
the engine is placed at its nearest level of that kind, and beyond that kind's measured range it
is said to be beyond it — no call is carried from one kind, task or level to another.
"""

from __future__ import annotations

from typing import List

STUDY = "v5"
SOURCE = (
    "docs/stress_v5.md (the sequential study's final calls; tools/verdict_levels.py on "
    "docs/stress_v5_tiny_cpu and docs/stress_v5_chain_tiny_cpu); engines v5 did not run: "
    "docs/stress_v3.md"
)
NOTE = (
    "the shipped tiny bases on CPU, 30 steps; v5's calls (8-40 paired test seeds: held = called "
    "equivalent within +-0.02 or better), v3's for SGLang bf16, FP8, engine temperature and "
    "logit sigma <= 0.6 (no loss detected = undecided)"
)

_ADD9 = ("p3o", "p3o_no_kl", "grpo", "tis", "p4o", "icepop", "m2po", "decoupled_ppo",
         "seq_mask_tis")  # fmt: skip
_NOISE_GRID = "stress_v3_dose_noise_tiny_cpu"
_ENGINES = "stress_v3_engines_tiny_cpu"
_CHAIN = "stress_v3_chain_tiny_cpu"

# per_token: mean |ℓθ − ℓb|; per_sequence: mean |Σ_t (ℓθ − ℓb)|; kl: KL(πb‖πθ) per token
_V3: List[dict] = [
    {
        "setting": "bf16",
        "grid": _NOISE_GRID,
        "task": "arithmetic",
        "what": "embedded bf16 engine (the control)",
        "per_token": 0.0090,
        "per_sequence": 0.0238,
        "kl": 1.68e-4,
        "held": _ADD9 + ("grpo_bypass",),
        "failed": {},
    },
    {
        "setting": "sglang_bf16",
        "grid": _ENGINES,
        "task": "arithmetic",
        "what": "real SGLang 0.5.23 server, bf16",
        "per_token": 0.0075,
        "per_sequence": 0.0208,
        "kl": 1.38e-4,
        "held": ("p3o", "grpo", "tis"),
        "failed": {},
    },
    {
        "setting": "fp8",
        "grid": _ENGINES,
        "task": "arithmetic",
        "what": "embedded simulated FP8 (w8a8, FP8 KV cache)",
        "per_token": 0.0595,
        "per_sequence": 0.1711,
        "kl": 8.69e-3,
        "held": ("p3o", "grpo", "tis"),
        "failed": {},
    },
    {
        "setting": "temp_0.9",
        "grid": _NOISE_GRID,
        "task": "arithmetic",
        "what": "engine temperature 0.9",
        "per_token": 0.0319,
        "per_sequence": 0.0836,
        "kl": 1.84e-3,
        "held": ("p3o", "grpo", "tis"),
        "failed": {},
    },
    {
        "setting": "temp_1.15",
        "grid": _NOISE_GRID,
        "task": "arithmetic",
        "what": "engine temperature 1.15",
        "per_token": 0.0560,
        "per_sequence": 0.1419,
        "kl": 6.05e-3,
        "held": ("p3o", "tis"),
        "failed": {"grpo": "breaks: -0.015 from its control (Holm-corrected)"},
    },
    {
        "setting": "temp_0.8",
        "grid": _NOISE_GRID,
        "task": "arithmetic",
        "what": "engine temperature 0.8",
        "per_token": 0.0616,
        "per_sequence": 0.1632,
        "kl": 6.52e-3,
        "held": ("p3o", "grpo", "tis"),
        "failed": {},
    },
    {
        "setting": "logit_0.3",
        "grid": _NOISE_GRID,
        "task": "arithmetic",
        "what": "engine logit noise σ 0.3",
        "per_token": 0.1010,
        "per_sequence": 0.2549,
        "kl": 1.39e-2,
        "held": _ADD9,
        "failed": {},
    },
    {
        "setting": "logit_0.6",
        "grid": _NOISE_GRID,
        "task": "arithmetic",
        "what": "engine logit noise σ 0.6",
        "per_token": 0.1990,
        "per_sequence": 0.5011,
        "kl": 5.19e-2,
        "held": _ADD9,
        "failed": {},
    },
    {
        "setting": "logit_0.9",
        "grid": _NOISE_GRID,
        "task": "arithmetic",
        "what": "engine logit noise σ 0.9",
        "per_token": 0.2941,
        "per_sequence": 0.8023,
        "kl": 1.09e-1,
        "held": tuple(o for o in _ADD9 if o != "p3o"),
        "failed": {"p3o": "loses to TIS by 0.032 (Holm p 0.006); no-k3 beats it by 0.040"},
    },
    {
        "setting": "logit_1.2",
        "grid": _NOISE_GRID,
        "task": "arithmetic",
        "what": "engine logit noise σ 1.2",
        "per_token": 0.3920,
        "per_sequence": 1.1262,
        "kl": 1.87e-1,
        "held": tuple(o for o in _ADD9 if o not in ("p3o", "p4o")),
        "failed": {
            "p3o": "breaks (-0.149); loses to GRPO / TIS by 0.144 / 0.153",
            "p4o": "breaks (-0.145)",
        },
    },  # fmt: skip
    {
        "setting": "logit_1.2 (150 steps)",
        "grid": "stress_v3_long_tiny_cpu",
        "task": "arithmetic",
        "what": "engine logit noise σ 1.2, 150 steps",
        "per_token": 0.3954,
        "per_sequence": 1.0944,
        "kl": 2.10e-1,
        "held": ("p3o_no_kl", "grpo", "tis"),
        "failed": {
            "p3o": "collapses to 0.006 held-out accuracy (-0.70 / -0.72 against GRPO / TIS)"
        },
    },
    {
        "setting": "chain bf16",
        "grid": _CHAIN,
        "task": "reasoning_gym:chain_sum",
        "what": "embedded bf16 engine, 27-61-token completions (the control)",
        "per_token": 0.0015,
        "per_sequence": 0.0339,
        "kl": 3.29e-5,
        "held": ("p3o", "grpo", "tis"),
        "failed": {},
    },
    {
        "setting": "chain logit_1.2",
        "grid": _CHAIN,
        "task": "reasoning_gym:chain_sum",
        "what": "engine logit noise σ 1.2, 27-61-token completions",
        "per_token": 0.0759,
        "per_sequence": 1.9661,
        "kl": 4.23e-2,
        "held": (),
        "failed": {
            "p3o": "collapses (-0.66 / -0.65 against GRPO / TIS)",
            "grpo": "breaks (-0.06)",
            "tis": "breaks (-0.07)",
        },
    },  # fmt: skip
]


# the v5 levels (the sequential study's final calls): python tools/verdict_levels.py
# recipes/stress_v5_tiny_cpu.yaml docs/stress_v5_tiny_cpu recipes/stress_v5_chain_tiny_cpu.yaml
# docs/stress_v5_chain_tiny_cpu
_V5: List[dict] = [
    {'setting': 'bf16',
     'grid': 'stress_v5_tiny_cpu',
     'task': 'arithmetic',
     'what': 'embedded bf16 engine (the control)',
     'per_token': 0.0083,
     'per_sequence': 0.0224,
     'kl': 0.000169,
     'kind': 'embedded_bf16',
     'held': ('grpo_recompute', 'p3o', 'p3o_no_kl', 'tis'),
     'undecided': (),
     'failed': {},
     'calls': {'tis': 'equivalent', 'grpo_recompute': 'equivalent', 'p3o_no_kl': 'equivalent'}},
    {'setting': 'logit_0.9',
     'grid': 'stress_v5_tiny_cpu',
     'task': 'arithmetic',
     'what': 'engine logit noise σ 0.9',
     'per_token': 0.281,
     'per_sequence': 0.7326,
     'kl': 0.109,
     'kind': 'logit_noise',
     'held': ('grpo_recompute', 'p3o_no_kl', 'tis'),
     'undecided': (),
     'failed': {'p3o': 'tis better (+0.035 [+0.003, +0.068] at look 2 (16 seeds), p 0.02122); '
                       'grpo_recompute better (+0.030 [+0.009, +0.051] at look 2 (16 seeds), p '
                       '0.001173); p3o_no_kl better (+0.045 [+0.013, +0.077] at look 2 (16 '
                       'seeds), p 0.001169)'},
     'calls': {'tis': 'better', 'grpo_recompute': 'better', 'p3o_no_kl': 'better'}},
    {'setting': 'logit_1.2',
     'grid': 'stress_v5_tiny_cpu',
     'task': 'arithmetic',
     'what': 'engine logit noise σ 1.2',
     'per_token': 0.3659,
     'per_sequence': 0.988,
     'kl': 0.192,
     'kind': 'logit_noise',
     'held': ('grpo_recompute', 'p3o_no_kl', 'tis'),
     'undecided': (),
     'failed': {'p3o': 'tis better (+0.138 [+0.010, +0.266] at look 1 (8 seeds), p 0.03133); '
                       'grpo_recompute better (+0.140 [+0.007, +0.273] at look 1 (8 seeds), p '
                       '0.03584); p3o_no_kl better (+0.144 [+0.043, +0.244] at look 1 (8 '
                       'seeds), p 0.004868)'},
     'calls': {'tis': 'better', 'grpo_recompute': 'better', 'p3o_no_kl': 'better'}},
    {'setting': 'round_1',
     'grid': 'stress_v5_tiny_cpu',
     'task': 'arithmetic',
     'what': "engine's weights rounded per channel to 0.143·max|w| (fp32 engine)",
     'per_token': 0.0538,
     'per_sequence': 0.1419,
     'kl': 0.00594,
     'kind': 'weight_rounding',
     'held': ('p3o', 'p3o_no_kl', 'tis'),
     'undecided': (),
     'failed': {'grpo_recompute': 'worse than p3o (-0.014 [-0.026, -0.003] at look 4 (40 '
                                  'seeds), p 0.00454)'},
     'calls': {'tis': 'equivalent', 'grpo_recompute': 'worse', 'p3o_no_kl': 'equivalent'}},
    {'setting': 'round_2',
     'grid': 'stress_v5_tiny_cpu',
     'task': 'arithmetic',
     'what': "engine's weights rounded per channel to 0.3·max|w| (fp32 engine)",
     'per_token': 0.1791,
     'per_sequence': 0.5154,
     'kl': 0.0672,
     'kind': 'weight_rounding',
     'held': ('grpo_recompute', 'p3o_no_kl', 'tis'),
     'undecided': (),
     'failed': {'p3o': 'tis better (+0.253 [+0.100, +0.406] at look 1 (8 seeds), p 0.001847); '
                       'grpo_recompute better (+0.117 [+0.010, +0.224] at look 1 (8 seeds), p '
                       '0.02853); p3o_no_kl better (+0.228 [+0.068, +0.387] at look 1 (8 '
                       'seeds), p 0.004896)'},
     'calls': {'tis': 'better', 'grpo_recompute': 'better', 'p3o_no_kl': 'better'}},
    {'setting': 'round_3',
     'grid': 'stress_v5_tiny_cpu',
     'task': 'arithmetic',
     'what': "engine's weights rounded per channel to 0.36·max|w| (fp32 engine)",
     'per_token': 0.2817,
     'per_sequence': 0.7819,
     'kl': 0.117,
     'kind': 'weight_rounding',
     'held': ('grpo_recompute', 'p3o_no_kl', 'tis'),
     'undecided': (),
     'failed': {'p3o': 'tis better (+0.491 [+0.401, +0.582] at look 1 (8 seeds), p 5.086e-07); '
                       'grpo_recompute better (+0.287 [+0.180, +0.394] at look 1 (8 seeds), p '
                       '6.789e-05); p3o_no_kl better (+0.467 [+0.390, +0.544] at look 1 (8 '
                       'seeds), p 2.342e-07)'},
     'calls': {'tis': 'better', 'grpo_recompute': 'better', 'p3o_no_kl': 'better'}},
    {'setting': 'chain logit_0.6',
     'grid': 'stress_v5_chain_tiny_cpu',
     'task': 'reasoning_gym:chain_sum',
     'what': 'engine logit noise σ 0.6, 27-61-token completions',
     'per_token': 0.0379,
     'per_sequence': 0.6879,
     'kl': 0.01,
     'kind': 'logit_noise',
     'held': (),
     'undecided': ('grpo_recompute', 'p3o', 'p3o_no_kl', 'tis'),
     'failed': {},
     'calls': {'tis': 'undecided at cap',
               'grpo_recompute': 'undecided at cap',
               'p3o_no_kl': 'undecided at cap'}},
    {'setting': 'chain logit_1.2',
     'grid': 'stress_v5_chain_tiny_cpu',
     'task': 'reasoning_gym:chain_sum',
     'what': 'engine logit noise σ 1.2, 27-61-token completions',
     'per_token': 0.0982,
     'per_sequence': 2.146,
     'kl': 0.0482,
     'kind': 'logit_noise',
     'held': ('grpo_recompute', 'p3o_no_kl', 'tis'),
     'undecided': (),
     'failed': {'p3o': 'tis better (+0.355 [+0.270, +0.440] at look 1 (8 seeds), p 4.985e-06); '
                       'grpo_recompute better (+0.358 [+0.303, +0.413] at look 1 (8 seeds), p '
                       '2.255e-07); p3o_no_kl better (+0.367 [+0.305, +0.429] at look 1 (8 '
                       'seeds), p 4.537e-07)'},
     'calls': {'tis': 'better', 'grpo_recompute': 'better', 'p3o_no_kl': 'better'}},
]  # fmt: skip

# v3's levels that v4 and v5 re-measured (bf16, logit σ 0.9 / 1.2 at 30 steps, the v3 chain base,
# which could not be rebuilt on another CPU) give way to v5's
_REPLACED = ("bf16", "logit_0.9", "logit_1.2", "chain bf16", "chain logit_1.2")
# the kind of mismatch of each v3 level (v5's levels carry theirs from tools/verdict_levels.py)
_V3_KIND = {"sglang_bf16": "sglang_bf16", "fp8": "embedded_fp8"}


def _v3(lv: dict) -> dict:
    """A v3 level in the one meaning: its "held" (no Holm-corrected loss) is undecided."""
    kind = _V3_KIND.get(lv["setting"]) or (
        "engine_temperature" if lv["setting"].startswith("temp") else "logit_noise"
    )
    return {"study": "v3", **lv, "kind": kind, "held": (), "undecided": tuple(lv["held"])}


LEVELS: List[dict] = [{"study": "v5", **lv} for lv in _V5] + [
    _v3(lv) for lv in _V3 if lv["setting"] not in _REPLACED
]


def _name(lv: dict) -> str:
    return f"{lv['study']} {lv['setting']} ({lv['per_token']:.3g}/{lv['per_sequence']:.3g})"


def engine_kind(engine: dict) -> str:
    """The kind of mismatch of an engine described as ``probe.engine_of`` describes it: the
    stress perturbations it carries (``+``-joined when several), else its engine and precision
    (``embedded_bf16``, ``embedded_fp8``, ``sglang_bf16``, ``embedded_fp32``, ...)."""
    names = {"logit_noise": "logit_noise", "weight_rounding_step": "weight_rounding",
             "engine_temperature": "engine_temperature"}  # fmt: skip
    perturbed = [k for k in names if engine.get(k)]
    if perturbed:
        return "+".join(names[k] for k in perturbed)
    if engine.get("engine") == "embedded":
        prec = str(engine.get("precision"))
        return "embedded_fp8" if prec.startswith("fp8") else f"embedded_{prec}"
    dtype = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(
        str(engine.get("dtype")), str(engine.get("dtype"))
    )
    quant = engine.get("quantization")
    return f"sglang_{quant}" if quant else f"sglang_{dtype}"


_SHIPPED_TASK = {"tiny_addition": "arithmetic", "chain_sum": "reasoning_gym:chain_sum"}


def studied_task(checkpoint) -> str:
    """The task a study ran, if ``checkpoint`` is a shipped base it ran (its ``base.json``,
    next to the checkpoint, names the shipped base: ``tools/make_tiny_base.py`` and
    ``tools/make_base.py`` write it when installing); "" otherwise."""
    import json
    from pathlib import Path

    try:
        info = json.loads((Path(checkpoint).parent / "base.json").read_text())
    except (OSError, ValueError):
        return ""
    return _SHIPPED_TASK.get(str(info.get("shipped", "")), "")


def _status(lv: dict, o: str) -> str:
    if o in lv["failed"]:
        return "failed"
    if o in lv["held"]:
        return "held"
    if o in lv.get("undecided", ()):
        return "undecided"
    return "not run"


def verdict(per_token: float, per_sequence: float, kind: str = "", task: str = "") -> dict:
    """What the studies say of an engine of mismatch ``kind`` (:func:`engine_kind`) on ``task``
    (:func:`studied_task`) with this mean per-token |Δℓ| and per-sequence |ΣΔℓ|.

    Only levels of the same kind and task are used (module docstring); none: "not studied".
    Otherwise the nearest of them (log-distance on both measures) gives each objective's
    status there (held / failed / undecided / not run), and ``beyond_study`` says whether the
    engine lies outside the range of per-token |Δℓ| that kind was run at (within 25% of a
    level counts as at it: a probe's estimate on 64 prompts moves about that much)."""
    import math

    same = [lv for lv in LEVELS if lv["kind"] == kind and lv["task"] == task]
    base = {"study": STUDY, "source": SOURCE, "note": NOTE, "kind": kind, "task": task,
            "rule": "held: called equivalent (+-0.02) or better than its comparator at the "
            "nearest level of this kind and task; failed: called worse; undecided: neither "
            "shown; not studied: no level of this kind and task"}  # fmt: skip
    if not same:
        kinds = sorted({(lv["kind"], lv["task"]) for lv in LEVELS})
        what = (f"kind {kind!r}" if task else "this model") + (f" on {task}" if task else "")
        return {**base, "studied": False, "beyond_study": None, "nearest_level": None,
                "objectives": {}, "held": [], "failed": [], "undecided": [],
                "summary": f"not studied: no stress level of {what} in the {STUDY} or v3 "
                f"study (they ran the shipped tiny bases; studied kinds and tasks: "
                f"{', '.join(f'{k} ({t})' for k, t in kinds)})"}  # fmt: skip

    def dist(lv):
        t = math.log(max(per_token, 1e-12) / lv["per_token"])
        q = math.log(max(per_sequence, 1e-12) / lv["per_sequence"])
        return math.hypot(t, q)

    near = min(same, key=dist)
    lo, hi = min(lv["per_token"] for lv in same), max(lv["per_token"] for lv in same)
    beyond = not (lo <= per_token <= hi) and not math.isclose(per_token, near["per_token"],
                                                              rel_tol=0.25)  # fmt: skip
    objectives = sorted({o for lv in same for o in
                         (*lv["held"], *lv["failed"], *lv.get("undecided", ()))})  # fmt: skip
    calls = {o: {"call": _status(near, o), "at": _name(near)} for o in objectives}
    for o, c in calls.items():
        if c["call"] == "failed":
            c["why"] = near["failed"][o]
    by = {c: [o for o in objectives if calls[o]["call"] == c]
          for c in ("held", "failed", "undecided")}  # fmt: skip
    where = (f"beyond the {kind} levels run ({lo:.3g}–{hi:.3g} per token; no call carried "
             f"there), the nearest {_name(near)} [{near['what']}]" if beyond
             else f"nearest {kind} level {_name(near)} [{near['what']}]")  # fmt: skip
    parts = [f"{c}: {', '.join(by[c])}" for c in ("held", "failed", "undecided") if by[c]]
    return {
        **base,
        "studied": True,
        "beyond_study": beyond,
        "nearest_level": {
            **{
                k: near[k]
                for k in (
                    "study",
                    "setting",
                    "grid",
                    "task",
                    "kind",
                    "what",
                    "per_token",
                    "per_sequence",
                    "kl",
                )
            },  # fmt: skip
            "p3o": _status(near, "p3o"),
        },
        "objectives": calls,
        **by,
        "summary": f"{STUDY} study ({NOTE}): {where}, where P3O {_status(near, 'p3o')}; "
        + "; ".join(parts),
    }
