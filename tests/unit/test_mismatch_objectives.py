"""Issue 27: IcePop, seq-mask-TIS and M2PO against the peers' own code.

The numbers in tests/fixtures/peer_mismatch_corrections.json were computed by the peers'
functions themselves (NeMo-RL's ``ClippedPGLossFn``, AReaL's ``ppo_actor_loss_fn`` and
``grpo_loss_fn``, slime's ``icepop_function`` through its ``loss_function``) on fixed float64
inputs, by tools/record_peer_mismatch.py; the fixture names each peer's repository and commit.
Here the project's objectives run on the same inputs with the peer's settings translated, and
must give the peer's loss, gradient w.r.t. ℓθ and masked fraction.
"""

import json
from pathlib import Path

import pytest
import torch

from megatron_p3o.loss import policy_loss

FIXTURE = json.loads(
    (
        Path(__file__).resolve().parents[1] / "fixtures" / "peer_mismatch_corrections.json"
    ).read_text()
)
CASES = {c["name"]: c for c in FIXTURE["cases"]}
M2PO = {c["name"]: c for c in FIXTURE["m2po_cases"]}


def _inputs(case):
    x = {
        k: torch.tensor(v, dtype=torch.float64) for k, v in case["inputs"].items() if k != "lengths"
    }
    return x


def _translate(case):
    """(objective, hyper, rtol, masked-fraction metric of the peer, which of ours it is)."""
    peer, cfg = case["peer"], case["peer_config"]
    if peer == "nemo_rl":
        assert cfg["token_level_loss"] and not cfg["reference_policy_kl_penalty"]
        assert cfg["ratio_clip_c"] is None and not cfg["force_on_policy_ratio"]
        hyper = dict(
            mis_low=cfg["truncated_importance_sampling_ratio_min"],
            mis_high=cfg["truncated_importance_sampling_ratio"],
            eps_low=cfg["ratio_clip_min"],
            eps_high=cfg["ratio_clip_max"],
        )
        ours = "mask_frac" if case["objective"] == "icepop" else "seq_mask_frac"
        # NeMo-RL divides by (global valid tokens + 1e-8)
        return case["objective"], hyper, 1e-8, case["metrics"]["is_oob_ratio"], ours
    if peer == "areal":
        rs = cfg["rejection_sampling"]
        assert rs["level"] == "token" and rs["action"] == "mask" and cfg["use_decoupled_loss"]
        hyper = dict(
            mis_low=rs["lower"] or 0.0,
            mis_high=rs["upper"],
            eps_low=cfg["eps_clip"],
            eps_high=cfg["eps_clip_higher"] or cfg["eps_clip"],
        )
        # AReaL forms its mismatch weight in float32
        return "icepop", hyper, 1e-6, case["metrics"]["filtered_fraction"], "mask_frac"
    if peer == "slime":
        hyper = dict(
            mis_low=cfg["tis_clip_low"],
            mis_high=cfg["tis_clip"],
            eps_low=cfg["eps_clip"],
            eps_high=cfg["eps_clip_high"],
        )
        if not cfg["calculate_per_token_loss"]:  # slime's default: mean of per-sample means
            hyper["aggregation"] = "seq_mean_token_mean"
            return "icepop", hyper, 1e-12, None, None
        return "icepop", hyper, 1e-12, case["metrics"]["tis_clipfrac"], "mask_frac"
    raise KeyError(peer)


@pytest.mark.parametrize("name", sorted(CASES))
def test_icepop_and_seq_mask_tis_equal_the_peer_code(name):
    case = CASES[name]
    x = _inputs(case)
    objective, hyper, rtol, peer_frac, ours = _translate(case)
    lp = x["logprobs"].clone().requires_grad_()
    loss, metrics = policy_loss(
        objective,
        lp,
        x["behavior_logprobs"],
        x["advantages"],
        x["mask"],
        old_logprobs=x["old_logprobs"],
        **hyper,
    )
    (g,) = torch.autograd.grad(loss, lp)
    ref_g = torch.tensor(case["grad_logprobs"], dtype=torch.float64)
    assert float(loss) == pytest.approx(case["loss"], rel=rtol, abs=1e-12)
    assert ref_g.abs().sum() > 0
    assert torch.allclose(g, ref_g, rtol=max(rtol, 1e-10), atol=1e-12), (g - ref_g).abs().max()
    if peer_frac is not None:
        assert metrics[ours] == pytest.approx(peer_frac, rel=1e-6)
        assert 0 < metrics[ours] < 1  # the fixture's inputs mask some and keep some


def test_the_peers_agree_on_icepop():
    """slime's per-token IcePop and NeMo-RL's are one formula (a cross-check of the fixture)."""
    a, b = CASES["slime_icepop_band_per_token_loss"], CASES["nemo_rl_icepop"]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-8)


@pytest.mark.parametrize("name", sorted(M2PO))
def test_m2po_mask_and_loss_equal_areal(name):
    """AReaL's M2PO on one micro-batch holding the whole step: the same keep-mask (its statistic
    is per micro-batch, ours over the step: here the same token set). AReaL weights the kept
    tokens by ρ = πold/πb only through its rejection sampling; with the configuration AReaL
    ships for M2PO (examples/math/gsm8k_m2po.yaml: ε = 0, rejection of ρ > 5, which no token the
    M2 cut keeps reaches) its loss and gradient are ours."""
    case = M2PO[name]
    x = _inputs(case)
    cfg = case["peer_config"]
    lp = x["logprobs"].clone().requires_grad_()
    loss, metrics = policy_loss(
        "m2po",
        lp,
        x["behavior_logprobs"],
        x["advantages"],
        x["mask"],
        old_logprobs=x["old_logprobs"],
        tau=cfg["m2_threshold"],
        eps_low=cfg["eps_clip"],
        eps_high=cfg["eps_clip"],
    )
    keep = torch.tensor(case["metrics"]["m2po_keep_mask"], dtype=torch.float64)
    m = x["mask"]
    masked = float(((1 - keep) * m).sum())
    assert case["metrics"]["m2po_masked_tokens"] == masked > 0
    assert metrics["mask_frac"] == pytest.approx(masked / float(m.sum()), rel=1e-12)
    rs = cfg["rejection_sampling"]
    if rs is not None:
        rho = torch.exp(torch.where(m > 0, x["old_logprobs"] - x["behavior_logprobs"], 0.0))
        assert rs["lower"] is None and float((rho * keep).max()) <= rs["upper"]
        (g,) = torch.autograd.grad(loss, lp)
        ref_g = torch.tensor(case["grad_logprobs"], dtype=torch.float64)
        assert float(loss) == pytest.approx(case["loss"], rel=1e-6)  # AReaL: float32 weights
        assert ref_g.abs().sum() > 0
        assert torch.allclose(g, ref_g, rtol=1e-6, atol=1e-12)
        assert ((g != 0) <= (keep > 0)).all()  # masked tokens get no gradient
