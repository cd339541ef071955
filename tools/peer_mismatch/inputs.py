"""The fixed float64 inputs every peer case is computed on (see tools/record_peer_mismatch.py)."""

import math

import torch

SEED = 20251001
B, T = 4, 7
LENGTHS = [7, 4, 1, 6]  # ragged; sequence 2 has a single token
DTYPE = torch.float64


# --------------------------------------------------------------------------------------------
# Fixed inputs
# --------------------------------------------------------------------------------------------


def make_inputs() -> dict[str, torch.Tensor]:
    """B=4 sequences, T=7 tokens, float64; see the fixture's "inputs_design" for the intent."""
    g = torch.Generator().manual_seed(SEED)
    lengths = torch.tensor(LENGTHS)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(DTYPE)

    # log(pi_old / pi_b) per token: designed per sequence, with generator noise on top.
    log_is = torch.full((B, T), 2.5, dtype=DTYPE)  # padding: would be out of every band
    noise = torch.randn(B, T, generator=g, dtype=DTYPE)
    s0 = 5e-4 * noise[0]
    log_is[0] = s0 - s0.mean() + 3e-4  # geo-mean exp(3e-4): inside [0.999, 1.002]
    base1 = torch.tensor([0.05, -0.6, -1.2, 0.1], dtype=DTYPE)
    log_is[1, :4] = base1 + 0.02 * noise[1, :4]  # one token at ratio ~0.30, one at ~0.55
    log_is[2, :1] = 2.0  # single token, ratio e^2 ~ 7.39
    base3 = torch.tensor([0.1, -0.25, 1.7, -0.4, -0.3, 0.05], dtype=DTYPE)
    log_is[3, :6] = base3 + 0.02 * noise[3, :6]  # one token at ratio ~5.5, geo-mean ~1.16

    old = torch.log(0.05 + 0.9 * torch.rand(B, T, generator=g, dtype=DTYPE))
    old = torch.minimum(old, log_is - 0.05)  # keeps the behaviour log-probs <= -0.05
    behavior = old - log_is
    logprobs = (old + 0.2 * torch.randn(B, T, generator=g, dtype=DTYPE)).clamp(max=-0.01)
    advantages = torch.randn(B, T, generator=g, dtype=DTYPE)
    return {
        "logprobs": logprobs,
        "old_logprobs": old,
        "behavior_logprobs": behavior,
        "advantages": advantages,
        "mask": mask,
    }


def check_design(x: dict[str, torch.Tensor]) -> None:
    """Fail loudly if the inputs stop exercising the bands they are meant to exercise."""
    m = x["mask"].bool()
    r = torch.exp(x["old_logprobs"] - x["behavior_logprobs"])
    out_icepop = (m & ((r < 0.5) | (r > 5.0))).sum().item()
    assert 2 <= out_icepop < m.sum().item() - 2, out_icepop
    lr = (x["old_logprobs"] - x["behavior_logprobs"]) * x["mask"]
    geo = torch.exp(lr.sum(-1) / x["mask"].sum(-1))
    tight = ((geo >= 0.999) & (geo <= 1.002)).tolist()
    wide = ((geo >= 0.8) & (geo <= 1.25)).tolist()
    assert tight == [True, False, False, False], geo
    assert wide == [True, False, False, True], geo
    pr = torch.exp(x["logprobs"] - x["old_logprobs"])[m]
    assert ((pr < 0.8) | (pr > 1.2)).any() and ((pr > 0.8) & (pr < 1.2)).any()
    assert (x["advantages"][m] < 0).any() and (x["advantages"][m] > 0).any()


def as_lists(x: dict[str, torch.Tensor], lengths: list[int] | None = None) -> dict:
    out = {k: v.tolist() for k, v in x.items()}
    out["lengths"] = list(LENGTHS if lengths is None else lengths)
    return out


def scalar(v) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


# --------------------------------------------------------------------------------------------
# Edge inputs (issue 45): ratios that round exactly onto a bound; M2PO's micro-batches, a kept
# token with ρ > 5 and a tie at the cut
# --------------------------------------------------------------------------------------------

EDGE_LENGTHS = [7, 2, 2, 6]
# bound -> which side the log-space test (log v vs log bound) gets wrong: "above" = a token
# (or sequence) with exp(d) == bound exactly but d > log(bound) (masked by the log test)
TOKEN_EDGES = [(2.0, "above", 0, 2), (0.8, "below", 0, 5), (1.25, "above", 3, 1)]
SEQ_EDGES = [(1.002, "above", 1), (0.8, "below", 2)]


def _nudge(t: torch.Tensor, k: int) -> torch.Tensor:
    step = torch.tensor(math.inf if k > 0 else -math.inf, dtype=t.dtype)
    for _ in range(abs(k)):
        t = torch.nextafter(t, step)
    return t


def _token_on_bound(old: float, bound: float, side: str) -> float:
    """ℓb with exp(old − ℓb) == bound exactly (torch float64) while old − ℓb lies on the wrong
    side of log(bound)."""
    L = math.log(bound)
    base = torch.tensor(old - L, dtype=DTYPE)
    o = torch.tensor(old, dtype=DTYPE)
    for k in sorted(range(-64, 65), key=abs):
        b = _nudge(base, k)
        d = o - b
        if float(torch.exp(d)) == bound and (float(d) > L if side == "above" else float(d) < L):
            return float(b)
    raise RuntimeError(f"no ℓb puts exp(d) exactly on {bound} from old={old}")


def _nemo_geomean(d: torch.Tensor) -> torch.Tensor:
    # NeMo-RL's masked_mean(log_is_ratio, token_mask, dim=-1) of one whole row
    return torch.exp(d.sum() / (torch.tensor(float(d.numel()), dtype=DTYPE) + 1e-8))


def _seq_on_bound(old: torch.Tensor, beh: torch.Tensor, bound: float, side: str) -> torch.Tensor:
    """beh with its last token moved until the 2-token row's geometric mean (as NeMo-RL forms
    it) is exactly ``bound`` while the plain mean of d lies on the wrong side of log(bound)."""
    L = math.log(bound)
    n = old.numel()
    target_sum = L * (n + 1e-8)
    base = torch.tensor(float(old[-1]) - (target_sum - float((old - beh)[:-1].sum())), dtype=DTYPE)
    for k in sorted(range(-400, 401), key=abs):
        b = beh.clone()
        b[-1] = _nudge(base, k)
        d = old - b
        plain = float(d.sum() / n)
        if float(_nemo_geomean(d)) == bound and (plain > L if side == "above" else plain < L):
            return b
    raise RuntimeError(f"no row puts the geometric mean exactly on {bound}")


def make_edge_inputs() -> dict[str, torch.Tensor]:
    """B=4, T=7 (lengths 7, 2, 2, 6), float64: tokens whose v = exp(ℓold − ℓb) is exactly 2.0,
    0.8 and 1.25 (TOKEN_EDGES) and 2-token rows whose NeMo-RL geometric mean is exactly 1.002
    and 0.8 (SEQ_EDGES), each where the log-space comparison would decide the other way."""
    g = torch.Generator().manual_seed(SEED + 45)
    lengths = torch.tensor(EDGE_LENGTHS)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(DTYPE)
    old = torch.log(0.05 + 0.9 * torch.rand(B, T, generator=g, dtype=DTYPE)) - 0.05
    log_is = 0.05 * torch.randn(B, T, generator=g, dtype=DTYPE)
    log_is[3, :6] += torch.tensor([0.3, 0.0, -0.5, 0.1, -0.2, 0.0], dtype=DTYPE)
    log_is[1, :2] = torch.tensor([0.0015, 0.0025], dtype=DTYPE)
    log_is[2, :2] = torch.tensor([-0.2, -0.25], dtype=DTYPE)
    behavior = old - log_is
    for bound, side, i, t in TOKEN_EDGES:
        behavior[i, t] = _token_on_bound(float(old[i, t]), bound, side)
    for bound, side, i in SEQ_EDGES:
        behavior[i, :2] = _seq_on_bound(old[i, :2], behavior[i, :2], bound, side)
    behavior = torch.where(mask > 0, behavior, old - 2.5)  # padding: out of every band
    logprobs = (old + 0.2 * torch.randn(B, T, generator=g, dtype=DTYPE)).clamp(max=-0.01)
    advantages = torch.randn(B, T, generator=g, dtype=DTYPE)
    return {
        "logprobs": logprobs,
        "old_logprobs": old,
        "behavior_logprobs": behavior,
        "advantages": advantages,
        "mask": mask,
    }


def check_edge_design(x: dict[str, torch.Tensor]) -> None:
    d = x["old_logprobs"] - x["behavior_logprobs"]
    for bound, side, i, t in TOKEN_EDGES:
        assert float(torch.exp(d[i, t])) == bound, (bound, d[i, t])
        L = math.log(bound)
        assert float(d[i, t]) > L if side == "above" else float(d[i, t]) < L
    for bound, _, i in SEQ_EDGES:
        assert float(_nemo_geomean(d[i, :2])) == bound


# M2PO: rows of the micro-batches, T = 16
M2_T = 16


def _m2_rows(g, n_rows: int, lengths: list[int], scale: float) -> dict[str, torch.Tensor]:
    mask = (torch.arange(M2_T)[None, :] < torch.tensor(lengths)[:, None]).to(DTYPE)
    old = torch.log(0.05 + 0.9 * torch.rand(n_rows, M2_T, generator=g, dtype=DTYPE)) - 0.05
    log_is = scale * torch.randn(n_rows, M2_T, generator=g, dtype=DTYPE)
    return {"mask": mask, "old": old, "log_is": log_is}


def _m2_finish(g, mask, old, log_is) -> dict[str, torch.Tensor]:
    behavior = torch.where(mask > 0, old - log_is, old - 2.5)
    n = mask.shape[0]
    logprobs = (old + 0.2 * torch.randn(n, M2_T, generator=g, dtype=DTYPE)).clamp(max=-0.01)
    advantages = torch.randn(n, M2_T, generator=g, dtype=DTYPE)
    return {
        "logprobs": logprobs,
        "old_logprobs": old,
        "behavior_logprobs": behavior,
        "advantages": advantages,
        "mask": mask,
    }


def make_m2po_microbatch_inputs() -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """8 rows in two micro-batches of 4 (rows [0, 4) and [4, 8)): the first holds a few large
    δ = ℓold − ℓb, the second only small ones, so the per-micro-batch cut masks more of the
    first than the step's cut does."""
    g = torch.Generator().manual_seed(SEED + 2)
    r = _m2_rows(g, 8, [16, 12, 9, 14, 16, 11, 15, 10], 0.08)
    r["log_is"][0, [1, 5, 9]] = torch.tensor([1.2, -1.0, 0.8], dtype=DTYPE)
    r["log_is"][2, [0, 3]] = torch.tensor([-0.7, 0.6], dtype=DTYPE)
    r["log_is"][3, 7] = 0.55
    return _m2_finish(g, r["mask"], r["old"], r["log_is"]), [[0, 4], [4, 8]]


def make_m2po_rho_inputs() -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """One micro-batch of 8 rows (≈ 100 tokens, small δ) and one token at ρ ≈ 5.5: its
    δ² ≈ 2.9 leaves the second moment of the whole set below τ = 0.04, so the M2 cut keeps it
    and only the rejection sampling (ρ > 5) drops it."""
    g = torch.Generator().manual_seed(SEED + 3)
    r = _m2_rows(g, 8, [16, 14, 13, 16, 12, 15, 16, 11], 0.01)
    r["log_is"][4, 6] = 1.705
    return _m2_finish(g, r["mask"], r["old"], r["log_is"]), [[0, 8]]


def make_m2po_tie_inputs() -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """One micro-batch of 4 rows (40 tokens): 8 interchangeable tokens share δ = 0.5 exactly
    (dyadic ℓold, ℓb), the rest |δ| ≤ ~0.03, so that k* = 2 falls inside the tie: AReaL masks
    2 of the 8 (in its sort order), a cut by value would mask all 8."""
    g = torch.Generator().manual_seed(SEED + 4)
    r = _m2_rows(g, 4, [10, 10, 10, 10], 0.01)
    old = torch.round(r["old"] * 1024) / 1024  # dyadic: old − 0.5 and back are exact
    log_is = r["log_is"]
    tied = [(0, 1), (0, 7), (1, 2), (1, 4), (2, 0), (2, 9), (3, 3), (3, 5)]
    for i, t in tied:
        log_is[i, t] = 0.5
    x = _m2_finish(g, r["mask"], old, log_is)
    # issue 51: the tied tokens are interchangeable (the same ℓθ, ℓold, ℓb, A), so which 2 of
    # them a sort puts first (its tie-break: the library's, possibly the CPU's) changes nothing
    i0, t0 = tied[0]
    for key in ("logprobs", "old_logprobs", "behavior_logprobs", "advantages"):
        for i, t in tied:
            x[key][i, t] = x[key][i0, t0]
    d = x["old_logprobs"] - x["behavior_logprobs"]
    assert all(float(d[i, t]) == 0.5 for i, t in tied)
    return x, [[0, 4]]
