"""AReaL: ppo_actor_loss_fn with apply_rejection_sampling, and M2PO (record_peer_mismatch.py)."""

import dataclasses
import functools
import types
import typing

import torch

from peer_mismatch.inputs import DTYPE, B, T, as_lists, scalar
from peer_mismatch.sources import (
    PeerSource,
    _def_record,
    _not_needed,
    exec_whole,
    load_defs,
    new_module,
)

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


def _areal_loss_module(src: PeerSource, name: str, stats, dist, **extra):
    """A scratch module holding AReaL's constants, ``RejectionSamplingConfig`` and the loss
    functions of ``functional.py`` (the part both recorders share), with the stand-ins they
    need; ``dist``: torch.distributed or a one-rank stand-in. Returns (module, line spans)."""
    consts = new_module(f"{name}_constants")
    exec_whole(src, AREAL_CONSTANTS, consts)
    mod = new_module(
        name,
        torch=torch,
        dist=dist,
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
        **extra,
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
    return mod, spans


def areal_cases(src: PeerSource, x: dict[str, torch.Tensor]) -> tuple[dict, list[dict]]:
    stats = _StatsRecorder()
    mod, spans = _areal_loss_module(src, "peer_areal", stats, torch.distributed)
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
            prox_logp_method=mod.PROX_LOGP_METHOD_RECOMPUTE,
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
                    "prox_logp_method": mod.PROX_LOGP_METHOD_RECOMPUTE,
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
# AReaL M2PO edges (issue 45): several micro-batches, a kept token with ρ > 5, a tie at the cut
# --------------------------------------------------------------------------------------------

AREAL_TRAIN_ENGINE = "areal/engine/core/train_engine.py"


def _single_rank_dist() -> types.SimpleNamespace:
    # one DP rank: compute_total_loss_weight's all_reduce leaves the sum as it is
    return types.SimpleNamespace(all_reduce=lambda tensor, group=None: None, ProcessGroup=object)


def areal_m2po_edge_cases(src: PeerSource, input_sets: list) -> tuple[dict, list[dict]]:
    """AReaL's M2PO through its training step on one DP rank: per micro-batch ``grpo_loss_fn``
    (actor.py), weighted by ``loss_weight_fn`` = the micro-batch's loss-mask count over
    ``compute_total_loss_weight`` (train_engine.py), as MegatronEngine scales each micro-batch's
    loss (``loss_scale = local_weight / total_loss_weight * loss_multiplier``; the multiplier
    undoes Megatron's division by the micro-batch count and DP size: 1 here)."""
    stats = _StatsRecorder()
    mod, spans = _areal_loss_module(
        src, "peer_areal_m2", stats, _single_rank_dist(), Callable=typing.Callable
    )
    spans.update(
        load_defs(
            src,
            AREAL_ACTOR,
            [
                "grpo_loss_fn",
                "_resolve_proximal_logp",
                "_apply_m2po_masking",
                "_get_m2po_loss_mask",
            ],
            mod,
        )
    )
    spans.update(load_defs(src, AREAL_TRAIN_ENGINE, ["compute_total_loss_weight"], mod))
    peer = _def_record(src, AREAL_ACTOR, "grpo_loss_fn per micro-batch (train_batch)", spans)
    peer["loss_weight_fn"] = (
        "actor.py PPOActor._ppo_update: lambda x: x['loss_mask'].count_nonzero()"
    )
    peer["loss_scale"] = "megatron_engine.py: loss * local_weight / total_loss_weight"

    configs = [
        ("plain", {"m2_threshold": 0.04, "eps_clip": 0.2, "rejection_sampling": None}),
        (
            "example_config",
            {
                "m2_threshold": 0.04,
                "eps_clip": 0.0,
                "rejection_sampling": {"metric": "ratio", "upper": 5.0},
            },
        ),
    ]
    cases = []
    for set_name, (x, mb_rows), note in input_sets:
        for cfg_name, cfg in configs:
            rs = cfg["rejection_sampling"]
            rs_obj = None if rs is None else mod.RejectionSamplingConfig(**rs)
            lp = x["logprobs"].clone().requires_grad_(True)
            mbs = []
            for a, b in mb_rows:
                mbs.append(
                    {
                        "logprobs": x["behavior_logprobs"][a:b],
                        "advantages": x["advantages"][a:b],
                        "loss_mask": x["mask"][a:b],
                        "prox_logp": x["old_logprobs"][a:b],
                    }
                )

            def loss_weight_fn(mb):
                return mb["loss_mask"].count_nonzero()

            total_w = mod.compute_total_loss_weight(
                types.SimpleNamespace(mbs=mbs), loss_weight_fn, None
            )
            loss = torch.zeros((), dtype=DTYPE)
            keeps, rs_fracs = [], []
            for (a, b), mb in zip(mb_rows, mbs):
                stats.scalars.clear()
                mb_loss = mod.grpo_loss_fn(
                    lp[a:b],
                    torch.zeros(b - a, lp.shape[1], dtype=DTYPE),
                    mb,
                    eps_clip=cfg["eps_clip"],
                    eps_clip_higher=None,
                    c_clip=None,
                    rejection_sampling=rs_obj,
                    m2_threshold=cfg["m2_threshold"],
                    importance_sampling_level="token",
                    current_version=None,
                    prox_logp_method=mod.PROX_LOGP_METHOD_RECOMPUTE,
                    use_sapo_loss=False,
                    use_decoupled_loss=True,
                )
                # megatron_engine.py: loss_scale = local_weight / total_loss_weight *
                # loss_multiplier (float32, as there; the multiplier is 1 on one rank)
                loss_scale = loss_weight_fn(mb) / total_w
                loss = loss + mb_loss * loss_scale
                keeps.append(
                    mod._apply_m2po_masking(
                        mb["logprobs"], mb["prox_logp"], mb["loss_mask"].bool(), cfg["m2_threshold"]
                    )
                )
                rs_fracs.append(stats.scalars.get("rs_filtered_fraction"))
            loss.backward()
            keep = torch.cat(keeps)
            cases.append(
                {
                    "name": f"areal_m2po_{set_name}_{cfg_name}",
                    "peer": "areal_m2po",
                    "objective": "m2po",
                    "peer_config": {
                        **cfg,
                        "rejection_sampling": None
                        if rs_obj is None
                        else dataclasses.asdict(rs_obj),
                        "prox_logp_method": mod.PROX_LOGP_METHOD_RECOMPUTE,
                        "use_decoupled_loss": True,
                        "importance_sampling_level": "token",
                    },
                    "microbatch_rows": mb_rows,
                    "aggregation": (
                        "sum over micro-batches of grpo_loss_fn(mb) * loss_mask(mb).count_nonzero()"
                        " / compute_total_loss_weight (one DP rank); grpo_loss_fn: mean over the "
                        "micro-batch's M2PO-kept tokens"
                    ),
                    "notes": note,
                    "inputs": {**{k: v.tolist() for k, v in x.items()}},
                    "loss": scalar(loss),
                    "grad_logprobs": lp.grad.tolist(),
                    "metrics": {
                        "m2po_keep_mask": keep.to(DTYPE).tolist(),
                        "m2po_masked_tokens": scalar((x["mask"].bool() & ~keep).sum()),
                        "total_loss_weight": scalar(total_w),
                        "rs_filtered_fraction_per_microbatch": rs_fracs,
                    },
                }
            )
    return peer, cases
