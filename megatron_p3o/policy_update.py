"""The policy update of one optimizer step, driven through Megatron-Core's schedules: one
normalizer and one e_B per step.

Why a module of the trainer layer: this is the driver that runs Megatron's schedule (the ESS
pre-pass, the ℓold recompute, the gradient pass) around the maths of ``loss/`` (log-prob
kernel, global ESS, objectives), which stays pure.

Order of one optimizer step (``PolicyUpdate.run``):
1. Count the step's valid tokens and sequences on every rank and all-reduce them over DP:
   the single normalizer N_B (or the sequence count), known before any gradient.
2. ESS pre-pass (scope ``step``, objectives that need e_B): a no-grad forward of every
   micro-batch with the current weights gives float64 (Σρ, Σρ², N); they are summed over
   micro-batches and all-reduced once over DP×CP on the last pipeline stage. e_B is then
   frozen for the gradient pass (the weights do not change inside the step, so it is exact).
   Scope ``microbatch`` (FeynRL-compatible) skips the pre-pass: micro-batch k's e_B pools the
   k-th micro-batch of every DP×CP rank.
3. Gradient pass through ``forward_backward``: each micro-batch returns Σ terms / N_B. Megatron
   only sums (``calculate_per_token_loss`` + our finalizer), so the gradient is that of one
   process holding the whole step batch.
4. The loss-side metrics live on the last pipeline stage; they are sent to every stage so the
   logger (global rank 0, first stage) writes them under PP > 1 too.

Micro-batch keys: ``tokens``, ``targets``, ``loss_mask``, ``behavior_logprobs``, ``advantages``
(all ``[b, s]``, aligned with ``targets``), optionally ``old_logprobs``, ``ref_logprobs``,
``sample_index`` (``[b]``). Objectives with their own advantages (OAPL's A*) deliver them in
``advantages`` from the advantage stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional

import torch
import torch.distributed as dist

from .loss.diagnostics import add_mismatch_metrics, finalize_mismatch
from .loss.ess import (
    EmptyStepError,
    NonFiniteLogprobError,
    all_reduce_stats,
    check_finite,
    ess_from_stats,
    ess_stats,
)
from .loss.logprob import vocab_parallel_logprobs
from .loss.registry import Objective
from .loss.terms import LossInputs, StepStats
from .metrics import StepMetrics
from .model.forward import MicroBatch, forward_backward
from .parallel import LayoutError, ParallelGroups


@dataclass(frozen=True)
class LossConfig:
    """Attributes:
    objective: one of ``megatron_p3o.loss.OBJECTIVES`` (p3o by default).
    hyper: the objective's hyper-parameters (checked against its dataclass).
    ess_scope: "step" (exact, one extra no-grad forward) or "microbatch" (FeynRL).
    nonfinite: "error" (default) or "mask" (drop and count) for NaN/inf log-probs.
    logprob_chunk: tokens per block in the log-prob kernel (None = automatic).
    log_entropy: compute the policy entropy for metrics (one more reduction).
    prepass_fuse: micro-batches concatenated into one no-grad forward of the ESS pre-pass
        (fewer, larger forwards; costs k micro-batches' logits at once, no activations).
    """

    objective: str = "p3o"
    hyper: Dict[str, Any] = field(default_factory=dict)
    ess_scope: Literal["step", "microbatch"] = "step"
    nonfinite: Literal["error", "mask"] = "error"
    logprob_chunk: Optional[int] = None
    log_entropy: bool = True
    prepass_fuse: int = 4

    def __post_init__(self):
        if self.prepass_fuse < 1:
            raise ValueError(f"loss.prepass_fuse={self.prepass_fuse} must be >= 1")
        if self.logprob_chunk is not None and self.logprob_chunk < 1:
            raise ValueError(f"loss.logprob_chunk={self.logprob_chunk} must be >= 1")


class PolicyUpdate:
    """Runs the objective over one optimizer step's micro-batches (see the module docstring).

    ``temperature``: the sampling temperature; ℓθ is computed from logits / T.
    """

    def __init__(
        self,
        objective: Objective,
        groups: ParallelGroups,
        vocab_size: int,
        cfg: LossConfig = LossConfig(),
        temperature: float = 1.0,
    ):
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0")
        if objective.spec.whole_sequences and groups.layout.cp_enabled:
            raise LayoutError(
                f"objective {objective.name!r} is nonlinear in each sequence's token sum, and "
                f"context parallelism (cp={groups.layout.cp}) splits sequences; use cp=1"
            )
        self.objective, self.groups, self.vocab_size, self.cfg = objective, groups, vocab_size, cfg
        self.temperature = temperature

    # -- stage 0: input checks -----------------------------------------------------------------
    def _check_behavior_logprobs(self, microbatches: List[MicroBatch]) -> None:
        """Refuse non-finite ℓb on *every* rank before any collective (no rank is left waiting)."""
        if self.cfg.nonfinite != "error":
            return
        msg = None
        for mb in microbatches:
            ids = mb.get("sample_index")
            try:
                check_finite(
                    "behaviour log-prob ℓb",
                    mb["behavior_logprobs"],
                    mb["loss_mask"].float(),
                    ids.tolist() if ids is not None else None,
                )
            except ValueError as e:
                msg = str(e)
                break
        if not dist.is_initialized() or dist.get_world_size() == 1:
            if msg:
                raise NonFiniteLogprobError(msg)
            return
        flag = torch.tensor([1.0 if msg else 0.0], device=self.groups.device)
        # World group: any rank's bad input must stop every rank, or the others hang in the
        # next collective.
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            msgs = [None] * dist.get_world_size()
            # World group: every rank reports the same, first, offending sample.
            dist.all_gather_object(msgs, msg)
            first = next((r, m) for r, m in enumerate(msgs) if m)
            raise NonFiniteLogprobError(
                first[1]
                if first[0] == dist.get_rank()
                else f"{first[1]} (found on rank {first[0]})"
            )

    # -- stage 1: counts -------------------------------------------------------------------
    def _global_counts(self, microbatches: List[MicroBatch]) -> tuple:
        n_tok = n_seq = 0.0  # host-side sums of the (host) micro-batches' masks
        for mb in microbatches:
            m = mb["loss_mask"].double()
            n_tok += float(m.sum())
            n_seq += float((m.sum(-1) > 0).sum())
        local = torch.tensor([n_tok, n_seq], dtype=torch.float64, device=self.groups.device)
        if self.groups.layout.dp_enabled:
            # DP group: each DP rank holds a disjoint share of the step's sequences (CP ranks of
            # one DP rank hold the same, not yet CP-sliced, micro-batches: no CP reduction here).
            dist.all_reduce(local, group=self.groups.dp)
        n_tok, n_seq = local.tolist()
        if n_tok <= 0:
            raise EmptyStepError("the optimizer step has no valid tokens (all loss masks are 0)")
        return n_tok, n_seq

    def _kernel(self, batch, logits, with_entropy: bool = False, inplace: bool = False):
        """ℓθ of the targets (and the entropy) from this TP rank's logits shard at T."""
        return vocab_parallel_logprobs(
            logits,
            batch["targets"],
            self.groups.tp,
            temperature=self.temperature,
            chunk_size=self.cfg.logprob_chunk,
            vocab_size=self.vocab_size,
            with_entropy=with_entropy,
            inplace_backward=inplace,
        )

    def _logprobs(self, batch, logits, entropy: bool = True):
        # the logits feed only this loss: their storage is reused for the gradient
        want = entropy and (self.cfg.log_entropy or self.objective.needs_entropy)
        lp, ent = self._kernel(batch, logits, with_entropy=want, inplace=True)
        mask = batch["loss_mask"].to(torch.float32)
        ids = batch.get("sample_index")
        ids = ids.tolist() if ids is not None else None
        if self.cfg.nonfinite == "mask":  # "error" was checked once, on every rank, before the step
            mask = check_finite(
                "behaviour log-prob ℓb", batch["behavior_logprobs"], mask, ids, "mask"
            )
        mask = check_finite("trainer log-prob ℓθ", lp.detach(), mask, ids, self.cfg.nonfinite)
        return lp, ent, mask

    def _inputs(self, batch, lp, ent, mask) -> LossInputs:
        return LossInputs(
            logprobs=lp,
            behavior_logprobs=batch["behavior_logprobs"],
            advantages=batch["advantages"],
            mask=mask,
            old_logprobs=batch.get("old_logprobs"),
            ref_logprobs=batch.get("ref_logprobs"),
            # Group baselines (GRPO's, OAPL's V*) need whole prompt groups, which micro-batches and
            # DP ranks split: they are computed in the advantage stage and arrive in "advantages".
            entropy=ent,
            rewards=None,
            group_ids=None,
            lengths=batch.get("seq_len"),
        )

    def _ess_stats(self, inp: LossInputs) -> torch.Tensor:
        parts = [ess_stats(inp.logprobs, inp.behavior_logprobs, inp.mask)]
        if self.objective.needs_ess_prox:
            parts.append(ess_stats(inp.logprobs, inp.old_logprobs, inp.mask))
        return torch.cat(parts)

    @staticmethod
    def _ess_values(stats: torch.Tensor, what: str):
        ess = ess_from_stats(stats[:3], what)
        ess_p = ess_from_stats(stats[3:], what + " (prox)") if stats.numel() > 3 else None
        return ess, ess_p

    # -- stage 2: ESS pre-pass ---------------------------------------------------------------
    def _ess_prepass(self, chunks, microbatches) -> Optional[tuple]:
        acc: List[torch.Tensor] = []

        def loss_fn(batch, logits):
            with torch.no_grad():
                lp, ent, mask = self._logprobs(batch, logits, entropy=False)
                acc.append(self._ess_stats(self._inputs(batch, lp, ent, mask)))
            return torch.zeros((), device=logits.device), 0, {}

        k = self.cfg.prepass_fuse
        fused = [_concat(microbatches[i : i + k]) for i in range(0, len(microbatches), k)]
        if len({tuple(mb["tokens"].shape) for mb in fused}) > 1:
            fused = microbatches  # a ragged last group: keep the schedule's shapes uniform
        with torch.no_grad():
            forward_backward(chunks, self.groups, fused, loss_fn, forward_only=True)
        if not self.groups.is_last_stage():
            return None
        # DP×CP group: Σρ, Σρ², N of the whole optimizer step, all-reduced once.
        total = all_reduce_stats(torch.stack(acc).sum(0), self.groups.dp_cp)
        return self._ess_values(total, "optimizer step")

    def _broadcast_from_last_stage(self, values: Optional[tuple]) -> tuple:
        """Every pipeline stage learns e_B (for logging and checks)."""
        t = torch.tensor(
            [float("nan") if v is None else v for v in (values or (None, None))],
            dtype=torch.float64,
            device=self.groups.device,
        )
        if self.groups.layout.pp_enabled:
            # PP group: only the last stage computed log-probs; share e_B with earlier stages.
            dist.broadcast(t, src=self.groups.last_stage_global_rank(), group=self.groups.pp)
        return tuple(None if v != v else v for v in t.tolist())

    # -- ℓold / ℓprox: the policy at the start of the rollout batch ---------------------------
    def recompute_old_logprobs(self, chunks, microbatches: List[MicroBatch]) -> None:
        """Store ``old_logprobs`` (ℓθ before this rollout batch's first update, no grad) in each
        micro-batch, for the objectives that ratio against πold/πprox (decoupled PPO, TIS, MIS,
        P4O). Computed on the last pipeline stage, where the loss runs."""
        if self.groups.layout.cp_enabled:
            raise LayoutError(
                "recomputing ℓold under context parallelism is not supported yet "
                f"(objective needs it; cp={self.groups.layout.cp})"
            )
        out: List[torch.Tensor] = []

        def loss_fn(batch, logits):
            with torch.no_grad():
                lp, _ = self._kernel(batch, logits)
                out.append(lp.float() * batch["loss_mask"].to(torch.float32))
            return torch.zeros((), device=logits.device), 0, {}

        with torch.no_grad():
            forward_backward(chunks, self.groups, microbatches, loss_fn, forward_only=True)
        if self.groups.is_last_stage():
            for mb, lp in zip(microbatches, out):
                mb["old_logprobs"] = lp

    # -- stage 3: gradient pass --------------------------------------------------------------
    def run(
        self, chunks, microbatches: List[MicroBatch], forward_only: bool = False
    ) -> Dict[str, float]:
        """Loss, gradients (accumulated into the DDP buffers) and metrics of one optimizer step."""
        for mb in microbatches:
            mb.setdefault("seq_len", mb["loss_mask"].sum(-1))
        self._check_behavior_logprobs(microbatches)
        n_tok, n_seq = self._global_counts(microbatches)
        ess = ess_p = None
        step_scope = self.cfg.ess_scope == "step"
        if self.objective.needs_ess and step_scope:
            ess, ess_p = self._broadcast_from_last_stage(self._ess_prepass(chunks, microbatches))
        acc = StepMetrics()
        micro_ess: List[float] = []
        norm = n_seq if self.objective.per_sequence else n_tok

        def loss_fn(batch, logits):
            lp, ent, mask = self._logprobs(batch, logits)
            inp = self._inputs(batch, lp, ent, mask)
            self.objective.check_inputs(inp)
            e, e_p = ess, ess_p
            if self.objective.needs_ess and not step_scope:
                # DP×CP group: micro-batch k of every data/context rank forms one ESS pool.
                e, e_p = self._ess_values(
                    all_reduce_stats(self._ess_stats(inp), self.groups.dp_cp), "micro-batch"
                )
                micro_ess.append(e)
            stats = StepStats(n_tokens=n_tok, n_seqs=n_seq, ess=e, ess_prox=e_p)
            total, pairs = self.objective.terms(inp, stats)
            loss = total / norm
            with torch.no_grad():
                acc.add("loss", loss.detach(), 1.0)
                for k, (num, den) in pairs.items():
                    acc.add(k, num, den)
                dropped = batch["loss_mask"].sum() - mask.sum()
                acc.add("nonfinite_masked", dropped, 1.0)
                add_mismatch_metrics(acc, inp)
            return loss, int(mask.sum().item()), {}

        forward_backward(chunks, self.groups, microbatches, loss_fn, forward_only=forward_only)
        metrics: Dict[str, float] = {"n_tokens": n_tok, "n_seqs": n_seq}
        if self.groups.is_last_stage():
            res = finalize_mismatch(acc.reduce(self.groups.dp_cp, self.groups.device).result())
            res["log_ratio_hist"] = acc.coarse_hist(
                "ratio", bins=200
            )  # 0.02-wide bins, log ρ ∈ [−2, 2]
            res["loss"] = acc.sums["loss"][0]  # Σ over micro-batches and DP×CP ranks
            res["nonfinite_masked"] = acc.sums["nonfinite_masked"][0]
            metrics.update(res)
        if ess is not None:
            metrics["ess"] = ess
        if ess_p is not None:
            metrics["ess_prox"] = ess_p
        if micro_ess:
            metrics["ess"] = sum(micro_ess) / len(micro_ess)
            metrics["ess_microbatch_min"] = min(micro_ess)
        return self._from_last_stage(metrics)

    def _from_last_stage(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        """The last stage's metrics on every stage (the logger is global rank 0, a first stage)."""
        if not self.groups.layout.pp_enabled:
            return metrics
        box = [metrics if self.groups.is_last_stage() else None]
        # PP group: loss, ratios, k3, entropy and the histogram exist on the last stage only.
        dist.broadcast_object_list(
            box, src=self.groups.last_stage_global_rank(), group=self.groups.pp
        )
        return box[0]


def _concat(mbs: List[MicroBatch]) -> MicroBatch:
    """Micro-batches stacked along the batch dimension (same keys, same sequence length)."""
    if len(mbs) == 1:
        return mbs[0]
    return {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0] if torch.is_tensor(mbs[0][k])}
