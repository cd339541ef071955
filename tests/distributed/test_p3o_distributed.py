"""The distributed P3O loss equals the single-process whole-batch loss in every layout."""

import pytest

from megatron_p3o.runtime.parallel import Layout

from . import p3o_bodies

LAYOUTS = [Layout(tp=2), Layout(pp=2), Layout(cp=2), Layout(dp=2)]


def _ids(x):
    return f"tp{x.tp}pp{x.pp}cp{x.cp}dp{x.dp}" if isinstance(x, Layout) else str(x)


@pytest.mark.distributed
@pytest.mark.parametrize("n_micro", [1, 3])
@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_p3o_step_gradients_match_single_process(pools, tmp_path, init_ckpts, layout, n_micro):
    init = init_ckpts("llama")
    out = str(tmp_path / "g")
    per_rank = pools(2).run(
        p3o_bodies.p3o_grads, layout, family="llama", init=init, out=out, n_micro=n_micro
    )
    ref = pools(2).run(
        p3o_bodies.p3o_reference, Layout(), family="llama", init=init, compare_dirs=[out]
    )[0]
    esses = [m["ess"] for m in per_rank]
    assert len(set(esses)) == 1, f"e_B differs across ranks: {esses}"
    assert 0.3 < ref["ess"] < 0.95, ref["ess"]  # the test data really is off-policy
    assert abs(esses[0] - ref["ess"]) < 1e-6, (esses[0], ref["ess"])
    losses = [m["loss"] for m in per_rank if "loss" in m]
    assert losses and all(abs(x - ref["loss"]) < 1e-5 * abs(ref["loss"]) + 1e-7 for x in losses), (
        losses,
        ref["loss"],
    )
    bad = {n: e for n, e in ref["errors"][out].items() if not e < 1e-5}
    assert not bad, f"{layout} × {n_micro} micro-batches: gradients differ: {bad}"


@pytest.mark.distributed
def test_microbatch_scope_differs_from_step_scope(pools, tmp_path, init_ckpts):
    """FeynRL's per-micro-batch ESS is not the step's e_B: the gradients visibly differ."""
    init = init_ckpts("llama")
    out = str(tmp_path / "g")
    per_rank = pools(2).run(
        p3o_bodies.p3o_grads,
        Layout(dp=2),
        family="llama",
        init=init,
        out=out,
        n_micro=3,
        scope="microbatch",
    )
    ref = pools(2).run(
        p3o_bodies.p3o_reference, Layout(), family="llama", init=init, compare_dirs=[out]
    )[0]
    assert abs(per_rank[0]["ess"] - ref["ess"]) > 1e-3, (per_rank[0]["ess"], ref["ess"])
    assert max(ref["errors"][out].values()) > 1e-3, "microbatch scope should not equal step scope"


@pytest.mark.distributed
def test_nan_behavior_logprob_names_the_sample(pools, init_ckpts):
    msgs = pools(2).run(
        p3o_bodies.nan_behavior_error, Layout(dp=2), family="llama", init=init_ckpts("llama")
    )
    # sample 4 lives on DP rank 1 (rows 3..5); both ranks stop with the same sample named
    assert all(m is not None and "sample 4" in m and "nan" in m.lower() for m in msgs), msgs
    assert "found on rank 1" in msgs[0]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "objective,layout,n_micro",
    [
        ("grpo", Layout(cp=2), 3),  # sequence-mean of token-means split over CP ranks
        ("gspo", Layout(dp=2), 3),  # per-sequence ratios
        ("decoupled_ppo", Layout(tp=2), 1),
        ("oapl", Layout(pp=2), 3),
    ],
    ids=lambda x: _ids(x),
)
def test_baselines_distributed_match_single_process(
    pools, tmp_path, init_ckpts, objective, layout, n_micro
):
    init = init_ckpts("llama")
    out = str(tmp_path / "g")
    per_rank = pools(2).run(
        p3o_bodies.p3o_grads,
        layout,
        family="llama",
        init=init,
        out=out,
        n_micro=n_micro,
        objective=objective,
    )
    ref = pools(2).run(
        p3o_bodies.p3o_reference,
        Layout(),
        family="llama",
        init=init,
        compare_dirs=[out],
        objective=objective,
    )[0]
    losses = [m["loss"] for m in per_rank if "loss" in m]
    assert losses and all(abs(x - ref["loss"]) < 1e-5 * abs(ref["loss"]) + 1e-7 for x in losses), (
        losses,
        ref["loss"],
    )
    bad = {n: e for n, e in ref["errors"][out].items() if not e < 1e-5}
    assert not bad, f"{objective} {layout}: gradients differ: {bad}"
