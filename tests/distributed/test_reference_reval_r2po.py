"""The reference model, ReVal and R2PO against float64 single-process references (see
``reval_r2po_bodies``): ℓref / V_ref at TP=2, PP=2 and CP=2; ReVal's loss and gradients (both
``value_grad`` settings) at TP=2, PP=2, CP=2 and DP=2; R2PO's residual head at TP=2 (W₂ split
over the vocabulary) and both phase losses."""

import pytest
import torch

from megatron_p3o.runtime.parallel import Layout

from . import bodies
from . import reval_r2po_bodies as rb

REL = 2e-6  # fp32 layouts against float64 references (as the packing tests)


def _ids(x):
    return f"tp{x.tp}pp{x.pp}cp{x.cp}dp{x.dp or 1}" if isinstance(x, Layout) else str(x)


@pytest.fixture(scope="module")
def ref_init(pools, tmp_path_factory):
    """A second checkpoint (other weights) to serve as the reference model."""
    path = str(tmp_path_factory.mktemp("refinit") / "llama")
    pools(2).run(bodies.save_init, Layout(), family="llama", out=path, seed=9)
    return path


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(pp=2), Layout(cp=2)], ids=_ids)
def test_reference_logprobs_and_log_partition(pools, init_ckpts, layout):
    init = init_ckpts("llama")
    got = pools(2).run(rb.reference_scores, layout, family="llama", init=init)[0]
    want = pools(2).run(rb.reference_scores_f64, Layout(), family="llama", init=init)[0]
    assert sorted(got) == sorted(want)
    for i, w in want.items():
        g = got[i]
        lp_err = rb.policy_err(g, w)
        assert lp_err < 2e-5, (i, lp_err)
        assert abs(g["ref_values"] - w["ref_values"]) < 2e-5 * abs(w["ref_values"]), (i, g, w)


def _check_reval(pools, tmp_path, init, ref_init, layout, value_grad, packed=True):
    out = str(tmp_path / f"reval_{_ids(layout)}_{value_grad}_{packed}")
    res = pools(2).run(
        rb.reval_step, layout, family="llama", init=init, ref_init=ref_init, out=out,
        value_grad=value_grad, packed=packed,
    )  # fmt: skip
    ref = pools(2).run(
        rb.reval_reference, Layout(), family="llama", init=init, ref_init=ref_init,
        compare_dirs=[out], value_grad=value_grad,
    )[0]  # fmt: skip
    losses = [r["metrics"]["loss"] for r in res if "loss" in r["metrics"]]
    assert losses and all(abs(x - ref["loss"]) <= REL * ref["loss"] for x in losses), (
        losses,
        ref["loss"],
    )
    bad = {n: e for n, e in ref["errors"][out].items() if not e < REL}
    assert not bad, f"{layout} value_grad={value_grad}: gradients differ: {bad}"
    return ref


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout", [Layout(tp=2), Layout(pp=2), Layout(cp=2), Layout(dp=2)], ids=_ids
)
def test_reval_equals_float64_reference(pools, tmp_path, init_ckpts, ref_init, layout):
    _check_reval(pools, tmp_path, init_ckpts("llama"), ref_init, layout, value_grad=True)


@pytest.mark.distributed
def test_reval_value_grad_off_and_padded(pools, tmp_path, init_ckpts, ref_init):
    """The paper's written gradient (no ∇V_θ(s₁)) at TP=2, padded micro-batches, and it really
    differs from the loss-as-written gradient."""
    init = init_ckpts("llama")
    off = _check_reval(pools, tmp_path, init, ref_init, Layout(tp=2), False, packed=False)
    on = _check_reval(pools, tmp_path, init, ref_init, Layout(tp=2), True, packed=False)
    assert abs(off["loss"] - on["loss"]) < 1e-9 * on["loss"]  # same δ, another gradient
    d_on = str(tmp_path / "reval_tp2pp1cp1dp1_True_False")
    d_off = str(tmp_path / "reval_tp2pp1cp1dp1_False_False")
    diff = pools(2).run(bodies.compare_checkpoints, Layout(), family="llama", a=d_on, b=d_off)[0]
    assert diff, "the V_θ(s₁) gradient path changed nothing"


@pytest.mark.distributed
def test_reval_refuses_a_split_sequence(pools, init_ckpts):
    msg = pools(2).run(rb.reval_split_sequence, Layout(dp=2), family="llama",
                       init=init_ckpts("llama"))  # fmt: skip
    assert all(m and "never split a sequence" in m and "reval" in m for m in msg), msg


@pytest.mark.distributed
def test_residual_head_logits_tp2(pools, init_ckpts):
    init = init_ckpts("llama")
    got = pools(2).run(rb.head_logits, Layout(tp=2), family="llama", init=init)
    want = pools(2).run(rb.head_logits_f64, Layout(), family="llama", init=init)[0]
    g = got[0]
    assert torch.equal(got[0]["mixed"][0], got[1]["mixed"][0])  # both TP ranks: whole logits
    (mixed,), (base,), (cu,), (order,) = g["mixed"], g["base"], g["cu"], g["order"]
    cu, order = cu.tolist(), order.tolist()
    assert sorted(order) == [0, 1, 2]
    for k, (zm, zb) in enumerate(want):
        a = cu[order.index(k)]
        n = zm.shape[0]
        err_m = float((mixed[a : a + n].double() - zm).abs().max() / zm.abs().max())
        err_b = float((base[a : a + n].double() - zb).abs().max() / zb.abs().max())
        assert err_m < 2e-6 and err_b < 2e-6, (k, err_m, err_b)
        assert float((zm - zb).abs().max()) > 1e-3  # the residual is really there


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(dp=2)], ids=_ids)
def test_r2po_phase_losses(pools, tmp_path, init_ckpts, ref_init, layout):
    init = init_ckpts("llama")
    out = str(tmp_path / f"r2po_{_ids(layout)}")
    res = pools(2).run(rb.r2po_phases, layout, family="llama", init=init, ref_init=ref_init,
                       out=out)  # fmt: skip
    ref = pools(2).run(rb.r2po_reference, Layout(), family="llama", init=init,
                       ref_init=ref_init, compare_dirs=[out])[0]  # fmt: skip
    for r in res:
        assert abs(r["head"]["loss"] - ref["head_loss"]) <= REL * abs(ref["head_loss"]), (
            r["head"]["loss"], ref["head_loss"])  # fmt: skip
        assert r["head"]["clip_frac"] > 0  # the stale ℓμ,old puts some ratios outside the clip
        for k in ("w1", "w2"):
            g, w = r["head_grads"][k].double(), ref["head_grads"][k]
            err = float((g - w).norm() / w.norm())
            assert err < REL, (k, err)
        assert abs(r["policy"]["loss"] - ref["policy_loss"]) <= 1e-6 * max(
            abs(ref["policy_loss"]), 1e-3
        )
        for i, w in ref["old"].items():  # ℓold is the base head's, not μ's
            got = {"ref_logprobs": res[0]["old"][i]["old_logprobs"]}
            assert rb.policy_err(got, w) < 2e-5, i
    bad = {n: e for n, e in ref["errors"][out].items() if not e < REL}
    assert not bad, f"{layout}: policy-phase gradients differ: {bad}"
