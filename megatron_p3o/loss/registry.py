"""The objective registry and the single-process ``policy_loss`` entry point.

Why: the trainer picks one :class:`Objective` when it is built (no string switch in the loop).
Each objective is a pure tensor function that returns the *sum* of its terms over the given
tokens (or sequences); dividing by the step's global token (or sequence) count happens once, in
the caller, with a normalizer computed before the gradient pass.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Literal, Optional, Tuple

import torch
from torch import Tensor

from megatron_p3o.loss.cispo import CISPOConfig, cispo_terms
from megatron_p3o.loss.decoupled_ppo import DecoupledPPOConfig, decoupled_ppo_terms
from megatron_p3o.loss.diagnostics import add_mismatch_metrics, finalize_mismatch
from megatron_p3o.loss.ess import check_finite, ess_from_stats, ess_stats
from megatron_p3o.loss.gspo import GSPOConfig, gspo_terms
from megatron_p3o.loss.m2po import M2POConfig, m2_cut, m2_values, m2po_terms
from megatron_p3o.loss.oapl import OAPLConfig, oapl_advantages, oapl_terms
from megatron_p3o.loss.p3o import P3OConfig, p3o_terms
from megatron_p3o.loss.p4o import P4OConfig, p4o_terms
from megatron_p3o.loss.ppo import ClipConfig, clip_terms
from megatron_p3o.loss.reinforce import ReinforceConfig, reinforce_terms
from megatron_p3o.loss.reval import ReValConfig, reval_rewards, reval_terms
from megatron_p3o.loss.terms import LossInputs, StepStats
from megatron_p3o.observability.metrics import StepMetrics


@dataclass(frozen=True)
class ObjectiveSpec:
    config_cls: type
    terms: Callable
    # of: ess, ess_prox, old, ref (also: when a coef is set), value, m2 (M2PO's step-wide cut)
    needs: Tuple[str, ...] = ()
    # its ratio is against πold when ℓold is given, else against πb ("bypass"): the trainer
    # recomputes ℓold unless ``loss.old_logprobs: behaviour`` (PPO, GRPO, DAPO, GSPO, CISPO)
    old_optional: bool = False
    per_sequence: bool = False
    defaults: Dict[str, Any] = field(default_factory=dict)
    # the objective's own advantages (rewards [N], group ids [N], hyper) -> [N], replacing the
    # configured group baseline (OAPL regresses onto A* = r − V*); None = advantage.kind
    advantages: Optional[Callable[[Tensor, Tensor, Any], Tensor]] = None
    # its ratio is against the engine's πb (P3O, P4O): the engine must sample from exactly the
    # distribution the trainer scores (no top-p/top-k truncation the trainer does not apply)
    behavior_ratio: bool = False
    # the logits are the model (ReVal's soft Q-values): sampling at temperature 1, untruncated
    unit_temperature: bool = False


def _oapl_advantages(rewards: Tensor, group_ids: Tensor, hyper: OAPLConfig) -> Tensor:
    return oapl_advantages(rewards, group_ids, hyper.beta1)


def _reval_rewards(rewards: Tensor, group_ids: Tensor, hyper: ReValConfig) -> Tensor:
    return reval_rewards(rewards, group_ids, hyper)


OBJECTIVES: Dict[str, ObjectiveSpec] = {
    "p3o": ObjectiveSpec(P3OConfig, p3o_terms, needs=("ess",), behavior_ratio=True),
    "p4o": ObjectiveSpec(
        P4OConfig, p4o_terms, needs=("ess", "ess_prox", "old"), behavior_ratio=True
    ),
    "reinforce": ObjectiveSpec(ReinforceConfig, reinforce_terms),
    "ppo": ObjectiveSpec(ClipConfig, clip_terms, old_optional=True),
    "grpo": ObjectiveSpec(
        ClipConfig,
        clip_terms,
        old_optional=True,
        defaults={"aggregation": "seq_mean_token_mean"},
    ),
    "dapo": ObjectiveSpec(
        ClipConfig, clip_terms, old_optional=True, defaults={"eps_low": 0.2, "eps_high": 0.28}
    ),
    "tis": ObjectiveSpec(ClipConfig, clip_terms, needs=("old",), defaults={"tis_cap": 2.0}),
    "mis": ObjectiveSpec(
        ClipConfig, clip_terms, needs=("old",), defaults={"mis_low": 0.5, "mis_high": 2.0}
    ),
    # IcePop: tokens whose v = πold/πb leaves [0.5, 5] drop out, the rest are weighted by v
    # (NeMo-RL's reference config, AReaL's rejection sampling, slime's icepop_function)
    "icepop": ObjectiveSpec(
        ClipConfig,
        clip_terms,
        needs=("old",),
        defaults={"mis_low": 0.5, "mis_high": 5.0, "mis_weighted": True},
    ),
    # seq-mask-TIS: sequences whose geometric-mean v leaves [0.999, 1.002] drop out, the
    # rest are weighted by the raw token v (NeMo-RL's seq-mask-tis and its reference band)
    "seq_mask_tis": ObjectiveSpec(
        ClipConfig,
        clip_terms,
        needs=("old",),
        defaults={
            "mis_low": 0.999,
            "mis_high": 1.002,
            "mis_level": "seq_geomean",
            "mis_weighted": True,
        },
    ),
    "m2po": ObjectiveSpec(M2POConfig, m2po_terms, needs=("old", "m2")),
    "gspo": ObjectiveSpec(GSPOConfig, gspo_terms, old_optional=True, per_sequence=True),
    "gspo_token": ObjectiveSpec(
        GSPOConfig,
        gspo_terms,
        old_optional=True,
        per_sequence=True,
        defaults={"token_level": True},
    ),
    "cispo": ObjectiveSpec(CISPOConfig, cispo_terms, old_optional=True),
    "decoupled_ppo": ObjectiveSpec(DecoupledPPOConfig, decoupled_ppo_terms, needs=("old",)),
    "oapl": ObjectiveSpec(
        OAPLConfig,
        oapl_terms,
        per_sequence=True,
        advantages=_oapl_advantages,
    ),
    "reval": ObjectiveSpec(
        ReValConfig,
        reval_terms,
        needs=("ref", "value"),
        per_sequence=True,
        advantages=_reval_rewards,
        unit_temperature=True,
    ),
}


class Objective:
    """A configured objective: ``terms(inputs, stats) -> (sum, metric pairs)``."""

    def __init__(self, name: str, spec: ObjectiveSpec, hyper):
        self.name, self.spec, self.hyper = name, spec, hyper

    @property
    def per_sequence(self) -> bool:
        """True when the loss is a mean over sequences (else over tokens)."""
        return (
            self.spec.per_sequence
            or getattr(self.hyper, "aggregation", "") == "seq_mean_token_mean"
        )

    @property
    def behavior_ratio(self) -> bool:
        """Its ratio is taken against the rollout engine's log-probs πb."""
        return self.spec.behavior_ratio

    def advantages(self, rewards: Tensor, group_ids: Tensor) -> Optional[Tensor]:
        """The objective's own advantages ``[N]`` (float64), or None: use ``advantage.kind``."""
        fn = self.spec.advantages
        return None if fn is None else fn(rewards, group_ids, self.hyper)

    @property
    def needs_ess(self) -> bool:
        return "ess" in self.spec.needs

    @property
    def needs_m2_cut(self) -> bool:
        """M2PO at scope ``step``: a cut on (ℓold − ℓb)² over the whole step, known before the
        gradient pass (its kept tokens are the normalizer)."""
        return "m2" in self.spec.needs and self.hyper.scope == "step"

    @property
    def needs_m2_microbatch_keep(self) -> bool:
        """M2PO at scope ``microbatch`` (AReaL's): each micro-batch's own keep-mask, computed
        before the gradient pass; the normalizer is the step's valid tokens."""
        return "m2" in self.spec.needs and self.hyper.scope == "microbatch"

    @property
    def needs_ess_prox(self) -> bool:
        return "ess_prox" in self.spec.needs

    @property
    def needs_old_logprobs(self) -> bool:
        return "old" in self.spec.needs or getattr(self.hyper, "kl_anchor", "") == "old"

    def recomputes_old(self, mode: str) -> bool:
        """Whether the trainer recomputes ℓold for this objective under ``loss.old_logprobs``
        (``recompute``: standard PPO/GRPO semantics; ``behaviour``: bypass, ℓold = ℓb)."""
        return self.needs_old_logprobs or (self.spec.old_optional and mode == "recompute")

    @property
    def needs_ref_logprobs(self) -> bool:
        return "ref" in self.spec.needs or bool(
            getattr(self.hyper, "ref_kl_coef", 0) or getattr(self.hyper, "kl_coef", 0)
        )

    @property
    def needs_value(self) -> bool:
        """V_θ(s₁) and V_ref(s₁), the log-partitions at each first completion token (ReVal)."""
        return "value" in self.spec.needs

    @property
    def unit_temperature(self) -> bool:
        return self.spec.unit_temperature

    @property
    def needs_entropy(self) -> bool:
        return bool(getattr(self.hyper, "entropy_coef", 0))

    def normalizer(self, stats: StepStats) -> float:
        """The step's one loss normalizer (the token mean's N_B, the sequence count for
        per-sequence objectives, M2PO's kept tokens), at least 1: a step whose M2PO cut keeps no
        token has a zero loss, not 0/0. The single-process loss and the policy update both
        divide by it."""
        if self.needs_m2_cut:  # M2PO, scope step: the mean over the step's kept tokens
            n = stats.m2po_kept
        else:
            n = stats.n_seqs if self.per_sequence else stats.n_tokens
        return max(n, 1.0)

    def check_inputs(self, inp: LossInputs) -> None:
        for need, value, hint in (
            (self.needs_old_logprobs, inp.old_logprobs, "old_logprobs (ℓold/ℓprox)"),
            (self.needs_ref_logprobs, inp.ref_logprobs, "ref_logprobs (ℓref)"),
            (self.needs_entropy, inp.entropy, "entropy"),
            (self.needs_value, inp.values, "values (V_θ(s₁))"),
            (self.needs_value, inp.ref_values, "ref_values (V_ref(s₁))"),
        ):
            if need and value is None:
                raise ValueError(f"objective {self.name!r} with {self.hyper} needs {hint}")

    def terms(self, inp: LossInputs, stats: StepStats):
        return self.spec.terms(inp, stats, self.hyper)

    def __repr__(self):
        return f"Objective({self.name}, {self.hyper})"


def build_objective(name: str, **hyper) -> Objective:
    """The objective ``name`` with its hyper-parameters (unknown names/keys are errors)."""
    spec = OBJECTIVES.get(name)
    if spec is None:
        near = difflib.get_close_matches(name, OBJECTIVES, n=1)
        raise ValueError(
            f"unknown objective {name!r}{f' (did you mean {near[0]!r}?)' if near else ''}; "
            f"known: {sorted(OBJECTIVES)}"
        )
    known = {f.name for f in dataclasses.fields(spec.config_cls)}
    for key in hyper:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            raise ValueError(
                f"objective {name!r}: unknown hyper-parameter {key!r}"
                f"{f' (did you mean {near[0]!r}?)' if near else ''}; known: {sorted(known)}"
            )
    hyper = {k: _hyper_value(name, spec.config_cls, k, v) for k, v in hyper.items()}
    try:
        cfg = spec.config_cls(**{**spec.defaults, **hyper})
    except (TypeError, ValueError) as e:  # its own checks say "tau=0 must be > 0"
        msg = str(e)
        raise ValueError(f"loss.hyper.{msg}" if msg.split("=")[0] in known else msg) from None
    return Objective(name, spec, cfg)


# hyper-parameters that are widths, caps or coefficients of a penalty: negative ones flip the
# loss's meaning silently (a negative clip ε clips every token)
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")  # as config._FLOAT_LITERAL
_NON_NEGATIVE = (
    "eps", "eps_low", "eps_high", "tis_cap", "mis_low", "mis_high", "kl_coef", "ref_kl_coef",
    "behav_weight_cap", "delta", "tau", "beta", "beta1", "beta2",
)  # fmt: skip


def _hyper_value(name: str, cls: type, key: str, value: Any) -> Any:
    """``loss.hyper`` is free-form YAML: check each value against the objective's field type
    (a string where a number belongs failed only in the first loss computation, after the
    model was built and a rollout done) and the obvious ranges, naming ``loss.hyper.<key>``.
    ``3e-4`` (which PyYAML reads as a string) becomes the number."""
    tp = typing.get_type_hints(cls)[key]
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return value
    kinds = {a for a in args if a is not type(None)} or {tp}
    path = f"loss.hyper.{key}={value!r}"
    if typing.get_origin(tp) is Literal and value not in args:
        raise ValueError(f"{path}: objective {name!r} takes one of {list(args)}")
    if kinds & {float, int} and not kinds & {str, dict}:
        if float in kinds and isinstance(value, str) and _FLOAT.match(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: objective {name!r} expects a number")
        if not math.isfinite(value):
            raise ValueError(f"{path} must be a finite number")
        if key in _NON_NEGATIVE and value < 0:
            raise ValueError(f"{path} must be >= 0")
    if kinds == {bool} and not isinstance(value, bool):
        raise ValueError(f"{path}: objective {name!r} expects true/false")
    return value


def broadcast_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence ``[B]`` advantages → per-token ``[B, T]``; ``[B, T]`` passes through."""
    if advantages.dim() == 1:
        return (
            advantages[:, None]
            .expand_as(mask)
            .to(torch.promote_types(advantages.dtype, torch.float32))
        )
    if advantages.shape != mask.shape:
        raise ValueError(
            f"advantages {tuple(advantages.shape)} match neither [B] nor mask {tuple(mask.shape)}"
        )
    return advantages


def step_stats(objective: Objective, inp: LossInputs) -> StepStats:
    """Step statistics of a batch that *is* the whole step (single process)."""
    m = inp.mask
    ess = (
        ess_from_stats(ess_stats(inp.logprobs, inp.behavior_logprobs, m))
        if objective.needs_ess
        else None
    )
    ess_p = (
        ess_from_stats(ess_stats(inp.logprobs, inp.old_logprobs, m), "step (prox)")
        if objective.needs_ess_prox
        else None
    )
    cut = kept = None
    if objective.needs_m2_cut:
        sq = m2_values(inp)
        cut, k = m2_cut(sq, objective.hyper.tau)
        kept = float(sq.numel() - int((sq >= cut).sum()))
    return StepStats(
        n_tokens=float(m.sum()),
        n_seqs=float((m.sum(-1) > 0).sum()),
        ess=ess,
        ess_prox=ess_p,
        m2po_cut=cut,
        m2po_kept=kept,
    )


def policy_loss(
    name: str,
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    old_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    rewards: Optional[Tensor] = None,
    group_ids: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None,
    values: Optional[Tensor] = None,
    ref_values: Optional[Tensor] = None,
    sample_ids=None,
    **hyper,
) -> Tuple[Tensor, Dict[str, float]]:
    """Loss of one optimizer step held by one process.

    Args:
        name: objective name (``p3o`` default; see :data:`OBJECTIVES`).
        logprobs: ℓθ ``[B, T]`` (differentiable). behavior_logprobs: ℓb ``[B, T]``.
        advantages: ``[B, T]`` or per-sequence ``[B]``. mask: ``[B, T]`` valid response tokens.
        old_logprobs / ref_logprobs / rewards / group_ids / entropy / values / ref_values: as
            the objective needs (ReVal: ``advantages`` are its per-sequence r).
        sample_ids: optional names of the B samples, used in error messages.
        **hyper: the objective's hyper-parameters.

    Returns:
        ``(loss, metrics)``: the scalar to minimise and floats (``metrics['ess']`` = e_B where
        used).
    """
    obj = build_objective(name, **hyper)
    mask = mask.to(torch.float32)
    check_finite("behaviour log-prob ℓb", behavior_logprobs, mask, sample_ids)
    check_finite("trainer log-prob ℓθ", logprobs.detach(), mask, sample_ids)
    inp = LossInputs(
        logprobs,
        behavior_logprobs,
        broadcast_advantages(advantages, mask),
        mask,
        old_logprobs,
        ref_logprobs,
        entropy,
        rewards,
        group_ids,
        values,
        ref_values,
    )
    obj.check_inputs(inp)
    stats = step_stats(obj, inp)
    total, pairs = obj.terms(inp, stats)
    loss = total / obj.normalizer(stats)
    acc = StepMetrics()
    for k, (num, den) in pairs.items():
        acc.add(k, num, den)
    add_mismatch_metrics(acc, inp)
    metrics = finalize_mismatch(acc.result())
    if stats.ess is not None:
        metrics["ess"] = stats.ess
    if stats.ess_prox is not None:
        metrics["ess_prox"] = stats.ess_prox
    metrics["loss"] = float(loss.detach())
    return loss, metrics
