"""The policy update of one optimizer step, driven through Megatron-Core's schedules: one
normalizer and one e_B per step.

Why a module of the trainer layer: this is the driver that runs Megatron's schedule (the ESS
pre-pass, the ℓold recompute, the gradient pass) around the maths of ``loss/`` (log-prob
kernel, global ESS, objectives), which stays pure.

Order of one optimizer step (``PolicyUpdate.run``):
1. Count the step's valid tokens and sequences on every rank and all-reduce them over DP:
   the single normalizer N_B (or the sequence count), known before any gradient.
2. e_B before any gradient (scope ``step``, objectives that need e_B): float64 (Σρ, Σρ², N)
   of every micro-batch with the current weights, summed over micro-batches and all-reduced
   once over DP on the last pipeline stage; e_B is then frozen for the step's losses (the
   weights do not change inside the step, so it is exact). One micro-batch per DP rank pools
   them in the gradient pass itself; where the step's graphs fit (``batch.keep_graphs``, no
   PP) the gradient pass's own forwards run first with their graphs kept and give them
   (:mod:`.kept_graphs`: the same numbers, one forward fewer); otherwise a no-grad ESS
   pre-pass, which also takes the metric-only entropy (no gradient pass pays for it).
   Scope ``microbatch`` (FeynRL-compatible) skips the pre-pass: micro-batch k's e_B pools the
   k-th micro-batch of every DP rank.
3. Gradient pass through ``forward_backward``: each micro-batch returns Σ terms / N_B. Megatron
   only sums (``calculate_per_token_loss`` + our finalizer), so the gradient is that of one
   process holding the whole step batch. A micro-batch reads nothing back to the host (each
   read would stall the device stream): its metrics accumulate as device tensors, and the
   checks that need a host decision (non-finite ℓθ, an empty micro-batch ESS pool) run after
   the schedule, with the metrics' one reduction and one device→host read of the step.
4. The loss-side metrics live on the last pipeline stage; they are sent to every stage so the
   logger (global rank 0, first stage) writes them under PP > 1 too.

Context parallelism: each CP rank scores its own chunks of every sequence; the per-token
ℓθ are then all-gathered over CP (:func:`~megatron_p3o.model.packed.gather_tokens`) so that every
CP rank computes the same loss of *whole* sequences. Objectives nonlinear in a sequence's sum
(GSPO, OAPL) and the ℓold recompute therefore work at any CP, and the loss side reduces over DP
only.

Micro-batches come from :mod:`megatron_p3o.update.batching` (padded or packed): ``tokens``,
``targets``
and a nested ``response`` dict of ``[n, L]`` completion-token tensors (``mask``,
``behavior_logprobs``, ``advantages``, ``index``, ``sample_index``, optionally
``old_logprobs`` / ``ref_logprobs``). Flat padded micro-batches (``loss_mask``,
``behavior_logprobs``… as ``[b, s]``) are accepted and nested in place. Objectives with their
own advantages (OAPL's A*) deliver them in ``advantages`` from the advantage stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_p3o.logprob.scoring import response_logprobs, score_responses
from megatron_p3o.loss.config import LossConfig
from megatron_p3o.loss.diagnostics import (
    add_mismatch_metrics,
    finalize_mismatch,
    kl_prev_epoch_terms,
)
from megatron_p3o.loss.ess import (
    EmptyStepError,
    FiniteWatch,
    NonFiniteLogprobError,
    all_reduce_stats,
    check_finite,
    ess_from_stats,
    ess_stats,
    ess_tensor,
)
from megatron_p3o.loss.m2po import m2_cut, m2_values, m2po_microbatch_keep
from megatron_p3o.loss.registry import Objective
from megatron_p3o.loss.terms import LossInputs, StepStats
from megatron_p3o.model.forward import MicroBatch, forward_backward, nest_response
from megatron_p3o.observability.metrics import StepMetrics
from megatron_p3o.runtime.collectives import (
    all_gather_into,
    all_gather_objects,
    all_max,
    all_sum,
    broadcast,
    broadcast_objects,
)
from megatron_p3o.runtime.fields import check_choice
from megatron_p3o.runtime.parallel import ParallelGroups
from megatron_p3o.update import kept_graphs, step_memory
from megatron_p3o.update.batching import KEEP_GRAPHS, KEEP_LOGITS, stack_padded

# the step's count of non-finite ℓθ travels with its metrics (one reduction), never logged
_NONFINITE = "_nonfinite_logprobs"


@dataclass
class StepPlan:
    """What one optimizer step does, decided before any forward (:meth:`PolicyUpdate.plan`):
    the global counts, where e_B comes from (``none`` | ``prepass`` | ``kept_graphs`` |
    ``gradient_pass`` | ``microbatch``) and where the metric-only entropy is taken. M2PO's cut
    and kept-token count (its normalizer: ``Objective.normalizer``) are filled in by
    :meth:`PolicyUpdate.m2po_step`."""

    n_tok: float
    n_seq: float
    n_micro: int
    ess_from: str
    one_pool: bool  # each DP rank holds one micro-batch and no PP: an in-pass pool is the step
    entropy_done: bool  # the pre-pass took the metric-only entropy
    want_entropy: bool
    keep_logits: bool = False  # the fused kernel keeps its logits for the backward (this rank)
    cut: Optional[Any] = None
    m2_kept: Optional[float] = None


class PolicyUpdate:
    """Runs the objective over one optimizer step's micro-batches (see the module docstring).

    ``temperature``: the sampling temperature; ℓθ is computed from logits / T.
    ``keep_graphs`` (``batch.keep_graphs``): e_B of a step of several micro-batches per DP rank
    from the gradient pass's own forwards, their graphs kept (:mod:`.kept_graphs`): ``auto``
    when they fit in memory, ``always`` whenever the layout allows, ``never`` (the default of a
    ``PolicyUpdate`` built in code; the trainer passes the recipe's): the ESS pre-pass.
    ``keep_logits`` (``batch.keep_logits``): the fused kernel keeps its logits for the gradient
    pass's backward where they fit (``auto``), or recomputes them (``never``, the default in
    code).
    """

    def __init__(
        self,
        objective: Objective,
        groups: ParallelGroups,
        vocab_size: int,
        cfg: LossConfig = LossConfig(),
        temperature: float = 1.0,
        keep_graphs: str = "never",
        keep_logits: str = "never",
    ):
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0")
        check_choice("batch.keep_graphs", keep_graphs, KEEP_GRAPHS)
        self.objective, self.groups, self.vocab_size, self.cfg = objective, groups, vocab_size, cfg
        self.temperature = temperature
        check_choice("batch.keep_logits", keep_logits, KEEP_LOGITS)
        self.keep_graphs, self.keep_logits = keep_graphs, keep_logits

    # -- stage 0: input checks -----------------------------------------------------------------
    def _check_behavior_logprobs(self, microbatches: List[MicroBatch]) -> None:
        """Refuse non-finite ℓb on *every* rank before any collective (no rank is left waiting)."""
        if self.cfg.nonfinite != "error":
            return
        msg = None
        for mb in microbatches:
            r = mb["response"]
            ids = r.get("sample_index")
            try:
                check_finite(
                    "behaviour log-prob ℓb",
                    r["behavior_logprobs"],
                    r["mask"].float(),
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
        all_max(flag, self.groups.world, "any rank's bad ℓb stops every rank (else they hang)")
        if flag.item() > 0:
            msgs = all_gather_objects(msg, self.groups.world, "every rank names the same sample")
            first = next((r, m) for r, m in enumerate(msgs) if m)
            raise NonFiniteLogprobError(
                first[1]
                if first[0] == dist.get_rank()
                else f"{first[1]} (found on rank {first[0]})"
            )

    # -- stage 1: counts -------------------------------------------------------------------
    def _global_counts(self, microbatches: List[MicroBatch], misfit: Optional[float] = None):
        """``(N_B tokens, sequences, micro-batches, misfits)`` of the step over every DP rank.

        ``misfit`` (``batch.keep_graphs: auto``): 1.0 when this rank's kept graphs would not fit
        in its memory. Every rank must take the same path, so the verdicts travel with the
        counts, over the world when TP or CP ranks share a DP rank (their counts, the same
        micro-batches', are divided back out: exact, whole numbers in float64)."""
        n_tok = n_seq = 0.0  # host-side sums of the (host) micro-batches' masks
        for mb in microbatches:
            m = mb["response"]["mask"].double()
            n_tok += float(m.sum())
            n_seq += float((m.sum(-1) > 0).sum())
        local = torch.tensor(
            [n_tok, n_seq, len(microbatches), misfit or 0.0],
            dtype=torch.float64,
            device=self.groups.device,
        )
        replicas = 1  # ranks that hold the same micro-batches (TP, CP): only asked with a verdict
        if misfit is not None:
            replicas = self.groups.world_size // (self.groups.layout.dp or 1)
        if replicas > 1:
            why = ("N_B: each DP rank's share, repeated on its TP/CP ranks (divided back out); "
                   "and whether any rank's kept graphs do not fit")  # fmt: skip
            all_sum(local, self.groups.world, why)
            local[:3] /= replicas
        elif self.groups.layout.dp_enabled:
            all_sum(local, self.groups.dp, "N_B: each DP rank holds a disjoint share of the step "
                    "(CP ranks of one DP rank hold the same micro-batches)")  # fmt: skip
        n_tok, n_seq, n_micro, misfits = local.tolist()
        if n_tok <= 0:
            raise EmptyStepError("the optimizer step has no valid tokens (all loss masks are 0)")
        return n_tok, n_seq, int(n_micro), misfits

    def _logprobs(self, batch, logits, watch: FiniteWatch, entropy: bool = True, value=False,
                  keep_logits: bool = False):  # fmt: skip
        """ℓθ, entropy, the mask to use and V(s₁) of one micro-batch, with no host read: with
        ``nonfinite: mask`` non-finite tokens leave the mask; with ``error`` (ℓb was checked on
        every rank before the step) ``watch`` keeps ℓθ, and the step raises after its schedule
        (a check here would stall the device every micro-batch)."""
        # the logits feed only this loss: their storage is reused for the gradient
        lp, ent, val = response_logprobs(
            batch, logits, self.groups, self.temperature, self.vocab_size,
            self.cfg.logprob_chunk, with_entropy=entropy, with_value=value, inplace=True,
            keep_logits=keep_logits,
        )  # fmt: skip
        resp = batch["response"]
        mask = resp["mask"].to(torch.float32)
        if self.cfg.nonfinite == "mask":
            mask = check_finite(
                "behaviour log-prob ℓb", resp["behavior_logprobs"], mask, None, "mask"
            )
            mask = check_finite("trainer log-prob ℓθ", lp.detach(), mask, None, "mask")
        else:
            watch.watch("trainer log-prob ℓθ", lp, mask, resp.get("sample_index"))
        return lp, ent, mask, val

    def _inputs(self, batch, lp, ent, mask, value=None) -> LossInputs:
        resp = batch["response"]
        return LossInputs(
            logprobs=lp,
            behavior_logprobs=resp["behavior_logprobs"],
            advantages=resp["advantages"],
            mask=mask,
            old_logprobs=resp.get("old_logprobs"),
            ref_logprobs=resp.get("ref_logprobs"),
            # Group baselines (GRPO's, OAPL's V*) need whole prompt groups, which micro-batches and
            # DP ranks split: they are computed in the advantage stage and arrive in "advantages".
            entropy=ent,
            rewards=None,
            group_ids=None,
            values=value,
            ref_values=resp.get("ref_values"),
            m2po_keep=resp.get("m2po_keep"),
        )

    def _ess_stats(self, inp: LossInputs) -> torch.Tensor:
        parts = [ess_stats(inp.logprobs, inp.behavior_logprobs, inp.mask)]
        if self.objective.needs_ess_prox:
            parts.append(ess_stats(inp.logprobs, inp.old_logprobs, inp.mask))
        return torch.cat(parts)

    @staticmethod
    def _ess_values(stats, what: str):
        """(e_B, e_prox or None) from host statistics ``[Σρ, Σρ², N] (+ prox)``, checked."""
        ess = ess_from_stats(stats[:3], what)
        ess_p = ess_from_stats(stats[3:], what + " (prox)") if len(stats) > 3 else None
        return ess, ess_p

    # -- stage 2: ESS pre-pass ---------------------------------------------------------------
    def _ess_prepass(self, chunks, microbatches, acc: StepMetrics) -> Optional[tuple]:
        """e_B of the step (no grad); with ``log_entropy`` the metric-only entropy is taken here,
        so the gradient pass computes it only when the objective differentiates it."""
        stats: List[torch.Tensor] = []
        want_ent = self.cfg.log_entropy
        watch = FiniteWatch()

        def loss_fn(batch, logits):
            with torch.no_grad():
                lp, ent, mask, _ = self._logprobs(batch, logits, watch, entropy=want_ent)
                stats.append(self._ess_stats(self._inputs(batch, lp, ent, mask)))
                if ent is not None:
                    acc.add("entropy", (ent * mask).sum(), mask.sum())
            return torch.zeros((), device=logits.device), 0, {}

        with torch.no_grad():
            forward_backward(
                chunks, self.groups, stack_padded(microbatches, self.cfg.prepass_fuse), loss_fn,
                forward_only=True,
            )  # fmt: skip
        if not self.groups.is_last_stage():
            return None
        # DP group: Σρ, Σρ², N of the whole optimizer step and its count of non-finite ℓθ,
        # all-reduced once (CP ranks hold whole sequences after the loss-side gather: they
        # agree, nothing to add over CP), read on the host once.
        local = torch.cat([torch.stack(stats).sum(0), watch.count(self.groups.device)[None]])
        total = all_reduce_stats(local, self.groups.dp).tolist()
        if total[-1]:
            watch.raise_error(total[-1])
        return self._ess_values(total[:-1], "optimizer step")

    def _broadcast_from_last_stage(self, values: Optional[tuple]) -> tuple:
        """Every pipeline stage learns e_B (for logging and checks)."""
        t = torch.tensor(
            [float("nan") if v is None else v for v in (values or (None, None))],
            dtype=torch.float64,
            device=self.groups.device,
        )
        if self.groups.layout.pp_enabled:
            broadcast(t, self.groups.last_stage_global_rank(), self.groups.pp,
                      "e_B: only the last stage computed log-probs")  # fmt: skip
        return tuple(None if v != v else v for v in t.tolist())

    # -- M2PO: the step's second-moment cut ----------------------------------------------------
    def _m2po_cut(self, microbatches: List[MicroBatch]) -> tuple:
        """M2PO's ``(cut, kept tokens)`` over the step's global token set: (ℓold − ℓb)² of every
        valid token of every micro-batch, gathered over DP (CP ranks hold the same whole
        sequences; the last pipeline stage holds ℓold). One host read."""
        if not self.groups.is_last_stage():
            return None, None
        parts = [m2_values(_m2_inputs(mb["response"])) for mb in microbatches]
        dev = self.groups.device
        local = (
            torch.cat(parts).to(dev) if parts else torch.zeros(0, dtype=torch.float64, device=dev)
        )
        if self.groups.layout.dp_enabled:
            # DP group: each DP rank holds a disjoint share of the step's tokens; the cut needs
            # all of them (sizes first: the shares differ in length).
            n = torch.tensor([local.numel()], device=local.device)
            sizes = [torch.zeros_like(n) for _ in range(self.groups.layout.dp)]
            all_gather_into(sizes, n, self.groups.dp, "M2PO cut: the DP shares' sizes")
            width = int(max(int(x) for x in sizes))
            padded = torch.zeros(width, dtype=local.dtype, device=local.device)
            padded[: local.numel()] = local
            bufs = [torch.empty_like(padded) for _ in sizes]
            all_gather_into(bufs, padded, self.groups.dp, "M2PO cut: every DP share's values")
            local = torch.cat([b[: int(k)] for b, k in zip(bufs, sizes)])
        cut, _ = m2_cut(local, self.objective.hyper.tau)
        return cut, float(local.numel() - int((local >= cut).sum()))

    def _m2po_microbatch_keeps(self, microbatches: List[MicroBatch]) -> None:
        """M2PO, scope ``microbatch`` (AReaL's): each micro-batch's own keep-mask, from its host
        ℓold and ℓb before the gradient pass (no read inside the schedule), stored as
        ``response.m2po_keep``; the loss needs no step-wide cut."""
        if not self.groups.is_last_stage():
            return
        for mb in microbatches:
            r = mb["response"]
            r["m2po_keep"] = m2po_microbatch_keep(_m2_inputs(r), self.objective.hyper.tau)

    # -- ℓold / ℓprox: the policy at the start of the rollout batch ---------------------------
    def recompute_old_logprobs(self, chunks, microbatches: List[MicroBatch]) -> None:
        """Store ``response.old_logprobs`` (ℓθ before this rollout batch's first update, no grad)
        in each micro-batch, for the objectives that ratio against πold/πprox (decoupled PPO,
        TIS, MIS, P4O). Computed on the last pipeline stage, where the loss runs."""
        score_responses(
            chunks, self.groups, microbatches, "old_logprobs", self.temperature,
            self.vocab_size, self.cfg.logprob_chunk,
        )  # fmt: skip

    # -- stage 3: gradient pass --------------------------------------------------------------
    def run(
        self, chunks, microbatches: List[MicroBatch], forward_only: bool = False
    ) -> Dict[str, float]:
        """Loss, gradients (accumulated into the DDP buffers) and metrics of one optimizer step,
        as the module docstring's steps: plan → e_B before the gradients → M2PO's cut →
        gradient pass (or the kept-graph pass: e_B from its own forwards) → metrics. Every CP
        rank computes the loss of whole sequences (see
        :func:`~megatron_p3o.logprob.scoring.response_logprobs`): the loss side sums over DP."""
        self._check_inputs(microbatches)
        plan = self.plan(microbatches, None if forward_only else chunks)
        acc = StepMetrics()
        ess = self.ess_before_gradients(chunks, microbatches, plan, acc)
        self.m2po_step(microbatches, plan)
        if plan.ess_from == "kept_graphs":
            pools = []
            ess, watch = kept_graphs.kept_graph_pass(self, chunks, microbatches, plan, acc)
        else:
            pools, watch = self.gradient_pass(chunks, microbatches, plan, ess, acc, forward_only)
        return self._from_last_stage(self.finalise(plan, ess, pools, watch, acc))

    def _check_inputs(self, microbatches: List[MicroBatch]) -> None:
        """Step 0: micro-batches in the nested form; whole sequences for per-sequence objectives;
        finite ℓb on every rank before any collective."""
        for mb in microbatches:
            nest_response(mb)
        if self.objective.per_sequence:
            _check_whole_sequences(microbatches, self.objective.name)
        self._check_behavior_logprobs(microbatches)

    def plan(self, microbatches: List[MicroBatch], chunks=None) -> "StepPlan":
        """Step 1: the step's global counts (one all-reduce) and where e_B comes from.

        N_B = Σ over every micro-batch of every DP rank of the valid completion tokens (the
        sequence count for per-sequence objectives): the one normalizer of the step's token
        mean. e_B = (Σρ)² / (N·Σρ²) (Fakoor et al., 2026, Eq. 5) is pooled over
          - the whole step, inside the gradient pass when each DP rank holds exactly one
            micro-batch and there is no PP (that micro-batch *is* the step: the same statistics,
            one forward fewer);
          - the whole step, from the gradient pass's own forwards run first with their graphs
            kept (``batch.keep_graphs``, several micro-batches per DP rank, no PP, ``chunks``
            given: a step that trains; :mod:`.kept_graphs`);
          - the whole step, from a no-grad pre-pass otherwise (``ess_scope: step``);
          - micro-batch k of every DP rank (``ess_scope: microbatch``, FeynRL's)."""
        layout = self.groups.layout
        step_scope = self.cfg.ess_scope == "step"
        keep = self._keep_mode(chunks) if step_scope and self.objective.needs_ess else None
        misfit = need = None
        if chunks is not None and (keep == "auto" or self.keep_logits == "auto"):
            need = step_memory.step_need(chunks, microbatches, self.groups, self.vocab_size)
        if keep == "auto":
            misfit = 0.0 if need.graphs_fit else 1.0
        n_tok, n_seq, n_micro, misfits = self._global_counts(microbatches, misfit)
        one_per_rank = step_scope and n_micro == (layout.dp or 1) and not layout.pp_enabled
        if not self.objective.needs_ess:
            ess_from = "none"
        elif not step_scope:
            ess_from = "microbatch"
        elif one_per_rank:
            ess_from = "gradient_pass"
        else:
            ess_from = "kept_graphs" if keep is not None and not misfits else "prepass"
        entropy_done = ess_from == "prepass" and self.cfg.log_entropy
        keep_logits = (self.keep_logits == "auto" and need is not None
                       and need.logits_fit(ess_from == "kept_graphs"))  # fmt: skip
        return StepPlan(
            n_tok=n_tok,
            n_seq=n_seq,
            n_micro=n_micro,
            ess_from=ess_from,
            one_pool=one_per_rank,
            entropy_done=entropy_done,
            want_entropy=self.objective.needs_entropy
            or (self.cfg.log_entropy and not entropy_done),
            keep_logits=keep_logits,
        )

    def _keep_mode(self, chunks) -> Optional[str]:
        """``batch.keep_graphs`` when this step may keep its graphs (a step that trains, a layout
        and model that allow it), else None."""
        if self.keep_graphs == "never" or chunks is None:
            return None
        if kept_graphs.layout_refuses(chunks, self.groups) is not None:
            return None
        return self.keep_graphs

    def ess_before_gradients(self, chunks, microbatches, plan: "StepPlan", acc) -> tuple:
        """Step 2: ``(e_B, e_prox)`` from the pre-pass when the plan says so (float64 (Σρ, Σρ²,
        N) summed over micro-batches, all-reduced over DP on the last stage, sent to every
        stage), else ``(None, None)``: the gradient pass pools them itself."""
        if plan.ess_from != "prepass":
            return None, None
        return self._broadcast_from_last_stage(self._ess_prepass(chunks, microbatches, acc))

    def m2po_step(self, microbatches: List[MicroBatch], plan: "StepPlan") -> None:
        """Step 3 (M2PO only): the step's second-moment cut and its kept tokens, which become
        the normalizer; or the per-micro-batch keeps of ``scope: microbatch``."""
        if self.objective.needs_m2_cut:
            plan.cut, plan.m2_kept = self._m2po_cut(microbatches)
        elif self.objective.needs_m2_microbatch_keep:
            self._m2po_microbatch_keeps(microbatches)

    def gradient_pass(self, chunks, microbatches, plan: "StepPlan", ess: tuple, acc, forward_only):
        """Step 4: Megatron's schedule over every micro-batch; each returns Σ terms / N_B
        (Megatron only sums: the gradient of one process holding the whole step). Returns the
        ESS statistics pooled inside the pass (``[3 or 6]`` float64 per pool) and the watch of
        non-finite ℓθ. A micro-batch reads nothing on the host (each read stalls the device
        stream): metrics accumulate as device tensors, checked once after the schedule."""
        pools: List[torch.Tensor] = []
        watch = FiniteWatch()
        pooled = plan.ess_from in ("gradient_pass", "microbatch")
        order = iter(microbatches)  # the last stage runs the losses in micro-batch order

        def loss_fn(batch, logits):
            inp = self.score(batch, logits, watch, plan)
            e, e_p = ess
            if pooled:
                # DP group: micro-batch k of every data-parallel rank forms one ESS pool. e_B
                # stays a device scalar; its statistics are checked after the schedule.
                st = all_reduce_stats(self._ess_stats(inp), self.groups.dp)
                pools.append(st)
                e = ess_tensor(st[:3])
                e_p = ess_tensor(st[3:]) if st.numel() > 3 else None
            loss = self.micro_loss(batch, inp, plan, (e, e_p), acc, next(order))
            return loss, inp.mask.sum().to(torch.int), {}

        forward_backward(chunks, self.groups, microbatches, loss_fn, forward_only=forward_only)
        return pools, watch

    def score(self, batch, logits, watch: FiniteWatch, plan: "StepPlan") -> LossInputs:
        """A micro-batch's loss inputs from the model's output: ℓθ (and the entropy, V(s₁) when
        asked for), the mask to use; checked against what the objective needs."""
        lp, ent, mask, val = self._logprobs(batch, logits, watch, plan.want_entropy,
                                            self.objective.needs_value,
                                            plan.keep_logits)  # fmt: skip
        inp = self._inputs(batch, lp, ent, mask, val)
        self.objective.check_inputs(inp)
        return inp

    def micro_loss(self, batch, inp: LossInputs, plan: "StepPlan", ess: tuple, acc,
                   host: MicroBatch) -> torch.Tensor:  # fmt: skip
        """Σ terms / N_B of one micro-batch given the step's ``(e_B, e_prox)``; its metrics
        accumulate in ``acc`` as device tensors. ``host``: the host micro-batch (epoch reuse)."""
        stats = StepStats(plan.n_tok, plan.n_seq, ess[0], ess[1], m2po_cut=plan.cut,
                          m2po_kept=plan.m2_kept)  # fmt: skip
        total, pairs = self.objective.terms(inp, stats)
        loss = total / self.objective.normalizer(stats)
        with torch.no_grad():
            acc.add("loss", loss.detach(), 1.0)
            for k, (num, den) in pairs.items():
                acc.add(k, num, den)
            dropped = batch["response"]["mask"].sum() - inp.mask.sum()
            acc.add("nonfinite_masked", dropped, 1.0)
            add_mismatch_metrics(acc, inp, entropy=not plan.entropy_done)
            _track_epochs(host, inp, acc)
        return loss

    def finalise(self, plan: "StepPlan", ess: tuple, pools, watch, acc) -> Dict[str, Any]:
        """Step 5: the loss side's one DP reduction and one device→host read (last stage), the
        deferred checks (non-finite ℓθ, empty ESS pools), and the step's e_B in the metrics:
        the pre-pass value, the one in-pass pool, or the mean (and min) over micro-batch pools."""
        metrics: Dict[str, Any] = {"n_tokens": plan.n_tok, "n_seqs": plan.n_seq}
        if plan.ess_from in ("prepass", "kept_graphs"):  # did e_B cost a forward of its own?
            metrics["ess_prepass"] = float(plan.ess_from == "prepass")
        if plan.m2_kept is not None:
            metrics["m2po_kept_tokens"] = plan.m2_kept
        micro_ess: List[tuple] = []  # (e_B, e_prox or None) per ESS pool
        if self.groups.is_last_stage():
            acc.add(_NONFINITE, watch.count(self.groups.device), 1.0)
            # DP group: each DP rank's micro-batches hold a disjoint share of the sequences.
            acc.reduce(self.groups.dp, self.groups.device)
            micro = acc.to_host(*pools)  # the step's one device→host read of the loss side
            bad = acc.sums.pop(_NONFINITE)[0]
            if bad:  # on every DP rank: the count was summed over them
                watch.raise_error(bad)
            pool = "optimizer step" if plan.one_pool else "micro-batch"
            micro_ess = [self._ess_values(st.tolist(), pool) for st in micro]
            res = finalize_mismatch(acc.result())
            res["log_ratio_hist"] = acc.coarse_hist("ratio", bins=200)  # 0.02-wide, log ρ ∈ [−2, 2]
            res["loss"] = acc.sums["loss"][0]  # Σ over micro-batches and DP ranks
            res["nonfinite_masked"] = acc.sums["nonfinite_masked"][0]
            metrics.update(res)
        ess_b, ess_p = ess
        if ess_b is not None:
            metrics["ess"] = ess_b
        if ess_p is not None:
            metrics["ess_prox"] = ess_p
        if micro_ess and plan.one_pool:  # one pool: the step's e_B (and e_prox)
            metrics["ess"], e_p = micro_ess[0]
            if e_p is not None:
                metrics["ess_prox"] = e_p
        elif micro_ess:
            values = [e for e, _ in micro_ess]
            metrics["ess"] = sum(values) / len(values)
            metrics["ess_microbatch_min"] = min(values)
        return metrics

    def _from_last_stage(self, metrics: Dict[str, Any]) -> Dict[str, Any]:
        """The last stage's metrics on every stage (the logger is global rank 0, a first stage)."""
        if not self.groups.layout.pp_enabled:
            return metrics
        box = [metrics if self.groups.is_last_stage() else None]
        broadcast_objects(box, self.groups.last_stage_global_rank(), self.groups.pp,
                          "the loss-side metrics exist on the last stage only")  # fmt: skip
        return box[0]


def _track_epochs(host: MicroBatch, inp: LossInputs, acc: StepMetrics) -> None:
    """Reuse (``batch.epochs`` > 1) sees the same host micro-batch once per epoch: this step's
    ℓθ ``[B, T]`` is kept in it (``response.prev_epoch_logprobs``, freed with the rollout
    batch), and the next epoch's step adds ``kl_prev_epoch`` = KL(π one epoch earlier‖πθ) on its
    tokens (:func:`~megatron_p3o.loss.diagnostics.kl_prev_epoch_terms`). Metrics only."""
    resp = host["response"]
    prev = resp.get("prev_epoch_logprobs")
    if prev is not None and prev.shape == inp.logprobs.shape:
        acc.add("kl_prev_epoch", *kl_prev_epoch_terms(inp.logprobs, prev, inp.behavior_logprobs,
                                                      inp.mask))  # fmt: skip
    resp["prev_epoch_logprobs"] = inp.logprobs.detach()


def _check_whole_sequences(microbatches: List[MicroBatch], name: str) -> None:
    """Objectives over per-sequence values (ReVal's δ², OAPL's and GSPO's sums, GRPO's
    sequence-mean) need each sequence in exactly one micro-batch: a sequence seen twice would
    be squared (or counted) in pieces."""
    seen: Dict[int, int] = {}
    for k, mb in enumerate(microbatches):
        ids = mb["response"].get("sample_index")
        for sid in ids.tolist() if ids is not None else ():
            if sid in seen:
                raise ValueError(
                    f"objective {name!r}: sample {sid} is in micro-batches {seen[sid]} and {k} "
                    "of one optimizer step; its per-sequence terms need the whole sequence in one "
                    "micro-batch (never split a sequence)"
                )
            seen[sid] = k


def _m2_inputs(r: dict) -> LossInputs:
    """M2PO's view of a micro-batch's response (host ℓb, ℓold, mask; no ℓθ): Δ = ℓold − ℓb."""
    return LossInputs(
        r["mask"].new_zeros(()), r["behavior_logprobs"], None, r["mask"].float(),
        old_logprobs=r["old_logprobs"],
    )  # fmt: skip
