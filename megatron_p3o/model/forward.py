"""One optimizer step's forward/backward through Megatron-Core's pipeline schedules.

Why: whatever the layout (no pipelining, 1F1B, interleaved), the trainer and the tests hand this
module a list of micro-batches and a per-micro-batch loss function; it slices each micro-batch for
context parallelism (Megatron's own ``get_batch_on_this_cp_rank``), runs the model chunks through
``get_forward_backward_func`` and returns what the loss function reported on the last stage.

Micro-batch contract: a dict with at least ``tokens`` (input ids) and ``targets`` (the next token
at each position; masked positions may hold any id), either padded ``[b, s]`` or packed
``[1, T]`` with ``cu_seqlens`` (``[n+1]``, see :mod:`~megatron_p3o.model.packed`) and
``position_ids`` restarting at every sequence; MoE models may add ``routed_experts``
(``[b, s, layers, k]``, the rollout engine's experts) and ``route_mode`` (:mod:`.routing`).
Every other top-level tensor shaped like ``tokens`` is CP-sliced the same way; anything else (per-
sequence values, the nested ``response`` tensors of the policy loss) reaches the loss function
untouched. Without pipeline parallelism the micro-batches of a step may differ in shape; with it
they share one.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .. import mcore_compat
from ..parallel import ParallelGroups
from . import packed

MicroBatch = Dict[str, Tensor]
# loss_fn(batch, logits [b, s/cp, V/tp]) -> (loss scalar, token count, metrics dict)
LossFn = Callable[[MicroBatch, Tensor], tuple]


def next_token_targets(tokens: Tensor, pad_id: int = 0) -> Tensor:
    """``[b, s]`` targets: position t predicts token t+1; the last position gets ``pad_id``."""
    targets = torch.full_like(tokens, pad_id)
    targets[:, :-1] = tokens[:, 1:]
    return targets


def slice_for_cp(
    batch: MicroBatch, groups: ParallelGroups, host_cu_seqlens: Optional[Tensor] = None
) -> MicroBatch:
    """This CP rank's tokens of every tensor shaped like ``tokens`` (padded rows: Megatron's
    2·cp chunk split of each row; packed: the same split of each sequence, see
    :mod:`~megatron_p3o.model.packed`). Adds ``cp_token_index`` (``[cp, numel/cp]``, every
    rank's positions in the flattened grid) for :func:`~megatron_p3o.model.packed.gather_tokens`.
    Other entries (per-sequence ``[n]`` values, the nested ``response`` tensors) pass through.
    ``host_cu_seqlens``: the host micro-batch's ``cu_seqlens`` (the lengths decide the split;
    without it the device copy is read back, a device→host sync)."""
    if not groups.layout.cp_enabled:
        return batch
    cp = groups.layout.cp
    shape = tuple(batch["tokens"].shape)
    cu = host_cu_seqlens
    if cu is None and batch.get("cu_seqlens") is not None:
        cu = batch["cu_seqlens"].cpu()  # host copy: lengths decide the split
    if cu is not None:
        packed.check_packed(cu, shape[1], cp)
    else:
        groups.layout.check_sequence(shape[1])
    index = packed.all_token_indices(shape, cu, cp).to(batch["tokens"].device)
    out = packed.slice_tokens(batch, index[groups.cp_rank])
    out["cp_token_index"] = index
    return out


def to_device(batch: MicroBatch, device: torch.device) -> MicroBatch:
    """Micro-batches are built on the host; every tensor moves to the training device right
    before its forward (as torchtitan does), never earlier. Nested dicts move too."""
    return {
        k: (
            v.to(device, non_blocking=True)
            if torch.is_tensor(v)
            else to_device(v, device)
            if isinstance(v, dict)
            else v
        )
        for k, v in batch.items()
    }


def _forward_step(groups: ParallelGroups, loss_fn: LossFn, data_iterator, model):
    host = next(data_iterator)
    # what the host decides (CP split, packed lengths) is read from the host micro-batch: a
    # read of its device copy would stall the stream (one micro-batch reads nothing back)
    batch = slice_for_cp(to_device(host, groups.device), groups, host.get("cu_seqlens"))
    tokens = batch["tokens"]
    params = None
    if "cu_seqlens" in host:  # packed (THD): attention and RoPE restart at every sequence
        params = packed.packed_seq_params(host["cu_seqlens"], groups.device)
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
    if "routed_experts" in batch or "route_mode" in batch:  # MoE: the engine's experts (R3)
        from .routing import set_routes

        set_routes(model, batch.get("routed_experts"), batch.get("route_mode", "off"))
    logits = model(tokens, position_ids, None, packed_seq_params=params)  # [b, s/cp, V/tp]
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
    lay = groups.layout
    if lay.pp_enabled:  # the stages exchange [s/cp, b, h] activations through fixed buffers
        for i, mb in enumerate(microbatches):
            if tuple(mb["tokens"].shape) != (b, s):
                raise ValueError(
                    f"micro-batch {i}: tokens shape {tuple(mb['tokens'].shape)} != {(b, s)}; "
                    "with pipeline parallelism all micro-batches of a step share one shape"
                )
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
