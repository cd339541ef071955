"""slime's policy_loss_function with icepop_function cases (see tools/record_peer_mismatch.py)."""

import types
import typing
from argparse import Namespace
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from peer_mismatch.inputs import DTYPE, EDGE_LENGTHS, LENGTHS, B, as_lists, scalar
from peer_mismatch.sources import PeerSource, _def_record, _not_needed, load_defs, new_module

# --------------------------------------------------------------------------------------------
# slime: policy_loss_function / loss_function with icepop_function as the custom TIS function
# --------------------------------------------------------------------------------------------

SLIME_LOSS = "slime/backends/megatron_utils/loss.py"
SLIME_PPO = "slime/utils/ppo_utils.py"
SLIME_CP = "slime/backends/megatron_utils/cp_utils.py"
SLIME_ICEPOP_PATH = "slime.backends.megatron_utils.loss.icepop_function"


def slime_cases(
    src: PeerSource,
    x: dict[str, torch.Tensor],
    variants: list | None = None,
    lengths: list[int] | None = None,
) -> tuple[dict, list[dict]]:
    """slime's cases on ``x`` (the default variants unless ``variants`` is given)."""
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

    variants = variants or [
        ("slime_icepop_band_per_token_loss", 0.5, 5.0, True),
        ("slime_icepop_band_per_sample_mean", 0.5, 5.0, False),
        ("slime_icepop_defaults_per_sample_mean", 0.0, 2.0, False),
    ]
    lengths = LENGTHS if lengths is None else lengths
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
                "inputs": as_lists(x, lengths),
                "loss": scalar(loss),
                "grad_logprobs": lp.grad.tolist(),
                "metrics": metrics,
            }
        )
    return peer, cases


# The edge inputs (issue 45): exp(ℓold − ℓb) exactly on a bound (inputs.make_edge_inputs)
SLIME_EDGE_VARIANTS = [
    ("slime_icepop_ratio_on_bounds_per_token_loss", 0.8, 2.0, True),
    ("slime_icepop_defaults_ratio_on_hi_per_token_loss", 0.0, 2.0, True),
]


def slime_edge_cases(src: PeerSource, x: dict[str, torch.Tensor]) -> tuple[dict, list[dict]]:
    return slime_cases(src, x, SLIME_EDGE_VARIANTS, EDGE_LENGTHS)
