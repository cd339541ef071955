"""Metric reductions: (numerator, denominator) sums, maxima and log-histograms.

Why: metrics of one optimizer step are spread over micro-batches and DP ranks (every CP rank of a
DP rank computes the same loss of whole sequences, see policy_update). Means need
sums and counts, maxima need a MAX reduction, and quantiles (ratio p50/p90/p99) need the whole
distribution: a fixed log-space histogram summed over ranks gives them to 1% without gathering
every token.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_p3o.runtime.collectives import all_max, all_sum

LOG_HIST_RANGE = 8.0  # log-ratio histogram covers [-8, 8]
LOG_HIST_BINS = 1600  # bin width 0.01 in log space (≈1% in ratio)
COARSE_HIST_RANGE = 2.0  # coarse_hist (metrics.jsonl's log_ratio_hist) covers [-2, 2]


def _f64(x):
    """A metric value as it is accumulated: a float64 device tensor (no host read) or a float."""
    return x.detach().to(torch.float64).reshape(()) if torch.is_tensor(x) else float(x)


def _max(a, b):
    if not torch.is_tensor(a):
        a, b = b, a
    if not torch.is_tensor(a):
        return max(a, b)
    return torch.maximum(a, b) if torch.is_tensor(b) else a.clamp_min(b)


def host_copy(tensors: List[Tensor]) -> List[Tensor]:
    """CPU float64 copies of ``tensors`` (same shapes), read with one device→host transfer."""
    if not tensors:
        return []
    dev = tensors[0].device
    flat = torch.cat([t.detach().to(dev, torch.float64).reshape(-1) for t in tensors]).cpu()
    return list(torch.split(flat, [t.numel() for t in tensors]))


class StepMetrics:
    """Accumulates one step's metrics locally; :meth:`reduce` combines ranks; :meth:`result`
    reads.

    Values stay device tensors (float64) while the micro-batches run: adding one never reads it
    on the host (a device→host read stalls the GPU stream). :meth:`to_host` reads all of them
    with one transfer, once per optimizer step, after the schedule; :meth:`result` and
    :meth:`coarse_hist` call it."""

    def __init__(self):
        self.sums: Dict[str, list] = defaultdict(lambda: [0.0, 0.0])
        self.maxes: Dict[str, Any] = {}
        self.hists: Dict[str, Tensor] = {}

    def add(self, name: str, num, den) -> None:
        s = self.sums[name]
        s[0] = s[0] + _f64(num)
        s[1] = s[1] + _f64(den)

    def add_max(self, name: str, value) -> None:
        v = _f64(value)
        self.maxes[name] = _max(self.maxes[name], v) if name in self.maxes else v

    def add_log_hist(self, name: str, log_values: Tensor, mask: Optional[Tensor] = None) -> None:
        """Log-histogram of ``log_values``, or of those where ``mask > 0`` (a selection by
        ``log_values[mask > 0]`` would read its size on the host: masked values are moved out
        of the range instead, which ``histc`` ignores)."""
        v = log_values.detach().double().clamp(-LOG_HIST_RANGE, LOG_HIST_RANGE)
        if mask is not None:
            v = torch.where(mask > 0, v, torch.full_like(v, 2 * LOG_HIST_RANGE + 1))
        h = torch.histc(v, bins=LOG_HIST_BINS, min=-LOG_HIST_RANGE, max=LOG_HIST_RANGE)
        zero = torch.zeros(LOG_HIST_BINS, dtype=torch.float64, device=h.device)
        self.hists[name] = self.hists.get(name, zero) + h

    def reduce(
        self, group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None
    ) -> "StepMetrics":
        """Sum / max over ``group`` (DP on the last stage), with the reduced tensors on
        ``device`` (the training device: NCCL refuses CPU tensors). Every rank must hold the
        same names. Sums and histograms travel in one all-reduce, maxima in another."""
        if group is None or dist.get_world_size(group) == 1:
            return self
        dev = device or torch.device("cpu")

        def col(v) -> Tensor:
            if torch.is_tensor(v):
                return v.detach().to(dev, torch.float64).reshape(-1)
            return torch.tensor([float(v)], dtype=torch.float64, device=dev)

        names, hnames = sorted(self.sums), sorted(self.hists)
        parts = [col(x) for n in names for x in self.sums[n]] + [col(self.hists[n]) for n in hnames]
        if parts:
            t = torch.cat(parts)
            all_sum(t, group, "each DP rank accumulated a disjoint part of the step's sequences; "
                    "histogram counts of the whole step, for global quantiles")  # fmt: skip
            for i, n in enumerate(names):
                self.sums[n] = [t[2 * i], t[2 * i + 1]]
            hist = t[2 * len(names) :].split(LOG_HIST_BINS)
            self.hists.update(zip(hnames, hist))
        mnames = sorted(self.maxes)
        if mnames:
            t = torch.cat([col(self.maxes[n]) for n in mnames])
            all_max(t, group, "the step's maximum over every DP rank's tokens")
            self.maxes.update(zip(mnames, t.unbind()))
        return self

    def to_host(self, *extra: Tensor) -> List[Tensor]:
        """Every accumulated value on the host (floats, CPU histograms), read with one
        device→host transfer; ``extra`` tensors travel with them (their CPU copies are
        returned). Call it after the step's schedule, not per micro-batch."""
        slots = [(self.sums[n], i) for n in self.sums for i in (0, 1)]
        slots += [(self.maxes, n) for n in self.maxes]
        slots = [(box, k) for box, k in slots if torch.is_tensor(box[k])]
        hnames = [n for n in self.hists if self.hists[n].device.type != "cpu"]
        read = host_copy(
            [box[k] for box, k in slots] + list(extra) + [self.hists[n] for n in hnames]
        )
        for (box, k), v in zip(slots, read):
            box[k] = float(v)  # host
        self.hists.update(zip(hnames, read[len(slots) + len(extra) :]))
        return read[len(slots) : len(slots) + len(extra)]

    def result(self) -> Dict[str, float]:
        self.to_host()
        out = {n: (num / den if den else float("nan")) for n, (num, den) in self.sums.items()}
        out.update(self.maxes)
        for n, h in self.hists.items():
            total = float(h.sum())  # host
            if total <= 0:
                continue
            cdf = torch.cumsum(h, 0) / total
            width = 2 * LOG_HIST_RANGE / LOG_HIST_BINS
            for q in (50, 90, 99):
                at = torch.tensor(q / 100.0, dtype=torch.float64, device=cdf.device)
                i = int(torch.searchsorted(cdf, at))  # host
                out[f"{n}_p{q}"] = math.exp(-LOG_HIST_RANGE + (i + 0.5) * width)
            # |log value| quantile: the histogram folded at 0 (bins are symmetric around it)
            half = LOG_HIST_BINS // 2
            folded = torch.cumsum(h[half:] + torch.flip(h[:half], [0]), 0) / total
            at = torch.tensor(0.99, dtype=torch.float64, device=cdf.device)
            i = int(torch.searchsorted(folded, at))  # host
            out[f"abs_log_{n}_p99"] = (i + 1) * width  # upper edge of the bin
        return out

    def coarse_hist(self, name: str, half_range: float = COARSE_HIST_RANGE, bins: int = 40) -> list:
        """The ``name`` log-histogram re-binned to ``bins`` over [−half_range, half_range] (mass
        outside lands in the end bins): small enough for one line of metrics.jsonl per step."""
        self.to_host()
        h = self.hists.get(name)
        if h is None:
            return []
        width = 2 * LOG_HIST_RANGE / LOG_HIST_BINS
        ar = torch.arange(LOG_HIST_BINS, dtype=torch.float64, device=h.device)
        centers = -LOG_HIST_RANGE + (ar + 0.5) * width
        idx = ((centers + half_range) / (2 * half_range) * bins).floor().clamp(0, bins - 1).long()
        out = torch.zeros(bins, dtype=torch.float64, device=h.device)
        return out.index_add_(0, idx, h).tolist()


class PhaseTimer:
    """Wall time of a trainer step's named phases: ``with timer("train"): ...``, then
    ``timer.seconds == {"train_s": ...}`` (a phase entered twice adds up)."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            key = f"{phase}_s"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0


# summed over the optimizer steps of a rollout batch, not averaged
_STEP_SUMS = ("skipped_steps", "nonfinite_masked")
# kept for every optimizer step (``per_step`` of the rollout batch's record)
PER_STEP_KEYS = (
    "ess",
    "ratio_ess",
    "k3_to_behavior",
    "kl_behavior_theta",
    "abs_logprob_diff",
    "abs_log_ratio_p99",
    "clip_frac",
    "seq_clip_frac",
    "is_capped_frac",
    "frac_rho_above_ess",
    "capped_weight_share",
    "kl_prev_epoch",
    "mask_frac",
    "seq_mask_frac",
    "loss",
    "grad_norm",
    "grad_clipped",
    "update_norm",
    "update_rel",
)


def combine_optimizer_steps(steps: List[Tuple[int, int, Dict]]) -> Dict:
    """The metrics of every optimizer step of one rollout batch, as one record.

    ``steps``: ``(epoch, minibatch, metrics)`` per optimizer step, in order. Scalars are averaged
    over the steps (``skipped_steps`` and ``nonfinite_masked`` summed), histograms summed, and
    ``per_step`` lists every step's epoch, mini-batch and :data:`PER_STEP_KEYS` (e_B, k3 to πb,
    clip/cap fractions …), so reuse and staleness show step by step. Also ``ess_steps``,
    ``ess_epoch{e}`` (mean per epoch) and ``ess_min``.
    """
    per_step = [
        {"epoch": e, "minibatch": mb, **{k: m[k] for k in PER_STEP_KEYS if k in m}}
        for e, mb, m in steps
    ]
    if len(steps) == 1:
        return {**steps[0][2], "per_step": per_step}
    out: Dict = {"opt_steps": float(len(steps)), "per_step": per_step}
    keys = [k for k in steps[0][2] if all(k in m for _, _, m in steps)]
    for k in keys:
        vals = [m[k] for _, _, m in steps]
        if isinstance(vals[0], (int, float)):
            finite = [float(v) for v in vals]
            out[k] = sum(finite) if k in _STEP_SUMS else sum(finite) / len(finite)
        elif isinstance(vals[0], list):
            out[k] = [sum(x) for x in zip(*vals)]
    if all("ess" in m for _, _, m in steps):
        ess = [float(m["ess"]) for _, _, m in steps]
        out["ess_steps"] = ess
        out["ess_min"] = min(ess)
        for e in sorted({e for e, _, _ in steps}):
            mine = [float(m["ess"]) for ep, _, m in steps if ep == e]
            out[f"ess_epoch{e}"] = sum(mine) / len(mine)
    return out


def staleness(samples, trained: int) -> Dict[str, float]:
    """How many versions behind ``trained`` (the policy version the step updated) the samples
    are, per sequence (its oldest token: ``Sample.weight_version``) and per token (a sample that
    straddled a weight push has tokens of two versions); ``straddling_frac``: the share of
    samples with more than one version. Only the policy's tokens count (a multi-turn
    trajectory's environment tokens have no version). Host-side: samples live on the host."""
    seq = [trained - s.weight_version for s in samples]
    # the policy's tokens (a multi-turn trajectory's environment tokens carry version −1)
    tok = [trained - v for s in samples for v in s.policy_versions()]
    straddling = sum(len(set(s.policy_versions())) > 1 for s in samples)
    return {
        "staleness_mean": sum(seq) / max(len(seq), 1),
        "staleness_max": float(max(seq, default=0)),
        "staleness_token_mean": sum(tok) / max(len(tok), 1),
        "staleness_tokens": float(len(tok)),  # its weight in the mean over DP ranks
        "staleness_token_max": float(max(tok, default=0)),
        "straddling_frac": straddling / max(len(samples), 1),
    }


_DP_SUMS = (
    "rollout_tokens",
    "rollout_env_tokens",
    "dynamic_refilled",
    "reeval_groups",
    "replay_groups",
    "homogeneous_groups",
    "staleness_tokens",
)
# means over tokens: weighted by each rank's token count (ranks hold different counts)
_DP_TOKEN_MEANS = (("staleness_token_mean", "staleness_tokens"),)
_DP_MEANS = (
    "reward_mean",
    "completion_len",
    "truncation_rate",
    "distinct_per_group",
    "staleness_mean",
    "straddling_frac",
    "rollout_s",
    "rollout_wait_s",
)


def reduce_rollout_metrics(out: Dict[str, float], groups) -> None:
    """Rollout-side numbers of the whole step, in place: each DP rank rolled out and scored its
    own prompts (DP group: sums, means — multi-turn's per-trajectory ones included — and the
    staleness and length maxima over all of them)."""
    from megatron_p3o.observability.turn_metrics import TURN_MEANS

    dp = groups.layout.dp
    if not groups.layout.dp_enabled:
        return
    keys = _DP_SUMS + _DP_MEANS + TURN_MEANS
    weighted = [(k, w) for k, w in _DP_TOKEN_MEANS if k in out and w in out]
    for k, w in weighted:  # Σ over ranks of mean_r · n_r, divided by Σ n_r below
        out[k] = out[k] * out[w]
    keys += tuple(k for k, _ in weighted)
    dev = groups.device
    t = torch.tensor([float(out.get(k, 0.0)) for k in keys], dtype=torch.float64, device=dev)
    all_sum(t, groups.dp, "rollout metrics: each DP rank made its own groups")
    for k, v in zip(keys, t.tolist()):
        if k in out:
            out[k] = v if k in _DP_SUMS or k in dict(weighted) else v / dp
    for k, w in weighted:
        out[k] = out[k] / max(out[w], 1.0)
    maxima = ("staleness_max", "staleness_token_max", "completion_len_max")
    m = torch.tensor([out[k] for k in maxima], dtype=torch.float64, device=dev)
    all_max(m, groups.dp, "the longest staleness and completion over every rank")
    out.update(zip(maxima, m.tolist()))
