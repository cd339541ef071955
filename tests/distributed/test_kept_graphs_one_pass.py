"""e_B without a second forward (issue 55): with ``batch.keep_graphs`` the gradient pass's own
forwards run first with their graphs kept and give e_B; the loss, e_B, every metric and every
gradient equal the ESS pre-pass path's bit for bit on the same micro-batches, at DP = 2, CP = 2
and TP = 2, fused and unfused, packed and padded; PP = 2 keeps the pre-pass; ``auto`` agrees on
every rank when one of them has no room. The kept step also keeps the fused kernel's logits
(``batch.keep_logits: auto``) against the pre-pass step's recomputed ones."""

import pytest

from megatron_p3o.runtime.parallel import Layout

from . import one_pass_bodies as ob

LAYOUTS = [Layout(dp=2), Layout(cp=2), Layout(tp=2)]


def _ids(x):
    return f"tp{x.tp}pp{x.pp}cp{x.cp}dp{x.dp or 1}" if isinstance(x, Layout) else str(x)


def _run(pools, layout, init, **kw):
    return pools(2).run(ob.kept_vs_prepass, layout, family="llama", init=init, **kw)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
@pytest.mark.parametrize("mode,fused", [("packed", True), ("padded", False)])
def test_kept_graphs_equal_the_prepass_bitwise(pools, init_ckpts, layout, mode, fused):
    res = _run(pools, layout, init_ckpts("llama"), mode=mode, fused=fused)
    for r in res:
        assert r["paths"] == ("prepass", "kept_graphs"), r["paths"]
        # the fused kernel kept its logits on the kept path (they fit): still bit for bit
        assert r["kept_logits"] == (False, fused), r["kept_logits"]
        assert r["prepass"] == (1.0, 0.0)  # the step's metric says which path ran
        assert r["micro"] >= 2, r
        assert r["same_grads"], f"gradients differ (max rel {r['worst']:.2e})"
        assert not r["diffs"], r["diffs"]
    assert 0.3 < res[0]["ess"] < 0.99  # off-policy: e_B matters to the gradient


@pytest.mark.distributed
@pytest.mark.parametrize("objective", ["p4o", "grpo"])
def test_other_objectives_on_the_kept_path(pools, init_ckpts, objective):
    """P4O (e_B and e_prox from the kept forwards, ℓold recomputed) equals its pre-pass path;
    GRPO needs no e_B and runs Megatron's schedule either way."""
    res = _run(pools, Layout(dp=2), init_ckpts("llama"), objective=objective)
    want = ("prepass", "kept_graphs") if objective == "p4o" else ("none", "none")
    for r in res:
        assert r["paths"] == want and r["same_grads"] and not r["diffs"], r


@pytest.mark.distributed
def test_padded_prepass_fused_micro_batches_agree_within_rounding(pools, init_ckpts):
    """The pre-pass stacks padded micro-batches (``loss.prepass_fuse``): other micro-batches,
    the same numbers within float rounding."""
    res = _run(pools, Layout(dp=2), init_ckpts("llama"), mode="padded", fuse=4)
    for r in res:
        assert r["paths"] == ("prepass", "kept_graphs")
        assert r["worst"] < 1e-5, r["worst"]
        assert all(v < 1e-5 for v in r["rel"].values()), r["rel"]


@pytest.mark.distributed
def test_pipeline_parallel_keeps_the_prepass(pools, init_ckpts):
    for r in _run(pools, Layout(pp=2), init_ckpts("llama")):
        assert r["paths"] == ("prepass", "prepass") and r["same_grads"] and not r["diffs"], r


@pytest.mark.distributed
def test_auto_takes_one_path_on_every_rank(pools, init_ckpts):
    for layout in (Layout(dp=2), Layout(tp=2)):
        res = pools(2).run(ob.auto_with_one_rank_short, layout, family="llama",
                           init=init_ckpts("llama"))  # fmt: skip
        assert [r["short"] for r in res] == ["prepass", "prepass"], (layout, res)
        assert [r["room"] for r in res] == ["kept_graphs", "kept_graphs"], (layout, res)
