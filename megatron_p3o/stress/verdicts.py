"""Which objectives held at which train–rollout mismatch level: the stress study's findings as
data, for ``python -m megatron_p3o.probe`` to place a measured engine against.

Source: the **v3 study** (issue 28, v3.3 run; the tiny addition model, 30 steps, and 150 steps
for the long grid; the chain_sum model for the longer-completion grid): break points and
corrected calls from ``docs/stress_v3.md`` and the v3.3 paragraphs of ``docs/stress.md``; each
level's mismatch is the mean of that setting's probe columns (``probe_abs_dlogp``,
``probe_abs_seq_dlogp``, ``probe_kl_b_theta``, measured at the base weights on 64 held-out
prompts) over its cells in ``docs/stress_v3_*/cells.csv``. In short: the paper's claim held at
realistic mismatch (bf16, SGLang bf16, simulated FP8 0.06, engine temperature, logit noise
σ ≤ 0.6) and failed at per-token mismatch ≥ 0.29, and on the chain task already at 0.076 per
token, where 40-token completions add it up to 1.97 per sequence. **These are v3's findings
until the v4 study's replace this table.**

Only engine-side (exogenous) levels are here: what a probe can measure. Staleness, reuse and
corrupted reported ℓb are not an engine's mismatch (the probe does not see them).

An objective *held* at a level when it has no Holm-corrected loss there, neither to its own
control nor (P3O) to a pre-registered comparator (GRPO, TIS); it *failed* when it has one. At a
control level every objective is its own reference (P3O ties GRPO and TIS there).
"""

from __future__ import annotations

from typing import Dict, List

STUDY = "v3"
SOURCE = (
    "docs/stress_v3.md (break points, corrected calls) and docs/stress.md (v3.3 findings); "
    "levels: each setting's probe columns averaged over its cells in docs/stress_v3_*/cells.csv"
)
NOTE = "v3's findings (tiny models, CPU) until the v4 study's replace this table"

_ADD9 = ("p3o", "p3o_no_kl", "grpo", "tis", "p4o", "icepop", "m2po", "decoupled_ppo",
         "seq_mask_tis")  # fmt: skip
_NOISE_GRID = "stress_v3_dose_noise_tiny_cpu"
_ENGINES = "stress_v3_engines_tiny_cpu"
_CHAIN = "stress_v3_chain_tiny_cpu"

# per_token: mean |ℓθ − ℓb|; per_sequence: mean |Σ_t (ℓθ − ℓb)|; kl: KL(πb‖πθ) per token
LEVELS: List[dict] = [
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


def _name(lv: dict) -> str:
    return f"{lv['setting']} ({lv['per_token']:.3g}/{lv['per_sequence']:.3g})"


def verdict(per_token: float, per_sequence: float) -> dict:
    """What the study says of an engine with this mean per-token |Δℓ| and per-sequence |ΣΔℓ|.

    An objective **held** here when it held at a study level with at least this mismatch on
    both measures (it held under more); it **failed** when it failed at a level with at most
    this mismatch on both (it failed under less); **mixed** when both, **untested** when
    neither. Levels are named ``setting (per-token/per-sequence)``; the nearest level is the
    closest in log-distance on both measures."""
    import math

    above = [lv for lv in LEVELS
             if lv["per_token"] >= per_token and lv["per_sequence"] >= per_sequence]  # fmt: skip
    below = [lv for lv in LEVELS
             if lv["per_token"] <= per_token and lv["per_sequence"] <= per_sequence]  # fmt: skip
    objectives = sorted({o for lv in LEVELS for o in (*lv["held"], *lv["failed"])})
    calls: Dict[str, dict] = {}
    for o in objectives:
        held = sorted((lv for lv in above if o in lv["held"]), key=lambda lv: lv["per_token"])
        failed = sorted((lv for lv in below if o in lv["failed"]), key=lambda lv: -lv["per_token"])
        call = ("mixed" if held and failed else "held" if held else "failed" if failed
                else "untested")  # fmt: skip
        calls[o] = {"call": call}
        if held:  # the least mismatch it held under that bounds this engine's
            calls[o]["held_at"] = _name(held[0])
        if failed:  # the most mismatch it failed under that this engine's bounds
            calls[o]["failed_at"] = _name(failed[0])
            calls[o]["why"] = failed[0]["failed"][o]

    def dist(lv):
        t = math.log(max(per_token, 1e-12) / lv["per_token"])
        s = math.log(max(per_sequence, 1e-12) / lv["per_sequence"])
        return math.hypot(t, s)

    near = min(LEVELS, key=dist)
    by = {c: [o for o in objectives if calls[o]["call"] == c]
          for c in ("held", "failed", "mixed", "untested")}  # fmt: skip
    p3o = calls["p3o"]
    claim = {
        "held": "P3O held at at least this mismatch",
        "failed": "P3O failed at this mismatch or less",
        "mixed": "P3O both held and failed around this mismatch",
        "untested": "no study level brackets this mismatch for P3O",
    }[p3o["call"]]
    parts = [f"{c}: {', '.join(by[c])}" for c in ("held", "failed", "mixed") if by[c]]
    beyond = not above
    return {
        "study": STUDY,
        "source": SOURCE,
        "note": NOTE,
        "rule": "held: held at a study level with at least this per-token and per-sequence "
        "|Δℓ|; failed: failed at a level with at most both; mixed: both; untested: neither",
        "beyond_study": beyond,
        "nearest_level": {
            k: near[k]
            for k in ("setting", "grid", "task", "what", "per_token", "per_sequence", "kl")
        },  # fmt: skip
        "objectives": calls,
        **by,
        "summary": f"{STUDY} study ({NOTE}): {claim}"
        + (" (beyond the largest mismatch the study measured)" if beyond else "")
        + f"; nearest level {_name(near)} [{near['what']}]; "
        + "; ".join(parts),
    }
