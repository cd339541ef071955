"""e_B without a second forward: every micro-batch's forward with its autograd graph kept, e_B
pooled from their ℓθ, then the backwards — when the step's graphs fit in memory.

Why: e_B is a statistic of the whole optimizer step, and each micro-batch's gradient needs it.
With several micro-batches per DP rank the exact route used to be a no-grad forward of every
micro-batch before the gradient pass (the ESS pre-pass, :meth:`PolicyUpdate.ess_before_gradients`):
one forward more than GRPO's step (≈ ⅓ of a forward + backward, 1.3× GRPO's training phase on
the tiny recipe). When a rank's whole step fits in memory the gradient pass's own forwards give
the same ℓθ: they run first, all of them, with their graphs kept; e_B is pooled from them (Σρ,
Σρ², N in float64, summed over micro-batches in order, all-reduced once over DP, as the pre-pass
does); then each micro-batch's loss takes that e_B and runs its backward, in micro-batch order.

Exact: the forwards are the gradient pass's, with the same weights and inputs, so ℓθ, e_B, the
losses and the gradients (accumulated into ``main_grad`` micro-batch by micro-batch, in order)
equal the pre-pass path's bit for bit on CPU on the same micro-batches
(``tests/distributed/test_kept_graphs_one_pass.py``); padded micro-batches, which the pre-pass
stacks ``loss.prepass_fuse`` at a time, agree within float rounding.

When (``batch.keep_graphs``): ESS scope ``step`` with several micro-batches per DP rank (one
micro-batch per rank already pools e_B inside its pass), one model chunk and no pipelining
(1F1B interleaves the stages' forwards and backwards; the pre-pass stays), a dense model without
multi-token prediction, a step that trains. ``auto`` (the default) keeps the graphs when
:func:`~megatron_p3o.update.step_memory.kept_graph_bytes` of the step's micro-batches fits in
half of what the device has left (:func:`~megatron_p3o.update.step_memory.room_for_graphs`),
every rank agreeing (one flag in the step's count reduction); ``always`` whenever the layout
allows; ``never``: the pre-pass.
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional, Tuple

import torch

from megatron_p3o.loss.ess import FiniteWatch, all_reduce_stats
from megatron_p3o.model.forward import MicroBatch, _forward_step
from megatron_p3o.runtime import mcore_compat
from megatron_p3o.runtime.parallel import ParallelGroups


def layout_refuses(chunks, groups: ParallelGroups) -> Optional[str]:
    """Why this layout and model cannot keep a step's graphs (None: they can)."""
    if len(chunks) != 1 or groups.layout.pp_enabled:
        return "pipeline parallelism interleaves the stages' forwards and backwards"
    cfg = mcore_compat.unwrap(chunks[0]).config
    if getattr(cfg, "num_moe_experts", None):
        return "mixture-of-experts layers set routing state per forward"
    if getattr(cfg, "mtp_num_layers", None):
        return "multi-token prediction"
    return None


def kept_graph_pass(update, chunks, microbatches: List[MicroBatch], plan, acc) -> Tuple:
    """The step's gradients with e_B from its own forwards (see the module docstring). Returns
    ``((e_B, e_prox or None), watch)``: e_B as host floats, as the pre-pass gives it, and the
    watch of non-finite ℓθ (already checked: the step raises before any backward)."""
    groups = update.groups
    watch = FiniteWatch()
    kept: List[tuple] = []  # (device micro-batch, its loss inputs with their graphs)

    def first(batch, logits):
        inp = update.score(batch, logits, watch, plan)
        kept.append((batch, inp))
        # the schedule's loss of this forward: none yet (it waits for e_B)
        return torch.zeros((), device=inp.logprobs.device), inp.mask.sum().to(torch.int), {}

    ess: list = []
    hosts = iter(microbatches)

    def loss_of(k: int) -> torch.Tensor:
        if not ess:
            ess.extend(_pooled(update, kept, watch))
        batch, inp = kept[k]
        kept[k] = None  # this micro-batch's graph is freed by its backward
        return update.micro_loss(batch, inp, plan, tuple(ess), acc, next(hosts))

    mcore_compat.forwards_then_backwards(
        chunks[0], partial(_forward_step, groups, first), microbatches, loss_of,
        groups.pg_collection, groups.layout.cp,
    )  # fmt: skip
    return tuple(ess), watch


def _pooled(update, kept, watch: FiniteWatch) -> tuple:
    """``(e_B, e_prox or None)`` of the step from the kept forwards' ℓθ: float64 (Σρ, Σρ², N)
    per micro-batch, summed in micro-batch order, all-reduced once over DP with the count of
    non-finite ℓθ, read on the host once (the pre-pass's reduction)."""
    groups = update.groups
    stats = torch.stack([update._ess_stats(inp) for _, inp in kept]).sum(0)
    # DP group: Σρ, Σρ², N of the whole optimizer step and its count of non-finite ℓθ (CP ranks
    # hold whole sequences after the loss-side gather: they agree, nothing to add over CP).
    local = torch.cat([stats, watch.count(groups.device)[None]])
    total = all_reduce_stats(local, groups.dp).tolist()
    if total[-1]:
        watch.raise_error(total[-1])
    return update._ess_values(total[:-1], "optimizer step")
