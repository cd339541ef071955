"""Record peer implementations of IcePop / seq-mask-TIS (and AReaL's M2PO) into a JSON fixture.

Run once by a developer, by hand, NOT in CI: CI and the tests only read the JSON this writes
(tests/fixtures/peer_mismatch_corrections.json by default). The numbers are computed by the
peers' own code: each peer function or class is cut out of the peer's source file with ``ast``
(original line numbers kept, so tracebacks point into the peer file), exec'd into a scratch
module whose unrelated imports (megatron, ray, pydantic, the peers' logging and stats helpers,
the model forward) are replaced by small stand-ins, and then called on fixed float64 inputs
built from a seeded ``torch.Generator``. For every case the peer's loss, the autograd gradient
of that loss w.r.t. the current log-probs, and the peer's masked-fraction metrics are written,
together with the peer repo, commit, file, function and line span that produced them.
docs/notes/peer_mismatch_corrections.md says what each peer computes.

How to run (in a scratch venv outside the repo; nothing of the peers is installed anywhere):

    python3 -m venv /tmp/peervenv
    /tmp/peervenv/bin/pip install torch==2.13.0 numpy
    /tmp/peervenv/bin/python tools/record_peer_mismatch.py \\
        --nemo-rl /path/to/NVIDIA-NeMo/RL.git \\
        --areal /path/to/inclusionAI/AReaL.git \\
        --slime /path/to/THUDM/slime.git

Each peer argument is a git directory (bare mirror or checkout) of that repository, optionally
``DIR@REV`` (default HEAD); the commit actually read is written into the fixture. A peer that is
left out is skipped (its cases are not written). ``--out`` changes the output path.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import json
import subprocess
import sys
import types
import typing
from argparse import Namespace
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "peer_mismatch_corrections.json"

SEED = 20251001
B, T = 4, 7
LENGTHS = [7, 4, 1, 6]  # ragged; sequence 2 has a single token
DTYPE = torch.float64


# --------------------------------------------------------------------------------------------
# Reading peer sources
# --------------------------------------------------------------------------------------------


class PeerSource:
    """A peer repository read through git (bare mirror or checkout), pinned to one commit."""

    def __init__(self, spec: str, repo_name: str):
        path, _, rev = spec.partition("@")
        self.path = Path(path)
        self.repo = repo_name
        bare = (self.path / "objects").is_dir() and (self.path / "HEAD").is_file()
        self._git = ["git", f"--git-dir={self.path}"] if bare else ["git", "-C", str(self.path)]
        self.commit = self.git("rev-parse", f"{rev or 'HEAD'}^{{commit}}").strip()

    def git(self, *args: str) -> str:
        return subprocess.run(
            [*self._git, *args], check=True, capture_output=True, text=True
        ).stdout

    def read(self, relpath: str) -> str:
        return self.git("show", f"{self.commit}:{relpath}")


def new_module(name: str, **names) -> types.ModuleType:
    """A scratch module (registered in sys.modules, which dataclasses need) seeded with names."""
    mod = types.ModuleType(name)
    mod.__dict__.update(names)
    sys.modules[name] = mod
    return mod


def load_defs(
    src: PeerSource,
    relpath: str,
    names: list[str],
    mod: types.ModuleType,
    strip_decorators: tuple[str, ...] = (),
) -> dict[str, list[int]]:
    """Exec the named top-level defs/classes/assignments of a peer file into ``mod``.

    Annotations are compiled lazily (PEP 563) so that type-only imports need no stand-ins.
    Returns {name: [first_line, last_line]} in the peer file.
    """
    tree = ast.parse(src.read(relpath), filename=relpath)
    picked, spans = [], {}
    for node in tree.body:
        name = None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            if isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
        if name not in names:
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        spans[name] = [first, node.end_lineno]
        if strip_decorators and hasattr(node, "decorator_list"):
            node.decorator_list = [
                d for d in node.decorator_list if ast.unparse(d) not in strip_decorators
            ]
        picked.append(node)
    missing = sorted(set(names) - set(spans))
    if missing:
        raise SystemExit(f"{src.repo}@{src.commit}:{relpath}: not found: {missing}")
    lazy = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)
    module = ast.fix_missing_locations(ast.Module(body=[lazy, *picked], type_ignores=[]))
    code = compile(module, f"{src.repo}@{src.commit[:12]}/{relpath}", "exec", dont_inherit=True)
    exec(code, mod.__dict__)
    return spans


def exec_whole(src: PeerSource, relpath: str, mod: types.ModuleType) -> None:
    """Exec a whole peer file (only for files whose imports are all stdlib)."""
    text = src.read(relpath)
    exec(compile(text, f"{src.repo}@{src.commit[:12]}/{relpath}", "exec"), mod.__dict__)


def class_defaults(src: PeerSource, relpath: str, class_name: str) -> dict:
    """Literal defaults of the annotated fields of a (pydantic/dataclass) config class."""
    tree = ast.parse(src.read(relpath))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            out = {}
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                    out[stmt.target.id] = ast.literal_eval(stmt.value)
            return out
    raise SystemExit(f"{relpath}: class {class_name} not found")


def _not_needed(name: str) -> Callable:
    def fail(*args, **kwargs):
        raise RuntimeError(f"stand-in {name} was called; the recorded path must not need it")

    return fail


def _def_record(src: PeerSource, file: str, function: str, spans: dict) -> dict:
    return {
        "repo": src.repo,
        "commit": src.commit,
        "file": file,
        "function": function,
        "loaded_defs": {k: v for k, v in spans.items()},
    }


# --------------------------------------------------------------------------------------------
# Fixed inputs
# --------------------------------------------------------------------------------------------


def make_inputs() -> dict[str, torch.Tensor]:
    """B=4 sequences, T=7 tokens, float64; see the fixture's "inputs_design" for the intent."""
    g = torch.Generator().manual_seed(SEED)
    lengths = torch.tensor(LENGTHS)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(DTYPE)

    # log(pi_old / pi_b) per token: designed per sequence, with generator noise on top.
    log_is = torch.full((B, T), 2.5, dtype=DTYPE)  # padding: would be out of every band
    noise = torch.randn(B, T, generator=g, dtype=DTYPE)
    s0 = 5e-4 * noise[0]
    log_is[0] = s0 - s0.mean() + 3e-4  # geo-mean exp(3e-4): inside [0.999, 1.002]
    base1 = torch.tensor([0.05, -0.6, -1.2, 0.1], dtype=DTYPE)
    log_is[1, :4] = base1 + 0.02 * noise[1, :4]  # one token at ratio ~0.30, one at ~0.55
    log_is[2, :1] = 2.0  # single token, ratio e^2 ~ 7.39
    base3 = torch.tensor([0.1, -0.25, 1.7, -0.4, -0.3, 0.05], dtype=DTYPE)
    log_is[3, :6] = base3 + 0.02 * noise[3, :6]  # one token at ratio ~5.5, geo-mean ~1.16

    old = torch.log(0.05 + 0.9 * torch.rand(B, T, generator=g, dtype=DTYPE))
    old = torch.minimum(old, log_is - 0.05)  # keeps the behaviour log-probs <= -0.05
    behavior = old - log_is
    logprobs = (old + 0.2 * torch.randn(B, T, generator=g, dtype=DTYPE)).clamp(max=-0.01)
    advantages = torch.randn(B, T, generator=g, dtype=DTYPE)
    return {
        "logprobs": logprobs,
        "old_logprobs": old,
        "behavior_logprobs": behavior,
        "advantages": advantages,
        "mask": mask,
    }


def check_design(x: dict[str, torch.Tensor]) -> None:
    """Fail loudly if the inputs stop exercising the bands they are meant to exercise."""
    m = x["mask"].bool()
    r = torch.exp(x["old_logprobs"] - x["behavior_logprobs"])
    out_icepop = (m & ((r < 0.5) | (r > 5.0))).sum().item()
    assert 2 <= out_icepop < m.sum().item() - 2, out_icepop
    lr = (x["old_logprobs"] - x["behavior_logprobs"]) * x["mask"]
    geo = torch.exp(lr.sum(-1) / x["mask"].sum(-1))
    tight = ((geo >= 0.999) & (geo <= 1.002)).tolist()
    wide = ((geo >= 0.8) & (geo <= 1.25)).tolist()
    assert tight == [True, False, False, False], geo
    assert wide == [True, False, False, True], geo
    pr = torch.exp(x["logprobs"] - x["old_logprobs"])[m]
    assert ((pr < 0.8) | (pr > 1.2)).any() and ((pr > 0.8) & (pr < 1.2)).any()
    assert (x["advantages"][m] < 0).any() and (x["advantages"][m] > 0).any()


def as_lists(x: dict[str, torch.Tensor]) -> dict:
    out = {k: v.tolist() for k, v in x.items()}
    out["lengths"] = list(LENGTHS)
    return out


def scalar(v) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


# --------------------------------------------------------------------------------------------
# NeMo-RL: ClippedPGLossFn
# --------------------------------------------------------------------------------------------

NEMO_LOSS = "nemo_rl/algorithms/loss/loss_functions.py"
NEMO_UTILS = "nemo_rl/algorithms/utils.py"
NEMO_IFACE = "nemo_rl/algorithms/loss/interfaces.py"


def nemo_cases(src: PeerSource, x: dict[str, torch.Tensor]) -> tuple[dict, list[dict]]:
    mod = new_module(
        "peer_nemo_rl",
        torch=torch,
        enum=enum,
        Any=typing.Any,
        Optional=typing.Optional,
        Protocol=typing.Protocol,
        TypedDict=typing.TypedDict,
        NotRequired=typing.NotRequired if hasattr(typing, "NotRequired") else typing.Any,
        TypeVar=typing.TypeVar,
        BatchedDataDict=dict,
    )
    spans = {}
    iface = ["LossType", "MetricNormalizer", "LossInputType", "LossFunction"]
    spans.update(load_defs(src, NEMO_IFACE, iface, mod))
    spans.update(load_defs(src, NEMO_UTILS, ["calculate_kl", "masked_mean"], mod))
    spans.update(load_defs(src, NEMO_LOSS, ["Tensor", "ClippedPGLossFn"], mod))
    defaults = class_defaults(src, NEMO_LOSS, "ClippedPGLossConfig")
    peer = _def_record(src, NEMO_LOSS, "ClippedPGLossFn.__call__", spans)
    peer["config_class"] = "ClippedPGLossConfig (literal defaults read from the peer file)"

    common = {
        "reference_policy_kl_penalty": 0.0,
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.2,
        "ratio_clip_c": None,
        "token_level_loss": True,
        "use_importance_sampling_correction": True,
    }
    variants = [
        (
            "nemo_rl_icepop",
            "icepop",
            {
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio_min": 0.5,
                "truncated_importance_sampling_ratio": 5.0,
            },
            "band [0.5, 5.0] = NeMo-RL's reference ICE-POP bounds "
            "(examples/configs/prorlv2.v2.yaml; the config class itself defaults to None)",
        ),
        (
            "nemo_rl_seq_mask_tis_default_band",
            "seq_mask_tis",
            {
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio_min": 0.999,
                "truncated_importance_sampling_ratio": 1.002,
            },
            "band [0.999, 1.002] = NeMo-RL's reference seq-mask-tis bounds "
            "(examples/configs/prorlv2_1_moe.v2.yaml); only sequence 0 is kept",
        ),
        (
            "nemo_rl_seq_mask_tis_wide_band",
            "seq_mask_tis",
            {
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio_min": 0.8,
                "truncated_importance_sampling_ratio": 1.25,
            },
            "band [0.8, 1.25]: sequences 0 and 3 kept, 1 and 2 masked",
        ),
    ]
    aggregation = (
        "token-level: sum over mask of w_t * clip_loss_t / (global_valid_toks + 1e-8), "
        "global_valid_toks = sum(token_mask[:, 1:] * sample_mask) passed in by the caller "
        "(here the whole batch, 18 tokens; NeMo-RL's masked_mean adds 1e-8 to the denominator)"
    )
    cases = []
    for name, objective, tis, band_note in variants:
        cfg_values = {**defaults, **common, **tis}
        loss_fn = mod.ClippedPGLossFn(types.SimpleNamespace(**cfg_values))
        lp = x["logprobs"].clone().requires_grad_(True)

        def pad(t: torch.Tensor) -> torch.Tensor:
            # NeMo-RL data tensors are [B, T+1]; __call__ drops column 0 ([:, 1:]).
            return torch.cat([torch.zeros(B, 1, dtype=t.dtype), t], dim=1)

        data = {
            "input_ids": torch.zeros(B, T + 1, dtype=torch.long),
            "token_mask": pad(x["mask"]),
            "sample_mask": torch.ones(B, dtype=DTYPE),
            "advantages": pad(x["advantages"]),
            "prev_logprobs": pad(x["old_logprobs"]),
            "generation_logprobs": pad(x["behavior_logprobs"]),
            "reference_policy_logprobs": pad(x["old_logprobs"]),
        }
        # As nemo_rl/models/megatron/data.py computes them (single DP rank here).
        global_valid_seqs = data["sample_mask"].sum()
        global_valid_toks = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
        loss, metrics = loss_fn(lp, data, global_valid_seqs, global_valid_toks)
        loss.backward()
        cases.append(
            {
                "name": name,
                "peer": "nemo_rl",
                "objective": objective,
                "peer_config": {
                    **{k: cfg_values[k] for k in sorted(cfg_values)},
                    "global_valid_toks": scalar(global_valid_toks),
                    "global_valid_seqs": scalar(global_valid_seqs),
                },
                "aggregation": aggregation,
                "notes": band_note
                + ". is_oob_ratio = fraction of tokens (icepop) or sequences (seq-mask-tis) "
                "outside the band, normalized by global_valid_toks / global_valid_seqs.",
                "inputs": as_lists(x),
                "loss": scalar(loss),
                "grad_logprobs": lp.grad.tolist(),
                "metrics": {k: scalar(v) for k, v in sorted(metrics.items())},
            }
        )
    return peer, cases


# --------------------------------------------------------------------------------------------
# AReaL: ppo_actor_loss_fn (+ apply_rejection_sampling) and grpo_loss_fn (M2PO)
# --------------------------------------------------------------------------------------------

AREAL_FUNCTIONAL = "areal/utils/functional/functional.py"
AREAL_CLI = "areal/api/cli_args.py"
AREAL_ACTOR = "areal/trainer/ppo/actor.py"
AREAL_CONSTANTS = "areal/utils/constants.py"


class _StatsRecorder:
    """Stand-in for areal.utils.stats_tracker: keeps scalar() calls, ignores the rest."""

    def __init__(self):
        self.scalars: dict[str, float] = {}

    def scalar(self, **kw):
        self.scalars.update({k: scalar(v) for k, v in kw.items()})

    def stat(self, **kw):
        pass

    def denominator(self, **kw):
        pass


def areal_cases(src: PeerSource, x: dict[str, torch.Tensor]) -> tuple[dict, list[dict]]:
    consts = new_module("peer_areal_constants")
    exec_whole(src, AREAL_CONSTANTS, consts)
    stats = _StatsRecorder()
    mod = new_module(
        "peer_areal",
        torch=torch,
        dist=torch.distributed,
        functools=functools,
        dataclass=dataclasses.dataclass,
        field=dataclasses.field,
        Any=typing.Any,
        KLEstimator=types.SimpleNamespace(_compute_approx_kl=_not_needed("KLEstimator")),
        stats_tracker=stats,
        infer_token_denominator=lambda input_data, loss_mask: loss_mask,
        _log_proximal_approximation_stats=lambda **kw: None,
        _log_version_staleness_stats=lambda **kw: None,
        compute_prox_logp_approximations=_not_needed("compute_prox_logp_approximations"),
        sapo_loss_fn=_not_needed("sapo_loss_fn"),
        **{k: v for k, v in vars(consts).items() if not k.startswith("__")},
    )
    spans = {}
    spans.update(load_defs(src, AREAL_CLI, ["RejectionSamplingConfig"], mod))
    spans.update(
        load_defs(
            src,
            AREAL_FUNCTIONAL,
            [
                "_compute_sequence_level_ratio_and_advantages",
                "RejectionSamplingResult",
                "_check_bounds",
                "apply_rejection_sampling",
                "ppo_actor_loss_fn",
            ],
            mod,
        )
    )
    m2_spans = load_defs(
        src,
        AREAL_ACTOR,
        ["grpo_loss_fn", "_resolve_proximal_logp", "_apply_m2po_masking", "_get_m2po_loss_mask"],
        mod,
    )
    rs_defaults = {f.name: f.default for f in dataclasses.fields(mod.RejectionSamplingConfig)}
    peers = {
        "areal": _def_record(src, AREAL_FUNCTIONAL, "ppo_actor_loss_fn", spans),
        "areal_m2po": _def_record(src, AREAL_ACTOR, "grpo_loss_fn", {**spans, **m2_spans}),
    }
    peers["areal"]["rejection_sampling_defaults"] = rs_defaults

    aggregation = (
        "sum over the ORIGINAL loss_mask of behave_imp_weight_t * pg_loss_t / "
        "loss_mask.count_nonzero() (count taken before rejection sampling; one micro-batch, "
        "so the engine's loss_weight / total_loss_weight factor is 1)"
    )
    cases = []
    icepop_variants = [
        (
            "areal_icepop_band",
            {"level": "token", "action": "mask", "metric": "ratio", "upper": 5.0, "lower": 0.5},
            "rejection_sampling with the same [0.5, 5.0] band as nemo_rl_icepop",
        ),
        (
            "areal_icepop_defaults",
            {"level": "token", "action": "mask", "metric": "ratio", "upper": 5.0, "lower": None},
            "RejectionSamplingConfig defaults (upper 5.0, no lower bound)",
        ),
    ]
    for name, rs_kw, note in icepop_variants:
        rs = mod.RejectionSamplingConfig(**rs_kw)
        lp = x["logprobs"].clone().requires_grad_(True)
        loss, stat = mod.ppo_actor_loss_fn(
            logprobs=lp,
            proximal_logprobs=x["old_logprobs"],
            old_logprobs=x["behavior_logprobs"],
            advantages=x["advantages"],
            eps_clip=0.2,
            loss_mask=x["mask"].bool(),
            eps_clip_higher=None,
            c_clip=None,
            rejection_sampling=rs,
            importance_sampling_level="token",
            cu_seqlens=None,
        )
        loss.backward()
        cases.append(
            {
                "name": name,
                "peer": "areal",
                "objective": "icepop",
                "peer_config": {
                    "rejection_sampling": dataclasses.asdict(rs),
                    "eps_clip": 0.2,
                    "eps_clip_higher": None,
                    "c_clip": None,
                    "importance_sampling_level": "token",
                    "use_decoupled_loss": True,
                },
                "aggregation": aggregation,
                "notes": note
                + ". AReaL names: proximal_logprobs = pi_old (recomputed), old_logprobs = "
                "pi_behave (inference). The peer computes the weight in float32 "
                "(log_ratio = prox.float() - old.float()), so behave_imp_weight is float32 "
                "and the loss differs from a float64 derivation at ~1e-7 relative.",
                "inputs": as_lists(x),
                "loss": scalar(loss),
                "grad_logprobs": lp.grad.tolist(),
                "metrics": {
                    "filtered_fraction": scalar(stat["filtered_fraction"]),
                    "behave_imp_weight": stat["behave_imp_weight"].tolist(),
                    "behave_mask": stat["behave_mask"].to(DTYPE).tolist(),
                },
            }
        )

    m2_variants = [
        (
            "areal_m2po_plain",
            {"m2_threshold": 0.04, "eps_clip": 0.2, "rejection_sampling": None},
            "M2PO mask only, PPOActorConfig default eps_clip 0.2, no rejection sampling",
        ),
        (
            "areal_m2po_example_config",
            {
                "m2_threshold": 0.04,
                "eps_clip": 0.0,
                "rejection_sampling": {"metric": "ratio", "upper": 5.0},
            },
            "as examples/math/gsm8k_m2po.yaml: m2_threshold 0.04, eps_clip 0.0, "
            "rejection_sampling {metric: ratio, upper: 5.0} (token mask)",
        ),
    ]
    m2_cases = []
    for name, cfg, note in m2_variants:
        rs = cfg["rejection_sampling"]
        rs_obj = None if rs is None else mod.RejectionSamplingConfig(**rs)
        lp = x["logprobs"].clone().requires_grad_(True)
        input_data = {
            "logprobs": x["behavior_logprobs"],
            "advantages": x["advantages"],
            "loss_mask": x["mask"],
            "prox_logp": x["old_logprobs"],
        }
        stats.scalars.clear()
        loss = mod.grpo_loss_fn(
            lp,
            torch.zeros(B, T, dtype=DTYPE),
            input_data,
            eps_clip=cfg["eps_clip"],
            eps_clip_higher=None,
            c_clip=None,
            rejection_sampling=rs_obj,
            m2_threshold=cfg["m2_threshold"],
            importance_sampling_level="token",
            current_version=None,
            prox_logp_method=consts.PROX_LOGP_METHOD_RECOMPUTE,
            use_sapo_loss=False,
            use_decoupled_loss=True,
        )
        loss.backward()
        keep = mod._apply_m2po_masking(
            x["behavior_logprobs"], x["old_logprobs"], x["mask"].bool(), cfg["m2_threshold"]
        )
        m2 = ((x["behavior_logprobs"] - x["old_logprobs"]) ** 2)[keep]
        metrics = {
            "m2po_keep_mask": keep.to(DTYPE).tolist(),
            "m2po_masked_tokens": scalar((x["mask"].bool() & ~keep).sum()),
            "m2_mean_kept": scalar(m2.mean()),
        }
        metrics.update({k: v for k, v in stats.scalars.items() if k == "rs_filtered_fraction"})
        m2_cases.append(
            {
                "name": name,
                "peer": "areal_m2po",
                "objective": "m2po",
                "peer_config": {
                    **cfg,
                    "rejection_sampling": None if rs_obj is None else dataclasses.asdict(rs_obj),
                    "prox_logp_method": consts.PROX_LOGP_METHOD_RECOMPUTE,
                    "use_decoupled_loss": True,
                    "importance_sampling_level": "token",
                },
                "aggregation": (
                    "grpo_loss_fn replaces loss_mask by the M2PO keep-mask BEFORE "
                    "ppo_actor_loss_fn, so the denominator is the number of M2PO-kept tokens; "
                    "rejection sampling (if any) then zeroes weights without changing it"
                ),
                "notes": note + ". M2 = (logprobs_behave - prox_logp)^2 on loss-mask tokens of the "
                "micro-batch; current log-probs do not enter the mask.",
                "inputs": as_lists(x),
                "loss": scalar(loss),
                "grad_logprobs": lp.grad.tolist(),
                "metrics": metrics,
            }
        )
    return peers, cases + m2_cases


# --------------------------------------------------------------------------------------------
# slime: policy_loss_function / loss_function with icepop_function as the custom TIS function
# --------------------------------------------------------------------------------------------

SLIME_LOSS = "slime/backends/megatron_utils/loss.py"
SLIME_PPO = "slime/utils/ppo_utils.py"
SLIME_CP = "slime/backends/megatron_utils/cp_utils.py"
SLIME_ICEPOP_PATH = "slime.backends.megatron_utils.loss.icepop_function"


def slime_cases(src: PeerSource, x: dict[str, torch.Tensor]) -> tuple[dict, list[dict]]:
    provided = {}

    def get_log_probs_and_entropy(logits, **kw):
        # Stand-in for the model forward: hands the leaf log-probs to the peer loss.
        return None, {"log_probs": provided["log_probs"], "entropy": provided["entropy"]}

    mpu = types.SimpleNamespace(
        get_context_parallel_world_size=lambda: 1,
        get_context_parallel_rank=lambda: 0,
        get_data_parallel_world_size=lambda with_context_parallel=False: 1,
    )
    mod = new_module(
        "peer_slime",
        torch=torch,
        F=F,
        dist=torch.distributed,
        mpu=mpu,
        Any=typing.Any,
        Callable=Callable,
        Iterator=Iterator,
        Namespace=Namespace,
        checkpoint=torch.utils.checkpoint.checkpoint,
        get_log_probs_and_entropy=get_log_probs_and_entropy,
        get_rollout_top_p_logprob_kwargs=lambda args, batch: {},
        _maybe_capture_log_probs=lambda batch, log_probs: None,
        all_gather_with_cp=_not_needed("all_gather_with_cp"),
        compute_opsm_mask=_not_needed("compute_opsm_mask"),
        compute_gspo_kl=_not_needed("compute_gspo_kl"),
        compute_cispo_loss=_not_needed("compute_cispo_loss"),
        compute_approx_kl=_not_needed("compute_approx_kl"),
        value_loss_function=_not_needed("value_loss_function"),
        sft_loss_function=_not_needed("sft_loss_function"),
    )
    spans = {}
    spans.update(load_defs(src, SLIME_CP, ["get_sum_of_sample_mean"], mod))
    # compute_policy_loss is @torch.compile(dynamic=True) in the peer; run eagerly here.
    spans.update(
        load_defs(
            src,
            SLIME_PPO,
            ["compute_policy_loss"],
            mod,
            strip_decorators=("torch.compile(dynamic=True)",),
        )
    )
    spans.update(
        load_defs(
            src,
            SLIME_LOSS,
            ["vanilla_tis_function", "icepop_function", "policy_loss_function", "loss_function"],
            mod,
        )
    )
    mod.load_function = lambda path: {SLIME_ICEPOP_PATH: mod.icepop_function}[path]
    peer = _def_record(src, SLIME_LOSS, "icepop_function (via loss_function)", spans)

    variants = [
        ("slime_icepop_band_per_token_loss", 0.5, 5.0, True),
        ("slime_icepop_band_per_sample_mean", 0.5, 5.0, False),
        ("slime_icepop_defaults_per_sample_mean", 0.0, 2.0, False),
    ]
    lengths = LENGTHS
    cases = []
    for name, low, high, per_token in variants:
        args = Namespace(
            loss_type="policy_loss",
            advantage_estimator="grpo",
            eps_clip=0.2,
            eps_clip_high=0.2,
            eps_clip_c=None,
            use_rollout_logprobs=False,
            use_opsm=False,
            get_mismatch_metrics=False,
            use_tis=True,
            custom_tis_function_path=SLIME_ICEPOP_PATH,
            tis_clip=high,
            tis_clip_low=low,
            calculate_per_token_loss=per_token,
            custom_pg_loss_reducer_function_path=None,
            entropy_coef=0.0,
            use_kl_loss=False,
            recompute_loss_function=False,
            allgather_cp=False,
        )
        lp = x["logprobs"].clone().requires_grad_(True)
        provided["log_probs"] = [lp[i, :n] for i, n in enumerate(lengths)]
        provided["entropy"] = [torch.zeros(n, dtype=DTYPE) for n in lengths]

        def rows(key: str) -> list[torch.Tensor]:
            return [x[key][i, :n] for i, n in enumerate(lengths)]

        batch = {
            "advantages": rows("advantages"),
            "log_probs": rows("old_logprobs"),
            "rollout_log_probs": rows("behavior_logprobs"),
            "response_lengths": list(lengths),
            "total_lengths": [n + 3 for n in lengths],
            "unconcat_tokens": [torch.zeros(n + 3, dtype=torch.long) for n in lengths],
            "loss_masks": [torch.ones(n, dtype=torch.int) for n in lengths],
            # one sample per rollout (rollout_id defaults to the sample index)
            "rollout_mask_sums": torch.tensor(lengths, dtype=torch.float32),
        }
        logits = torch.zeros(1, sum(lengths), 1, dtype=DTYPE)
        returned, normalizer, log = mod.loss_function(
            args, batch, num_microbatches=1, step_global_batch_size=B, logits=logits
        )
        # Effective loss under Megatron (1 micro-batch, DP=CP=1): per-token mode divides by the
        # returned token count; per-sample mode's returned value is already final.
        loss = returned / normalizer if per_token else returned
        loss.backward()
        logged = dict(zip(log["keys"], [scalar(v) for v in log["values"][1:]]))
        denom = scalar(normalizer) if per_token else float(B)
        metrics = {
            "peer_returned_loss": scalar(returned),
            "peer_normalizer": scalar(normalizer),
            "tis_clipfrac": logged["tis_clipfrac"] / denom,
            "logged_raw": logged,
        }
        cases.append(
            {
                "name": name,
                "peer": "slime",
                "objective": "icepop",
                "peer_config": {
                    "use_tis": True,
                    "custom_tis_function_path": SLIME_ICEPOP_PATH,
                    "tis_clip_low": low,
                    "tis_clip": high,
                    "eps_clip": 0.2,
                    "eps_clip_high": 0.2,
                    "eps_clip_c": None,
                    "calculate_per_token_loss": per_token,
                    "use_rollout_logprobs": False,
                    "num_microbatches": 1,
                    "step_global_batch_size": B,
                    "rollout_mask_sums": list(map(float, lengths)),
                },
                "aggregation": (
                    "per-token: sum over tokens of ice_weight*pg_loss, divided by the total "
                    "token count (Megatron divides by the returned normalizer)"
                    if per_token
                    else "per-sample mean: sum_i [sum_t ice_weight*pg_loss / rollout_mask_sums_i]"
                    " * num_microbatches / step_global_batch_size (one sample per rollout)"
                ),
                "notes": (
                    "slime's icepop_function multiplies the per-token PPO loss by "
                    "exp(log_probs_old - rollout_log_probs) inside [tis_clip_low, tis_clip], "
                    "else 0; 'tis_clipfrac' here is the logged value divided by the "
                    "normalizer/step_global_batch_size (fraction of zeroed tokens)."
                ),
                "inputs": as_lists(x),
                "loss": scalar(loss),
                "grad_logprobs": lp.grad.tolist(),
                "metrics": metrics,
            }
        )
    return peer, cases


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nemo-rl", help="git dir of NVIDIA-NeMo/RL [@REV]")
    ap.add_argument("--areal", help="git dir of inclusionAI/AReaL [@REV]")
    ap.add_argument("--slime", help="git dir of THUDM/slime [@REV]")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    a = ap.parse_args(argv)

    x = make_inputs()
    check_design(x)

    peers: dict[str, dict] = {}
    cases: list[dict] = []
    if a.nemo_rl:
        peers["nemo_rl"], c = nemo_cases(PeerSource(a.nemo_rl, "NVIDIA-NeMo/RL"), x)
        cases += c
    if a.areal:
        areal_peers, c = areal_cases(PeerSource(a.areal, "inclusionAI/AReaL"), x)
        peers.update(areal_peers)
        cases += c
    if a.slime:
        peers["slime"], c = slime_cases(PeerSource(a.slime, "THUDM/slime"), x)
        cases += c
    if not cases:
        ap.error("give at least one of --nemo-rl, --areal, --slime")

    fixture = {
        "recorded_by": "tools/record_peer_mismatch.py",
        "torch_version": torch.__version__,
        "dtype": "float64 inputs; AReaL computes its behaviour weight in float32 (see notes)",
        "generator_seed": SEED,
        "inputs_design": (
            "B=4, T=7, prefix masks of lengths [7, 4, 1, 6]. log(pi_old/pi_b): seq 0 ~3e-4 "
            "(geo-mean inside [0.999, 1.002]); seq 1 has tokens at ratio ~0.30 and ~0.55, "
            "geo-mean ~0.66; seq 2 is one token at ratio e^2; seq 3 has one token at ratio ~5.5, "
            "geo-mean ~1.16. Padding carries log-ratio 2.5 and random values that must not "
            "matter. pi_theta/pi_old ~ exp(0.2 N(0,1)); advantages per token ~ N(0,1)."
        ),
        "peers": peers,
        "cases": [c for c in cases if c["objective"] in ("icepop", "seq_mask_tis")],
        "m2po_cases": [c for c in cases if c["objective"] == "m2po"],
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fixture, indent=1) + "\n")
    for c in cases:
        print(f"{c['name']:42s} loss={c['loss']!r}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
