"""Ratios on a band's bound, made the same on every CPU (issue 51).

The edge inputs put ``v = exp(d)`` exactly on a bound of the masking band on the host that
recorded the peers; ``exp`` is only faithfully rounded, and another CPU returns a neighbour
(``0.7999999999999999`` for ``0.8`` on an Intel AVX-512 host). No float64 input puts ``exp(d)``
on a bound for every CPU, so each edge has two outcomes — kept (``v`` on the bound) or dropped
(``v`` one ulp outside) — and the fixture holds the peers' outputs for every combination.

``ExpAtEdges`` is a torch function mode under which ``exp`` puts each listed edge where it is
told: a float64 result within ``ULPS`` ulps of an edge's bound becomes the bound itself (kept)
or its outward neighbour (dropped). The recorder runs the peers' own code under it, the tests
run the project's objectives under it, so both sides see the same ratio on every CPU. Results
that carry a gradient are left alone (the band ratio ``πold/πb`` never does).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.overrides import TorchFunctionMode

ULPS = 4
_EXP = {torch.exp, torch.Tensor.exp, torch.Tensor.exp_}


def band_edges(
    token_edges: list, seq_edges: list, level: str, low: float, high: float
) -> list[dict]:
    """The designed edges (inputs.TOKEN_EDGES / SEQ_EDGES) that sit on this band's bounds, at
    the band's level ("token" for IcePop, "seq" for seq-mask-TIS's geometric mean)."""
    out = []
    if level == "token":
        for bound, _, i, t in token_edges:
            if bound in (low, high):
                out.append({"level": "token", "index": [i, t], "bound": bound})
    else:
        for bound, _, i in seq_edges:
            if bound in (low, high):
                out.append({"level": "seq", "index": [i], "bound": bound})
    for e in out:
        e["side"] = "low" if e["bound"] == low else "high"
    return out


def edge_ratio(x: dict[str, torch.Tensor], edge: dict) -> float:
    """The edge's ratio as this CPU's ``exp`` gives it, computed over the whole ``[B, T]`` (or
    ``[B]``) tensor as the objectives compute it (a vectorised ``exp`` may take another path for
    a lone element): the token's ``exp(ℓold − ℓb)``, or the row's geometric mean as NeMo-RL
    forms it, ``exp(Σ_t d_t / (n + 1e-8))``."""
    m = x["mask"]
    d = torch.where(m > 0, x["old_logprobs"] - x["behavior_logprobs"], torch.zeros_like(m))
    if edge["level"] == "token":
        i, t = edge["index"]
        return float(torch.exp(d)[i, t])
    (i,) = edge["index"]
    return float(torch.exp((d * m).sum(-1) / (m.sum(-1) + 1e-8))[i])


def kept_here(x: dict[str, torch.Tensor], edges: list[dict], low: float, high: float) -> tuple:
    """Which edges this CPU keeps (the peers' rule, ``low ≤ v ≤ high``, on the local ratio)."""
    return tuple(low <= edge_ratio(x, e) <= high for e in edges)


def outward(bound: float, side: str) -> float:
    """The float64 one ulp outside the band at ``bound``."""
    return math.nextafter(bound, -math.inf if side == "low" else math.inf)


def kept_states(n: int) -> list[tuple[bool, ...]]:
    """Every combination of kept (True) / dropped (False) for ``n`` edges, all kept first."""
    return list(itertools.product((True, False), repeat=n))


class ExpAtEdges(TorchFunctionMode):
    """``exp`` that lands each edge on its bound (``kept``) or one ulp outside (dropped).

    edges: ``[{"bound": b, "side": "low" | "high", ...}]``; kept: one bool per edge."""

    def __init__(self, edges: list[dict], kept: tuple[bool, ...]):
        super().__init__()
        assert len(edges) == len(kept)
        assert len({e["bound"] for e in edges}) == len(edges), "one edge per bound"
        self.targets = [
            (e["bound"], e["bound"] if k else outward(e["bound"], e["side"]))
            for e, k in zip(edges, kept)
        ]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in _EXP or not isinstance(out, torch.Tensor):
            return out
        if out.dtype != torch.float64 or out.requires_grad:
            return out
        snapped = out
        for bound, target in self.targets:
            ulp = math.ulp(bound)
            near = (out - bound).abs() <= ULPS * ulp
            snapped = torch.where(near, torch.full_like(out, target), snapped)
        if func is torch.Tensor.exp_:
            return out.copy_(snapped)
        return snapped
