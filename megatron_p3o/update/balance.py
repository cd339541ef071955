"""Token balance: samples → DP ranks, and each rank's samples → micro-batches under a token budget.

Both are the same problem, a k-way balanced number partition of sequence lengths, solved with
the Karmarkar–Karp largest-differencing method (as slime and verl do for dynamic batch sizes):
it is near-optimal on long-tailed lengths, where first-fit-decreasing leaves the last bins light.

- :func:`pack_by_budget`: the fewest micro-batches (≥ ``min_count``) whose tokens each fit the
  budget, as even as possible. A sample longer than the budget gets a micro-batch of its own
  (counted in ``oversize``) rather than an error: it still fits ``model.seq_length``, which
  bounds every sample, and dropping or refusing it would lose data mid-run.
- :func:`balance_over_dp`: moves samples between DP ranks, after advantages were computed on
  the rank that rolled them out (group baselines need whole prompt groups; the objectives only
  see per-token advantages afterwards, so single sequences may move).
"""

from __future__ import annotations

import heapq
import math
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_p3o.runtime.collectives import all_gather_objects, all_max


def karmarkar_karp(weights: Sequence[int], k: int) -> List[List[int]]:
    """Indices of ``weights`` split into ``k`` parts with near-equal sums (largest differencing).

    Every item starts as its own k-part partial solution; the two partial solutions with the
    largest spread (max − min part sum) are merged by joining the heaviest part of one with the
    lightest of the other, until one remains. Parts are returned heaviest first, each with its
    indices in increasing order. O(n·k·log n): a part's indices are joined as a tree of the two
    merged parts' (flattened once at the end), not copied at every merge.
    """
    if k < 1:
        raise ValueError(f"karmarkar_karp: k={k} must be >= 1")
    if not weights:
        return [[] for _ in range(k)]
    if k == 1:
        return [list(range(len(weights)))]
    heap = []
    empty = [(0, None)] * (k - 1)
    for i, w in enumerate(weights):
        heapq.heappush(heap, (-int(w), i, [(int(w), i)] + empty))
    tie = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [_join(a[j], b[k - 1 - j]) for j in range(k)]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    return [sorted(_leaves(node)) for _, node in heap[0][2]]


def _join(x: tuple, y: tuple) -> tuple:
    """Two parts ``(sum, indices)`` as one; indices are an int, a pair of such, or None."""
    if x[1] is None:
        return (x[0] + y[0], y[1])
    if y[1] is None:
        return (x[0] + y[0], x[1])
    return (x[0] + y[0], (x[1], y[1]))


def _leaves(node) -> List[int]:
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        if isinstance(n, tuple):
            todo += n
        elif n is not None:
            out.append(n)
    return out


def pack_by_budget(
    lengths: Sequence[int], budget: int, min_count: int = 1
) -> Tuple[List[List[int]], int]:
    """Micro-batches (lists of indices) of at most ``budget`` tokens each; returns them and the
    number of oversize samples that got a micro-batch of their own.

    The count starts at max(``min_count``, ⌈Σ/budget⌉) and grows until Karmarkar–Karp's
    partition fits the budget. A part is empty only when ``min_count`` exceeds what the samples
    need (a rank with few samples matching its DP peers' micro-batch count).
    """
    if budget < 1:
        raise ValueError(f"token budget {budget} must be >= 1")
    big = [i for i, n in enumerate(lengths) if n > budget]
    small = [i for i, n in enumerate(lengths) if n <= budget]
    w = [lengths[i] for i in small]
    k = max(min_count - len(big), math.ceil(sum(w) / budget), 1 if small else 0)
    parts: List[List[int]] = []
    while k > 0:
        parts = karmarkar_karp(w, k)
        if max(sum(w[j] for j in p) for p in parts) <= budget:
            break
        k += 1
    out = [[small[j] for j in p] for p in parts] + [[i] for i in big]
    while len(out) < min_count:  # no samples left for it: an empty (filler-only) micro-batch
        out.append([])
    return out, len(big)


def imbalance(loads: Sequence[float]) -> float:
    """max / mean − 1 of per-rank (or per-micro-batch) token loads (0 = perfectly even)."""
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean - 1.0 if mean > 0 else 0.0


def balance_over_dp(items: List, lengths: List[int], group, dp_rank: int) -> Tuple[List, dict]:
    """Exchange samples over the DP group so every rank gets ~the same number of tokens.

    ``items`` are this rank's (picklable) samples with their ``lengths``. Every rank gathers
    every rank's items, partitions all of them with :func:`karmarkar_karp` (the same, on every
    rank: deterministic) and keeps its part. Returns ``(my items, stats)`` where each item is
    ``(global index, item)`` — the global index is the item's position in the rank-major
    concatenation, stable whatever the balancing did — and stats hold the token imbalance
    before balancing (``dp_token_imbalance_before``).
    """
    if group is None or dist.get_world_size(group) == 1:
        return list(enumerate(items)), {}
    dp = dist.get_world_size(group)
    everyone = all_gather_objects((lengths, items), group, "sample ownership moves between DP "
                                  "ranks (same TP/PP/CP coordinates)")  # fmt: skip
    all_len = [n for lens, _ in everyone for n in lens]
    all_items = [x for _, its in everyone for x in its]
    before = [sum(lens) for lens, _ in everyone]
    parts = karmarkar_karp(all_len, dp)
    parts.sort(key=lambda p: p[0] if p else len(all_len))  # deterministic rank order
    mine = [(i, all_items[i]) for i in parts[dp_rank]]
    return mine, {"dp_token_imbalance_before": imbalance(before)}


def agree_on_count(n: int, group, device) -> int:
    """The largest ``n`` over the DP group (micro-batch counts, or token counts, that must match
    across ranks)."""
    if group is None or dist.get_world_size(group) == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    all_max(t, group, "per-micro-batch collectives (ESS scope microbatch, MoE token dispatch) "
            "need equal micro-batch counts on every DP rank")  # fmt: skip
    return int(t.item())
