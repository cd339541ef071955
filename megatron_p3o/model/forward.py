"""One optimizer step's forward/backward through Megatron-Core's pipeline schedules.

Why: whatever the layout (no pipelining, 1F1B, interleaved), the trainer and the tests hand this
module a list of micro-batches and a per-micro-batch loss function; it slices each micro-batch for
context parallelism (Megatron's own ``get_batch_on_this_cp_rank``), runs the model chunks through
``get_forward_backward_func`` and returns what the loss function reported on the last stage.

Micro-batch contract: a dict of ``[b, s]`` tensors with at least ``tokens`` (input ids) and
``targets`` (the next token at each position; masked positions may hold any id). All other
``[b, s]`` entries (loss mask, behaviour log-probs, advantages…) are CP-sliced the same way.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Sequence

import torch
from torch import Tensor

from .. import mcore_compat
from ..parallel import ParallelGroups

MicroBatch = Dict[str, Tensor]
# loss_fn(batch, logits [b, s/cp, V/tp]) -> (loss scalar, token count, metrics dict)
LossFn = Callable[[MicroBatch, Tensor], tuple]


def next_token_targets(tokens: Tensor, pad_id: int = 0) -> Tensor:
    """``[b, s]`` targets: position t predicts token t+1; the last position gets ``pad_id``."""
    targets = torch.full_like(tokens, pad_id)
    targets[:, :-1] = tokens[:, 1:]
    return targets


def slice_for_cp(batch: MicroBatch, groups: ParallelGroups) -> MicroBatch:
    """This CP rank's two load-balanced chunks of every ``[b, s]`` tensor (Megatron's split).

    Per-sequence entries (``[b]``: rewards, lengths, sample indices) pass through unchanged.
    """
    if not groups.layout.cp_enabled:
        return batch
    from megatron.core.utils import get_batch_on_this_cp_rank

    per_token = {k: v for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2}
    sliced = get_batch_on_this_cp_rank(per_token, cp_group=groups.cp)
    return {**batch, **sliced}


def to_device(batch: MicroBatch, device: torch.device) -> MicroBatch:
    """Micro-batches are built on the host; every tensor moves to the training device right
    before its forward (as torchtitan does), never earlier."""
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
    }


def _forward_step(groups: ParallelGroups, loss_fn: LossFn, data_iterator, model):
    batch = slice_for_cp(to_device(next(data_iterator), groups.device), groups)
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
    logits = model(tokens, position_ids, None)  # [b, s/cp, V/tp] on the last stage
    return logits, partial(_call_loss, loss_fn, batch)


def _call_loss(loss_fn: LossFn, batch: MicroBatch, logits: Tensor):
    loss, num_tokens, metrics = loss_fn(batch, logits)
    return loss, torch.as_tensor(num_tokens, dtype=torch.int, device=loss.device), metrics


def forward_backward(
    chunks: Sequence[torch.nn.Module],
    groups: ParallelGroups,
    microbatches: List[MicroBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool = False,
) -> List[dict]:
    """Run every micro-batch of one step through the model chunks.

    The loss function must return the micro-batch's share of the *step* loss (already divided by
    the step's global normalizer): Megatron is configured (``calculate_per_token_loss``) to only
    sum micro-batches and DP×CP ranks, never to average. Returns the metrics dicts that the loss
    function produced (last pipeline stage only; empty elsewhere).
    """
    if not microbatches:
        raise ValueError("forward_backward: no micro-batches")
    b, s = microbatches[0]["tokens"].shape
    for i, mb in enumerate(microbatches):
        if tuple(mb["tokens"].shape) != (b, s):
            raise ValueError(
                f"micro-batch {i}: tokens shape {tuple(mb['tokens'].shape)} != {(b, s)}; "
                "all micro-batches of a step need the same [micro_batch_size, seq_length]"
            )
    groups.layout.check_sequence(s)
    lay = groups.layout
    fb = mcore_compat.forward_backward_func(lay.pp, lay.vpp)
    n_chunks = len(chunks)
    iters = [iter(microbatches) for _ in range(n_chunks)] if n_chunks > 1 else iter(microbatches)
    return fb(
        forward_step_func=partial(_forward_step, groups, loss_fn),
        data_iterator=iters,
        model=list(chunks) if n_chunks > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=s,
        micro_batch_size=b,
        forward_only=forward_only,
    )
