"""Packed (THD) micro-batches: the same loss, e_B and gradients as padded ones and as a float64
per-sequence reference, in every layout; no token sees another sequence."""

import pytest
import torch

from megatron_p3o.runtime.parallel import Layout

from . import packing_bodies as pb

LAYOUTS = [Layout(tp=2), Layout(pp=2), Layout(cp=2), Layout(dp=2)]
# packed against padded, both fp32 on CPU: the same sums in another order (measured ≤ 2e-7)
REL = 1e-6
# fp32 against the float64 reference: fp32's own rounding, measured 0.6–1.0e-6 per tensor for
# the padded path as much as for the packed one (the norm weights' gradients cancel most)
REL_F64 = 2e-6


def _ids(x):
    return f"tp{x.tp}pp{x.pp}cp{x.cp}dp{x.dp or 1}" if isinstance(x, Layout) else str(x)


def _run(pools, layout, init, out, **kw):
    return pools(2).run(pb.packed_step, layout, family="llama", init=init, out=out, **kw)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_packed_equals_padded_and_float64_reference(pools, tmp_path, init_ckpts, layout):
    init = init_ckpts("llama")
    packed, padded = str(tmp_path / "packed"), str(tmp_path / "padded")
    res_p = _run(pools, layout, init, packed, mode="packed")
    res_d = _run(pools, layout, init, padded, mode="padded")
    ref = pools(2).run(
        pb.reference, Layout(), family="llama", init=init, compare_dirs=[packed, padded]
    )[0]
    for res in (res_p, res_d):
        m = [r["metrics"] for r in res]
        assert all(abs(x["ess"] - ref["ess"]) < REL for x in m), ([x["ess"] for x in m], ref)
        losses = [x["loss"] for x in m if "loss" in x]
        assert losses and all(abs(x - ref["loss"]) <= REL * abs(ref["loss"]) for x in losses), (
            losses,
            ref["loss"],
        )
    lp_, ld_ = res_p[0]["metrics"], res_d[0]["metrics"]
    assert abs(lp_["loss"] - ld_["loss"]) <= REL * abs(ld_["loss"])
    assert abs(lp_["ess"] - ld_["ess"]) <= REL
    direct = pools(2).run(pb.dir_errors, Layout(), family="llama", a=packed, b=padded)[0]
    bad = {n: e for n, e in direct.items() if not e < REL}
    assert not bad, f"{layout}: packed and padded gradients differ: {bad}"
    for d in (packed, padded):
        bad = {n: e for n, e in ref["errors"][d].items() if not e < REL_F64}
        assert not bad, f"{layout} {d}: gradients differ from the float64 reference: {bad}"
    # the packed micro-batches really are packed: one row, fewer tokens than padding
    shapes = res_p[0]["shapes"]
    assert all(s[0] == 1 and s[1] <= pb.BUDGET for s in shapes), shapes
    assert res_p[0]["stats"]["pad_fraction"] < res_d[0]["stats"]["pad_fraction"]
    if layout.pp > 1:  # the pipeline exchanges one activation shape per step
        assert len(set(shapes)) == 1, shapes


@pytest.mark.distributed
@pytest.mark.parametrize("objective", ["gspo", "oapl"])
@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_whole_sequence_objectives_at_cp2(pools, tmp_path, init_ckpts, objective, mode):
    """GSPO and OAPL are nonlinear in each sequence's sum: CP must not split that sum."""
    init = init_ckpts("llama")
    out = str(tmp_path / "g")
    res = _run(pools, Layout(cp=2), init, out, mode=mode, objective=objective)
    ref = pools(2).run(
        pb.reference, Layout(), family="llama", init=init, compare_dirs=[out], objective=objective
    )[0]
    losses = [r["metrics"]["loss"] for r in res]
    assert all(abs(x - ref["loss"]) <= REL * abs(ref["loss"]) + 1e-9 for x in losses), (
        losses,
        ref["loss"],
    )
    bad = {n: e for n, e in ref["errors"][out].items() if not e < REL_F64}
    assert not bad, f"{objective} cp=2 {mode}: gradients differ: {bad}"


@pytest.mark.distributed
def test_dp_balancing_evens_tokens_and_keeps_every_sample(pools, tmp_path, init_ckpts):
    init = init_ckpts("llama")
    res = _run(pools, Layout(dp=2), init, str(tmp_path / "b"), mode="packed")
    st = res[0]["stats"]
    # rank 0 rolled out samples 0-3 (54 tokens), rank 1 samples 4-7 (80 tokens): 80/67 − 1
    assert abs(st["dp_token_imbalance_before"] - (80 / 67 - 1)) < 1e-9, st
    assert st["dp_token_imbalance"] < 0.05, st
    assert all(r["stats"] == st for r in res)  # every rank reports the same step numbers
    unbalanced = _run(pools, Layout(dp=2), init, str(tmp_path / "u"), mode="packed", balance=False)
    assert abs(unbalanced[0]["stats"]["dp_token_imbalance"] - (80 / 67 - 1)) < 1e-9


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [1, 2])
def test_no_attention_across_packed_sequences(pools, init_ckpts, cp):
    """Changing sequence 1's tokens leaves sequences 0 and 2 bitwise unchanged."""
    init = init_ckpts("llama")
    lay = Layout(cp=cp)
    base = pools(2).run(pb.packed_logits, lay, family="llama", init=init)
    moved = pools(2).run(pb.packed_logits, lay, family="llama", init=init, perturb=1)
    for a, b in zip(base, moved):
        others = a["seq_of"] != 1
        assert others.sum() > 0 and (~others).sum() > 0
        assert torch.equal(a["logits"][others], b["logits"][others])
        assert not torch.equal(a["logits"][~others], b["logits"][~others])


@pytest.mark.distributed
def test_microbatch_ess_scope_gets_equal_microbatch_counts(pools, tmp_path, init_ckpts):
    """ESS scope "microbatch" all-reduces once per micro-batch over DP: unbalanced ranks (and a
    budget that gives them different counts) must still run the same number."""
    init = init_ckpts("llama")
    res = _run(
        pools, Layout(dp=2), init, str(tmp_path / "m"), mode="packed", balance=False,
        scope="microbatch",
    )  # fmt: skip
    counts = [len(r["shapes"]) for r in res]
    assert counts[0] == counts[1] and counts[0] >= 3, counts
    assert all(0 < r["metrics"]["ess"] <= 1 for r in res)


# hyper-parameters of the mismatch corrections here: a seq-mask-TIS band that keeps some of these
# sequences (NeMo-RL's [0.999, 1.002] keeps none of random ones); IcePop and M2PO at defaults
MISMATCH = {"icepop": {}, "seq_mask_tis": {"lo": 0.8, "hi": 1.25}, "m2po": {}}


@pytest.mark.distributed
@pytest.mark.parametrize("objective", sorted(MISMATCH))
def test_mismatch_corrections_packed_in_every_layout(pools, tmp_path, init_ckpts, objective):
    """IcePop, seq-mask-TIS and M2PO, packed, at TP=2 / PP=2 / CP=2 / DP=2: the loss and every
    gradient equal the float64 single-process reference (M2PO's cut spans every micro-batch
    and DP rank)."""
    init = init_ckpts("llama")
    h = MISMATCH[objective]
    hyper = {"mis_low": h["lo"], "mis_high": h["hi"]} if h else {}
    ref_hyper = {objective: h} if h else {}
    outs, losses, fracs = [], {}, {}
    for layout in LAYOUTS:
        out = str(tmp_path / _ids(layout))
        res = _run(pools, layout, init, out, mode="packed", objective=objective, hyper=hyper)
        outs.append(out)
        losses[out] = [r["metrics"]["loss"] for r in res if "loss" in r["metrics"]]
        fracs[out] = {r["metrics"]["mask_frac"] for r in res if "mask_frac" in r["metrics"]}
    ref = pools(2).run(
        pb.reference, Layout(), family="llama", init=init, compare_dirs=outs,
        objective=objective, hyper=ref_hyper,
    )[0]  # fmt: skip
    for out in outs:
        assert losses[out] and all(
            abs(x - ref["loss"]) <= REL_F64 * abs(ref["loss"]) for x in losses[out]
        ), (out, losses[out], ref["loss"])
        assert len(fracs[out]) == 1 and 0 < next(iter(fracs[out])) < 1, (out, fracs[out])
        bad = {n: e for n, e in ref["errors"][out].items() if not e < REL_F64}
        assert not bad, f"{objective} {out}: gradients differ from the float64 reference: {bad}"
    assert len({next(iter(f)) for f in fracs.values()}) == 1, fracs  # one mask in every layout


@pytest.mark.distributed
def test_p3o_capped_trust_region_packed_in_every_layout(pools, tmp_path, init_ckpts):
    """P3O with ``kl_weight: capped`` (k3 weighted by sg(min(ρ, e_B)), e_B over the whole step),
    packed, at TP=2 / PP=2 / CP=2 / DP=2: the loss and every gradient equal the float64
    single-process reference, and differ from the paper's form."""
    init = init_ckpts("llama")
    outs, losses = [], {}
    for layout in LAYOUTS:
        out = str(tmp_path / _ids(layout))
        res = _run(pools, layout, init, out, mode="packed", hyper={"kl_weight": "capped"})
        outs.append(out)
        losses[out] = [r["metrics"]["loss"] for r in res if "loss" in r["metrics"]]
    ref = pools(2).run(
        pb.reference, Layout(), family="llama", init=init, compare_dirs=outs,
        objective="p3o", hyper={"p3o": {"kl_weight": "capped"}},
    )[0]  # fmt: skip
    paper = pools(2).run(pb.reference, Layout(), family="llama", init=init)[0]
    assert abs(paper["loss"] - ref["loss"]) > 1e-6 * abs(ref["loss"])
    for out in outs:
        assert losses[out] and all(
            abs(x - ref["loss"]) <= REL_F64 * abs(ref["loss"]) for x in losses[out]
        ), (out, losses[out], ref["loss"])
        bad = {n: e for n, e in ref["errors"][out].items() if not e < REL_F64}
        assert not bad, f"{out}: gradients differ from the float64 reference: {bad}"


@pytest.mark.distributed
def test_token_means_over_dp_weigh_each_ranks_tokens(pools):
    """staleness_token_mean over DP ranks holding 1 and 3 tokens: the token mean of all 4
    (0 + 1 + 1 + 1) / 4 = 0.75, not the mean of the two ranks' means (0 + 1) / 2; the
    per-sequence mean stays a mean over ranks, the maximum a maximum."""
    from megatron_p3o.observability.metrics import staleness

    class S:
        def __init__(self, versions):
            self.weight_version, self.token_versions = min(versions), versions

        def versions(self):
            return self.token_versions

        policy_versions = versions

    ranks = [staleness([S([5])], trained=5), staleness([S([4, 4, 4])], trained=5)]
    for r in ranks:
        r.update(staleness_max=r["staleness_max"], completion_len_max=1.0)
    want_token = (0 + 1 + 1 + 1) / 4
    for out in pools(2).run(pb.rollout_metrics_over_dp, Layout(), per_rank=ranks):
        assert out["staleness_token_mean"] == want_token
        assert out["staleness_tokens"] == 4.0
        assert out["staleness_mean"] == (0 + 1) / 2 and out["staleness_token_max"] == 1.0


# every objective the float64 reference writes out (tests/unit/test_objectives.ref_loss)
EVERY = ["p3o", "p4o", "reinforce", "ppo", "grpo", "dapo", "tis", "mis", "gspo", "gspo_token",
         "cispo", "decoupled_ppo", "oapl"]  # fmt: skip


def _every_layout_equals_float64(pools, tmp_path, init, objective, **kw) -> None:
    """The packed step at TP=2 / PP=2 / CP=2 / DP=2: its loss and every gradient equal the
    float64 per-sequence reference of the same batch (``kw``: the bodies' options)."""
    outs, losses = [], {}
    for layout in LAYOUTS:
        out = str(tmp_path / _ids(layout))
        res = _run(pools, layout, init, out, mode="packed", objective=objective, **kw)
        outs.append(out)
        losses[out] = [r["metrics"]["loss"] for r in res if "loss" in r["metrics"]]
    ref = pools(2).run(pb.reference, Layout(), family="llama", init=init, compare_dirs=outs,
                       objective=objective, **kw)[0]  # fmt: skip
    for out in outs:
        assert losses[out] and all(
            abs(x - ref["loss"]) <= REL_F64 * abs(ref["loss"]) + 1e-9 for x in losses[out]
        ), (out, losses[out], ref["loss"])
        bad = {n: e for n, e in ref["errors"][out].items() if not e < REL_F64}
        assert not bad, f"{objective} {out}: gradients differ from the float64 reference: {bad}"


@pytest.mark.distributed
@pytest.mark.parametrize("objective", EVERY)
def test_every_objective_on_a_multi_turn_batch_in_every_layout(
    pools, tmp_path, init_ckpts, objective
):
    """Issue 53: the batch holds multi-turn trajectories (environment tokens mid-completion,
    ``packing_bodies.env_span``) next to single-turn samples; packed, at TP=2 / PP=2 / CP=2 /
    DP=2, each objective's loss and every gradient equal the float64 per-sequence reference
    over the policy's tokens only (IcePop, seq-mask-TIS, M2PO, capped P3O: the tests above)."""
    _every_layout_equals_float64(pools, tmp_path, init_ckpts("llama"), objective)


@pytest.mark.distributed
@pytest.mark.parametrize("objective", ["p3o", "grpo"])
def test_turn_level_advantages_on_a_multi_turn_batch_in_every_layout(
    pools, tmp_path, init_ckpts, objective
):
    """Issue 62 (``rollout.multi_turn.credit: turn``): each trajectory's turns carry their own
    advantage, per token; packed, at TP=2 / PP=2 / CP=2 / DP=2 the loss and every gradient equal
    the float64 per-sequence reference with the same per-token advantages."""
    _every_layout_equals_float64(pools, tmp_path, init_ckpts("llama"), objective, per_token=True)
