"""P4O against FeynRL's own function (issue 65, item 2): tests/fixtures/peer_p4o_feynrl.json
holds the loss and gradient that FeynRL's ``P4O.compute_policy_loss`` (its newest commit, named
in the fixture) computed on six seeded float64 cases (tools/record_peer_p4o.py: a fresh proximal
anchor, a fresh behaviour anchor, mismatch on either, both far). The project's P4O on the same
inputs equals them to 1e-9 relative (the peer runs in float64: its float32 casts redirected,
tools/record_peer_p4o.py; what is left is its ESS's 1e-8 in the denominator); the mixture
smoothing the project had before (δ = 1e-6 in both weights, 2δ in the normaliser) differs by up
to ~3e-6 and fails this bound."""

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_p3o.loss.registry import policy_loss

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from record_peer_p4o import CASES, inputs  # noqa: E402

FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "peer_p4o_feynrl.json").read_text())
LOSS_RTOL, GRAD_RTOL = 1e-9, 1e-9  # the old smoothing was ~3e-6 off


@pytest.mark.parametrize("k", range(len(CASES)))
def test_p4o_equals_feynrls_own_function(k):
    rec = FIXTURE["cases"][k]
    assert (rec["noise_b"], rec["noise_prox"]) == CASES[k]  # the inputs the fixture was made on
    x = inputs(k, *CASES[k])
    lp = x["lp"].clone().requires_grad_()
    loss, metrics = policy_loss("p4o", lp, x["lb"], x["adv"], x["mask"], old_logprobs=x["lprox"])
    (grad,) = torch.autograd.grad(loss, lp)
    assert metrics["ess"] == pytest.approx(rec["ess_b"], rel=1e-9)
    assert metrics["ess_prox"] == pytest.approx(rec["ess_prox"], rel=1e-9)
    assert float(loss) == pytest.approx(rec["loss"], rel=LOSS_RTOL)
    want = torch.tensor(rec["grad"], dtype=torch.float64)
    err = float((grad - want).abs().max() / want.abs().max())
    assert err < GRAD_RTOL, err


def test_the_fixture_names_the_peer_commit_and_function():
    peer = FIXTURE["peer"]
    assert peer["repo"] == "FeynRL-project/FeynRL" and len(peer["commit"]) == 40
    assert peer["function"] == "P4O.compute_policy_loss" and peer["file"] == "algs/P4O/p4o.py"


def test_p4o_is_p3o_when_the_proximal_anchor_is_the_current_policy():
    """What stress study v6 predicts from (docs/stress_v6_plan.md): with πprox = πθ (ℓold
    recomputed at the step's start, one optimizer step per rollout batch) e_prox = 1, the
    mixture's proximal weight is 0 and P4O's loss and gradient are P3O's to float64 rounding;
    a moved proximal anchor (the control) makes them differ."""
    x = inputs(1, *CASES[1])
    out = {}
    for name, lprox in (("fresh", x["lp"]), ("moved", x["lprox"])):
        for obj in ("p3o", "p4o"):
            lp = x["lp"].clone().requires_grad_()
            kw = {"old_logprobs": lprox} if obj == "p4o" else {}
            loss, m = policy_loss(obj, lp, x["lb"], x["adv"], x["mask"], **kw)
            (grad,) = torch.autograd.grad(loss, lp)
            out[name, obj] = (float(loss), grad, m)
    (l3, g3, _), (l4, g4, m4) = out["fresh", "p3o"], out["fresh", "p4o"]
    assert m4["ess_prox"] == pytest.approx(1.0, abs=1e-12) and m4["ess"] < 0.99
    assert l4 == pytest.approx(l3, rel=1e-12)
    assert float((g4 - g3).abs().max()) <= 1e-12 * float(g3.abs().max())
    l4m, g4m, _ = out["moved", "p4o"]
    assert abs(l4m - l3) > 1e-6 * abs(l3)
