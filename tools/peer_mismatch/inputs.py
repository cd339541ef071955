"""The fixed float64 inputs every peer case is computed on (see tools/record_peer_mismatch.py)."""

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


def as_lists(x: dict[str, torch.Tensor]) -> dict:
    out = {k: v.tolist() for k, v in x.items()}
    out["lengths"] = list(LENGTHS)
    return out


def scalar(v) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)
