"""The embedded engine's multi-turn server: every trajectory keeps its KV cache between its
turns, and one forward per tick serves every trajectory at once, each feeding what it has not
fed yet (its prompt, the tokens appended since its last turn, or its newest sampled token).

Why: the lock-step loop re-prefilled each trajectory's whole history at every turn (a 3-turn
rollout cost 2.09× a single-turn one at the same policy tokens, ``benchmarks/bench_multiturn.py``).
Here a turn prefills only the appended tokens, and trajectories in different turns share the
same forward.

How: the transformers model runs unchanged but for two things of ours, as serving engines do
(SGLang's radix cache, vLLM's paged blocks): a cache (:class:`SlotCache`) that writes each new
token's K/V at its trajectory's slot and position in a preallocated ``[slots, kv_heads, L, d]``
buffer per layer, and an attention function (``"p3o_slots"``, registered with transformers'
``AttentionInterface``) that runs one SDPA over every slot with a causal mask per slot. The
linear layers see only the real tokens of the tick, packed in one row.

Logical time, so a run is reproducible: a tick runs when every admitted trajectory has asked for
its next turn (its environment step came back) or left — the engine never runs ahead of a
pending tool result, which makes each tick's batch a function of the trajectories alone, not of
how long their tools took. Each turn samples from a generator of its own (seeded per trajectory
turn), so no trajectory's draws depend on another's. A slow tool therefore stalls this engine's
ticks (SGLang, which batches by wall clock, does not wait: ``docs/multiturn.md``).

Weights pushed while trajectories are out: at the next tick every trajectory's cache is dropped
and recomputed under the new weights (SGLang flushes its cache the same way); tokens keep the
version that sampled them.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from megatron_p3o.rollout.sampling import sampling_logprobs
from megatron_p3o.rollout.turn_server import TurnServer
from megatron_p3o.types import Sample, SamplingParams

ATTENTION = "p3o_slots"


def _slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    **kwargs):  # fmt: skip
    """``query [1, H, T, d]`` of the tick's packed tokens; ``key``/``value`` the layer's slot
    buffers ``[S, H_kv, L, d]`` (already holding this tick's tokens). Returns ``[1, T, H, d]``."""
    meta: TickMeta = kwargs["p3o_slots"]
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("the embedded multi-turn server has no sliding-window attention")
    s, h, d = key.shape[0], query.shape[1], query.shape[-1]
    q = query.new_zeros(s, meta.q_max, h, d)
    q[meta.slot, meta.qpos] = query[0].transpose(0, 1)  # [T, H, d] into its slot's rows
    n = meta.mask.shape[-1]  # positions written so far, over every slot
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), key[:, :, :n], value[:, :, :n], attn_mask=meta.mask, scale=scaling,
        enable_gqa=key.shape[1] != h,
    )  # fmt: skip
    return out.transpose(1, 2)[meta.slot, meta.qpos][None], None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _slot_attention)


@dataclass
class TickMeta:
    """Where each packed token goes: ``slot [T]``, ``pos [T]`` (its position in its sequence),
    ``qpos [T]`` (its place in its slot's chunk); ``mask [S, 1, q_max, n]`` over the first n
    positions (the longest sequence so far)."""

    slot: torch.Tensor
    pos: torch.Tensor
    qpos: torch.Tensor
    q_max: int
    mask: torch.Tensor
    rows: torch.Tensor  # [kv_heads·T]: each (head, token)'s row in a flattened cache buffer


class SlotCache:
    """K/V buffers ``[slots, kv_heads, L, d]`` per layer; ``update`` writes the tick's tokens at
    their slots and positions and hands attention the whole buffer."""

    def __init__(self, layers: int, slots: int, heads: int, length: int, dim: int, dtype, dev):
        self.k = [torch.zeros(slots, heads, length, dim, dtype=dtype, device=dev)
                  for _ in range(layers)]  # fmt: skip
        self.v = [torch.zeros_like(x) for x in self.k]

    def update(self, key, value, layer_idx, kwargs=None):
        meta: TickMeta = kwargs["p3o_slots"]
        k, v = self.k[layer_idx], self.v[layer_idx]
        d = k.shape[-1]
        k.view(-1, d).index_copy_(0, meta.rows, key[0].reshape(-1, d).to(k.dtype))
        v.view(-1, d).index_copy_(0, meta.rows, value[0].reshape(-1, d).to(v.dtype))
        return k, v

    def flat_rows(self, slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``[kv_heads·T]`` rows of ``(slot, head, pos)`` in a ``[S·H·L, d]`` view, heads
        outer (the order of ``key[0].reshape(-1, d)``)."""
        _, h, length, _ = self.k[0].shape
        heads = torch.arange(h, device=slot.device)
        return ((slot[None, :] * h + heads[:, None]) * length + pos[None, :]).reshape(-1)


@dataclass
class _Row:
    k: int
    slot: int
    seq: List[int] = field(default_factory=list)  # tokens whose K/V is in the cache
    routes: list = field(default_factory=list)  # MoE: per fed token [layers, top-k]
    ids: Optional[List[int]] = None  # the current request's input
    sampling: Optional[SamplingParams] = None
    gen: Optional[torch.Generator] = None
    u: List[float] = field(default_factory=list)  # the turn's uniforms, drawn at its start
    out: List[int] = field(default_factory=list)
    lps: List[float] = field(default_factory=list)
    vers: List[int] = field(default_factory=list)
    fut: Optional[asyncio.Future] = None


class SlotTurnServer(TurnServer):
    """``slots`` trajectories at once in ``engine`` (an
    :class:`~megatron_p3o.rollout.embedded.EmbeddedEngine`), sequences up to ``max_len``."""

    def __init__(self, engine, slots: int, max_len: int):
        _register()
        self.e, self.max_len = engine, max_len
        c = engine.model.config
        heads = c.num_attention_heads
        dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        self.cache = SlotCache(c.num_hidden_layers, slots, c.num_key_value_heads, max_len, dim,
                               engine.dtype, engine.device)  # fmt: skip
        self.context_length = max_len
        self.free = list(range(slots))
        self.rows: Dict[int, _Row] = {}
        self.waiting: Dict[int, asyncio.Future] = {}
        self.version = engine.weight_version
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self.ticks = 0

    @property
    def weight_version(self) -> int:
        return int(self.e.weight_version)

    # -- the loop's side ----------------------------------------------------------------------
    def _kick(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._ticker())
        self._wake.set()

    async def admit(self, k: int) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiting[k] = fut
        self._admit()
        self._kick()
        await fut

    async def generate(self, k, ids, sampling, key=None) -> Sample:
        row = self.rows[k]
        row.ids, row.sampling = list(ids), sampling
        n = 0
        for a, b in zip(row.seq, row.ids):  # the cached prefix (a request that rewrote it
            if a != b:  # recomputes from where they differ)
                break
            n += 1
        del row.seq[n:], row.routes[n:]
        row.out, row.lps, row.vers = [], [], []
        row.gen = None
        if sampling.seed is not None:
            row.gen = torch.Generator(device=self.e.device).manual_seed(sampling.seed)
        row.u = torch.rand(
            sampling.max_new_tokens, generator=row.gen, dtype=torch.float64, device=self.e.device
        ).tolist()  # one per token of the turn
        row.fut = asyncio.get_running_loop().create_future()
        self._kick()
        return await row.fut

    def release(self, k: int) -> None:
        row = self.rows.pop(k, None)
        if row is not None:
            self.free.append(row.slot)
            self._admit()
        self._kick()

    def _admit(self) -> None:
        """The lowest-indexed waiting trajectories take the free slots."""
        for k in sorted(self.waiting):
            if not self.free:
                break
            self.rows[k] = _Row(k, self.free.pop())
            fut = self.waiting.pop(k)
            if not fut.done():
                fut.set_result(None)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _ticker(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            rows = [self.rows[k] for k in sorted(self.rows)]
            if not rows or any(r.fut is None for r in rows):
                continue  # logical time: wait for every admitted trajectory's next turn
            try:
                self._tick(rows)
            except BaseException as e:  # noqa: BLE001 - each waiting turn gets the failure
                for r in rows:
                    if r.fut is not None and not r.fut.done():
                        r.fut.set_exception(e)
                    r.fut = None
                raise
            self._wake.set()
            await asyncio.sleep(0)  # the finished turns' coroutines run before the next tick

    # -- one tick -----------------------------------------------------------------------------
    @contextmanager
    def _attention(self):
        cfg = self.e.model.config
        old, cfg._attn_implementation = cfg._attn_implementation, ATTENTION
        try:
            yield
        finally:
            cfg._attn_implementation = old

    def _tick(self, rows: List[_Row]) -> None:
        e = self.e
        if e.weight_version != self.version:  # a push landed: recompute every cache
            self.version = e.weight_version
            for r in rows:
                r.seq, r.routes = [], []
        feeds, lead = [], {}
        for r in rows:  # what each has not fed: its request's rest, or its newest token
            n = len(r.seq)
            feeds.append(r.ids[n:] + r.out if n < len(r.ids) else r.out[n - len(r.ids) :])
        # trajectories that start from one prompt (a group's n samples) share its prefill, as
        # a prefix cache does: one of them is fed, the others get its K/V and its logits
        first: Dict[tuple, int] = {}
        for k, (r, f) in enumerate(zip(rows, feeds)):
            if not r.seq:
                lead[k] = first.setdefault(tuple(f), k)
        fed = [k for k in range(len(rows)) if lead.get(k, k) == k]
        logits = self._forward([rows[k] for k in fed], [feeds[k] for k in fed])
        at = {k: i for i, k in enumerate(fed)}
        for k, src in lead.items():
            if src != k:
                self._copy(rows[src], rows[k])
        self.ticks += 1
        self._sample(rows, logits[[at[lead.get(k, k)] for k in range(len(rows))]])

    def _copy(self, src: _Row, dst: _Row) -> None:
        """``dst`` takes ``src``'s cached K/V (positions it fed) and routes."""
        n = len(src.seq)
        for kv in (self.cache.k, self.cache.v):
            for layer in kv:
                layer[dst.slot, :, :n] = layer[src.slot, :, :n]
        dst.seq, dst.routes = list(src.seq), list(src.routes)

    def _forward(self, rows: List[_Row], feeds: List[List[int]]) -> torch.Tensor:
        """One forward of every row's feed, packed; the logits at each row's last fed token
        ``[len(rows), V]``; the rows' caches, sequences and routes advanced."""
        e, dev = self.e, self.e.device
        lens = [len(f) for f in feeds]
        slot = torch.tensor([r.slot for r, n in zip(rows, lens) for _ in range(n)], device=dev)
        pos = torch.tensor([len(r.seq) + i for r, n in zip(rows, lens) for i in range(n)],
                           device=dev)  # fmt: skip
        qpos = torch.tensor([i for n in lens for i in range(n)], device=dev)
        q_max = max(lens)
        start = torch.zeros(len(self.cache.k[0]), dtype=torch.long, device=dev)
        qlen = torch.zeros_like(start)
        start[[r.slot for r in rows]] = torch.tensor([len(r.seq) for r in rows], device=dev)
        qlen[[r.slot for r in rows]] = torch.tensor(lens, device=dev)
        i = torch.arange(q_max, device=dev)
        j = torch.arange(max(len(r.seq) + n for r, n in zip(rows, lens)), device=dev)
        live = i[None, :] < qlen[:, None]  # [S, q]
        mask = (j[None, None, :] <= (start[:, None] + i[None, :])[..., None]) & live[..., None]
        mask[..., 0] |= ~live  # empty query rows attend somewhere (their output is dropped)
        bias = torch.zeros(mask.shape, dtype=e.dtype, device=dev).masked_fill_(~mask, -torch.inf)
        meta = TickMeta(slot, pos, qpos, q_max, bias[:, None], self.cache.flat_rows(slot, pos))
        ids = torch.tensor([t for f in feeds for t in f], device=dev)[None]
        last = torch.tensor(lens, device=dev).cumsum(0) - 1
        with torch.inference_mode(), self._attention():
            out = e.model(input_ids=ids, position_ids=pos[None], cache=self.cache, use_cache=True,
                          logits_to_keep=last, p3o_slots=meta)  # fmt: skip
        routes = e._call_routes(1)  # [1, T, layers, k] of the fed tokens (MoE)
        at = 0
        for r, f in zip(rows, feeds):
            r.seq += f
            if routes is not None:
                r.routes += list(routes[0, at : at + len(f)])
            at += len(f)
        return out.logits[0]

    def _sample(self, rows: List[_Row], logits: torch.Tensor) -> None:
        """One token per row, each drawn from its own stream: the turn's next uniform u (drawn
        when the turn began), then the token whose cumulative probability interval holds it
        (inverse CDF, batched); its log-prob is under the distribution it was drawn from."""
        e, dev = self.e, self.e.device
        z = logits.float()
        if e.logit_noise > 0:  # the engine's own distribution is the perturbed one
            eps = torch.stack([torch.randn(z.shape[1:], generator=r.gen, device=dev)
                               for r in rows])  # fmt: skip
            z = z + e.logit_noise * eps
        u = torch.tensor([r.u[len(r.out)] for r in rows], dtype=torch.float32, device=dev)
        toks = torch.empty(len(rows), dtype=torch.long, device=dev)
        lps = torch.empty(len(rows), dtype=torch.float32, device=dev)
        by: Dict[tuple, List[int]] = {}
        for i, r in enumerate(rows):
            sp = r.sampling
            by.setdefault((sp.temperature, sp.top_k, sp.top_p), []).append(i)
        for idx in by.values():
            sel = torch.tensor(idx, device=dev)
            logp = sampling_logprobs(z[sel], rows[idx[0]].sampling)
            cdf = logp.exp().cumsum(-1)
            pick = torch.searchsorted(cdf, (u[sel] * cdf[:, -1])[:, None], right=True)[:, 0]
            pick = pick.clamp_max(cdf.shape[-1] - 1)
            toks[sel] = pick
            lps[sel] = logp.gather(-1, pick[:, None])[:, 0]
        version = int(e.weight_version)
        for r, tok, lp in zip(rows, toks.tolist(), lps.tolist()):
            r.out.append(tok)
            r.lps.append(lp)
            r.vers.append(version)
            sp = r.sampling
            if tok in sp.stop_token_ids or len(r.out) >= sp.max_new_tokens:
                self._finish(r, "stop" if tok in sp.stop_token_ids else "length")

    def _finish(self, r: _Row, reason: str) -> None:
        n = len(r.ids) + len(r.out) - 1  # every token but the newest went through the model
        routes = torch.stack(r.routes[:n]) if r.routes and len(r.routes) >= n else None
        s = Sample(
            prompt_ids=list(r.ids),
            completion_ids=list(r.out),
            logprobs=list(r.lps),
            finish_reason=reason,
            weight_version=r.vers[0],
            routed_experts=routes,
            token_versions=list(r.vers) if len(set(r.vers)) > 1 else None,
        )
        fut, r.fut = r.fut, None
        if not fut.done():
            fut.set_result(s)
