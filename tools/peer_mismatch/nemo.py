"""NeMo-RL's ClippedPGLossFn cases (see tools/record_peer_mismatch.py)."""

import enum
import types
import typing

import torch

from peer_mismatch.inputs import DTYPE, EDGE_LENGTHS, B, T, as_lists, scalar
from peer_mismatch.sources import PeerSource, _def_record, class_defaults, load_defs, new_module

# --------------------------------------------------------------------------------------------
# NeMo-RL: ClippedPGLossFn
# --------------------------------------------------------------------------------------------

NEMO_LOSS = "nemo_rl/algorithms/loss/loss_functions.py"
NEMO_UTILS = "nemo_rl/algorithms/utils.py"
NEMO_IFACE = "nemo_rl/algorithms/loss/interfaces.py"


def nemo_cases(
    src: PeerSource,
    x: dict[str, torch.Tensor],
    variants: list | None = None,
    lengths: list[int] | None = None,
) -> tuple[dict, list[dict]]:
    """NeMo-RL's cases on ``x`` (the default variants unless ``variants`` is given)."""
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
    variants = variants or [
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
                "inputs": as_lists(x, lengths),
                "loss": scalar(loss),
                "grad_logprobs": lp.grad.tolist(),
                "metrics": {k: scalar(v) for k, v in sorted(metrics.items())},
            }
        )
    return peer, cases


# The edge inputs (issue 45): exp(ℓold − ℓb) exactly on a bound (inputs.make_edge_inputs)
NEMO_EDGE_VARIANTS = [
    (
        "nemo_rl_icepop_ratio_on_bounds",
        "icepop",
        {
            "truncated_importance_sampling_type": "icepop",
            "truncated_importance_sampling_ratio_min": 0.8,
            "truncated_importance_sampling_ratio": 2.0,
        },
        "band [0.8, 2.0]; edge inputs: tokens with exp(d) == 2.0 and == 0.8 exactly, whose d lies "
        "outside [log 0.8, log 2.0]: the peer keeps them",
    ),
    (
        "nemo_rl_seq_mask_tis_geomean_on_hi",
        "seq_mask_tis",
        {
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio_min": 0.999,
            "truncated_importance_sampling_ratio": 1.002,
        },
        "band [0.999, 1.002]; edge inputs: sequence 1's geometric mean (NeMo-RL's masked_mean, "
        "denominator n + 1e-8) is exactly 1.002 while the plain mean of d exceeds log 1.002",
    ),
    (
        "nemo_rl_seq_mask_tis_geomean_on_lo",
        "seq_mask_tis",
        {
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio_min": 0.8,
            "truncated_importance_sampling_ratio": 1.25,
        },
        "band [0.8, 1.25]; edge inputs: sequence 2's geometric mean is exactly 0.8 while the "
        "plain mean of d is below log 0.8",
    ),
]


def nemo_edge_cases(src: PeerSource, x: dict[str, torch.Tensor]) -> tuple[dict, list[dict]]:
    return nemo_cases(src, x, NEMO_EDGE_VARIANTS, EDGE_LENGTHS)
