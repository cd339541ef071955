"""Rollout routing replay (R3) for mixture-of-experts layers.

Why: an MoE router is a discontinuous top-k; the rollout engine (another precision, another
kernel) and the trainer pick different experts for a fraction of tokens, which is the largest
train–inference mismatch of MoE RL. R3 makes the trainer's forward use the experts the engine
chose, while the router's probabilities of those experts stay differentiable.

Each Megatron router calls ``router_replay.get_replay_topk(scores, k, …, default)`` (Megatron's
own replay hook, ``moe/router_replay.py``); :func:`attach` puts a :class:`LayerRoutes` there.
Per micro-batch, :func:`set_routes` hands every layer of a model chunk the recorded expert
indices of its tokens (``routed_experts [b, s, layers, k]`` in the token grid, -1 where nothing
was recorded: the last token of a sequence, padding) and a mode:

* ``"r3"``: top-k = the recorded experts where recorded, the trainer's own elsewhere; the
  probabilities are the router's scores gathered at those experts (softmax over the selected
  logits, or the softmax probabilities when ``pre_softmax``), so the gradient reaches the router
  through the recorded experts;
* ``"off"``: the trainer's own top-k (the recorded routes only feed the agreement metric).

Both modes count, per layer, how many of the engine's k experts the trainer's own top-k also
picked (route agreement).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import Tensor

from megatron_p3o.runtime import mcore_compat
from megatron_p3o.runtime.collectives import all_sum


class LayerRoutes:
    """The replay hook of one MoE layer's router (global layer ``layer``, 0-based)."""

    def __init__(self, layer: int):
        self.layer = layer
        self.target: Optional[Tensor] = None  # [tokens, k] long, -1 = not recorded
        self.mode = "off"
        # Σ overlap / k and recorded tokens, kept where the router runs (no host sync per layer)
        self.agree: Optional[Tensor] = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default=None):
        probs, own = default(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return probs, own
        t = self.target.to(scores.device)
        if t.shape != own.shape:
            raise ValueError(
                f"routing replay, layer {self.layer}: {tuple(t.shape)} recorded routes for "
                f"{tuple(own.shape)} routed tokens"
            )
        known = (t >= 0).all(-1)
        with torch.no_grad():
            same = (t[:, :, None] == own[:, None, :]).any(-1).sum(-1).double() / topk
            stat = torch.stack([same[known].sum(), known.sum().double()])
            self.agree = stat if self.agree is None else self.agree + stat
        if self.mode != "r3":
            return probs, own
        idx = torch.where(known[:, None], t, own)
        return scores.gather(1, idx), idx


def _routers(model) -> List:
    model = mcore_compat.unwrap(model)
    out = []
    for layer in getattr(model.decoder, "layers", []):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            out.append((layer.layer_number - 1, router))
    return out


def attach(chunks) -> List[LayerRoutes]:
    """A :class:`LayerRoutes` on every MoE router of ``chunks`` (this stage's layers)."""
    hooks = []
    for chunk in chunks:
        for layer, router in _routers(chunk):
            router.router_replay = LayerRoutes(layer)
            hooks.append(router.router_replay)
    return hooks


def set_routes(
    model, routed: Optional[Tensor], mode: str, sp_shard: Optional[tuple] = None
) -> None:
    """Give every MoE layer of ``model`` its tokens' recorded experts for the next forward.

    ``routed``: ``[b, s, layers, k]`` (this rank's tokens, CP-sliced like ``tokens``) or None.
    Megatron routes ``[s, b]``-major tokens, hence the transpose. ``sp_shard``: (tp rank, tp
    size) under sequence parallelism, where each TP rank's router sees only its slice of the
    sequence dimension (Megatron scatters ``[s, b, h]`` along ``s`` before the first layer)."""
    for layer, router in _routers(model):
        hook = router.router_replay
        if not isinstance(hook, LayerRoutes):
            continue
        hook.mode = mode
        if routed is None:
            hook.target = None
            continue
        r = routed[:, :, layer].transpose(0, 1)  # [s, b, k]
        if sp_shard is not None:
            rank, size = sp_shard
            n = r.shape[0] // size
            r = r[rank * n : (rank + 1) * n]
        hook.target = r.reshape(-1, r.shape[-1]).long()


def agreement(hooks: List[LayerRoutes], num_layers: int, device, group) -> Dict[str, float]:
    """Route agreement per layer and overall, summed over ``group`` (all ranks: each stage
    counted its layers; TP replicas count alike in numerator and denominator); resets."""
    import torch.distributed as dist

    t = torch.zeros(num_layers, 2, dtype=torch.float64)
    for h in hooks:
        if h.agree is None:  # nothing recorded to compare with (an engine without routes)
            continue
        t[h.layer] += h.agree.cpu()
        h.agree.zero_()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dev = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else "cpu"
        )
        t = t.to(dev)
        all_sum(t, group, "routing agreement: every stage's layers and every rank's tokens")
        t = t.cpu()
    out = {}
    if t[:, 1].sum() > 0:
        out["route_agreement"] = float(t[:, 0].sum() / t[:, 1].sum())
        for i in range(num_layers):
            if t[i, 1] > 0:
                out[f"route_agreement_l{i}"] = float(t[i, 0] / t[i, 1])
    return out
