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

Fused log-probs (``model.fused_logprob``): on a last stage built with it, the output layer does
not multiply; :class:`FusedOutputLayer` hands the loss function an
:class:`~megatron_p3o.model.output_layer.OutputLayerInput` (the output layer's input, gathered
for sequence parallelism, and its weight) in place of the logits, and
:func:`~megatron_p3o.update.policy_update.response_logprobs` takes the log-probs from it chunk by
chunk.
Where that would not be exact (see :meth:`FusedOutputLayer.unsupported`) the layer runs as
Megatron's and the loss gets logits, with the reason logged once.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor

from megatron_p3o.model import packed
from megatron_p3o.model.output_layer import OutputLayerInput, output_layer_input
from megatron_p3o.runtime import mcore_compat
from megatron_p3o.runtime.parallel import ParallelGroups

MicroBatch = Dict[str, Tensor]
# loss_fn(batch, logits [b, s/cp, V/tp] or OutputLayerInput) -> (loss, token count, metrics)
LossFn = Callable[[MicroBatch, Union[Tensor, OutputLayerInput]], tuple]
RESPONSE_KEYS = ("behavior_logprobs", "advantages", "old_logprobs", "ref_logprobs")


def nest_response(mb: MicroBatch) -> MicroBatch:
    """A flat padded micro-batch (``loss_mask``, ``behavior_logprobs``, ``advantages`` … as
    ``[b, s]`` tensors aligned with ``targets``) in the nested form, in place; the response
    tensors then span every position of each row."""
    if "response" in mb:
        return mb
    b, s = mb["tokens"].shape
    resp = {"mask": mb.pop("loss_mask").float(), "index": torch.arange(b * s).reshape(b, s)}  # host
    for k in RESPONSE_KEYS + ("sample_index",):
        if k in mb:
            resp[k] = mb.pop(k)
    mb["response"] = resp
    return mb


_log = logging.getLogger(__name__)


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


class FusedOutputLayer:
    """The last stage's output layer on the fused log-prob path.

    Installed by :func:`~megatron_p3o.model.builder.build_model` (``fused_logprob``); active only
    inside :func:`forward_backward`'s forward step (:meth:`armed`), so any other call of the model
    returns logits as before. When active the layer returns its input, mapped as
    ``ColumnParallelLinear`` maps it (with sequence parallelism all-gathered over TP, the gradient
    reduce-scattered back; without, the gradient all-reduced over TP), and keeps the weight it
    would have used (the embedding weight when tied); :meth:`take` pairs the model's output with
    it. Forward hooks on the layer that know this path (``p3o_fused_aware``: R2PO's residual head)
    add logit terms with :meth:`add_term`; any other hook makes the call unfused.
    """

    _logged: set = set()  # reasons already logged (once per process)

    def __init__(self, model: torch.nn.Module, groups: ParallelGroups):
        self.layer = model.output_layer
        self.tp = groups.tp if groups.layout.tp_enabled else None
        self.active = False
        self.weight: Optional[Tensor] = None  # set when the current call took the fused path
        self.extra: List[tuple] = []
        self.layer.p3o_fused = self
        mcore_compat.override_output_layer(self.layer, self._forward)

    def unsupported(self, runtime_gather_output=None) -> Optional[str]:
        """Why this call must run unfused (None: the fused path is exact)."""
        reason = mcore_compat.output_layer_unsupported(self.layer, runtime_gather_output)
        if reason is None:
            hooks = [h for h in self.layer._forward_hooks.values()]
            if any(not getattr(h, "p3o_fused_aware", False) for h in hooks):
                reason = "a forward hook on output_layer may read or change its logits"
        return reason

    def _forward(self, original, input_, weight=None, runtime_gather_output=None):
        self.weight, self.extra = None, []
        if not self.active:
            return original(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        reason = self.unsupported(runtime_gather_output)
        if reason is not None:
            if reason not in FusedOutputLayer._logged:
                FusedOutputLayer._logged.add(reason)
                _log.warning("model.fused_logprob: unfused output layer (%s)", reason)
            return original(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        self.weight = self.layer.weight if weight is None else weight
        hidden = output_layer_input(input_, self.tp, self.layer.sequence_parallel)
        return hidden, None

    def add_term(self, x: Tensor, weight: Tensor) -> None:
        """A term ``x·weightᵀ`` of the logits, ``x [s, b, d]`` in the layer's input layout, its
        gradient already summed over TP (a forward hook's share of z)."""
        self.extra.append((x, weight))

    @contextmanager
    def armed(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def take(self, output):
        """The model's output as the loss sees it: an ``OutputLayerInput`` when this call was
        fused (``output`` is then the hidden states ``[b, s, d]``), else ``output`` (logits)."""
        if self.weight is None:
            return output
        extra = tuple((mcore_compat.as_model_output(x), w) for x, w in self.extra)
        inp = OutputLayerInput(output, self.weight, extra)
        self.weight, self.extra = None, []
        return inp


def _fused_output(model) -> Optional[FusedOutputLayer]:
    return getattr(mcore_compat.unwrap(model), "fused_output", None)


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
        from megatron_p3o.model.routing import set_routes

        lay = groups.layout
        shard = (groups.tp_rank, lay.tp) if lay.sequence_parallel else None
        set_routes(model, batch.get("routed_experts"), batch.get("route_mode", "off"), shard)
    fused = _fused_output(model)
    with fused.armed() if fused is not None else nullcontext():
        out = model(tokens, position_ids, None, packed_seq_params=params)  # [b, s/cp, V/tp]
    if fused is not None:  # the last stage: hidden states + weight on the fused path
        out = fused.take(out)
    return (out.hidden if isinstance(out, OutputLayerInput) else out), partial(
        _call_loss, loss_fn, batch, out
    )


def _call_loss(loss_fn: LossFn, batch: MicroBatch, out, _schedule_output=None):
    """``out``: the logits or the fused path's ``OutputLayerInput`` (the schedule hands back the
    tensor that :func:`_forward_step` returned; the loss reads ``out``)."""
    loss, num_tokens, metrics = loss_fn(batch, out)
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
