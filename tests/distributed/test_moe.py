"""Mixture-of-experts (Qwen3-MoE layout: 4 experts, top-2, normalized top-k, fp32 router) under
expert parallelism: one P3O step's loss, e_B and every gradient equal a TP=1, EP=1 float64
per-sequence reference, with both token dispatchers that run on CPU (allgather, alltoall)."""

import pytest

from megatron_p3o.runtime.parallel import Layout, LayoutError

from . import bodies
from . import packing_bodies as pb

REL = 1e-5  # the bound; the fp32 router and fp32 layouts against float64


def _check(pools, tmp_path, init_moe, layout, world, dispatcher, family="qwen3moe"):
    out = str(tmp_path / f"moe_{dispatcher}_{world}")
    res = pools(world).run(
        pb.packed_step, layout, family=family, init=init_moe, out=out, dispatcher=dispatcher
    )
    ref = pools(2).run(pb.reference, Layout(), family=family, init=init_moe,
                       compare_dirs=[out])[0]  # fmt: skip
    losses = [r["metrics"]["loss"] for r in res if "loss" in r["metrics"]]
    assert losses and all(abs(x - ref["loss"]) <= REL * abs(ref["loss"]) for x in losses), (
        losses, ref["loss"])  # fmt: skip
    assert all(abs(r["metrics"]["ess"] - ref["ess"]) < REL for r in res)
    errs = ref["errors"][out]
    if family == "qwen3moe":
        assert any("experts" in n for n in errs) and any("router" in n for n in errs), sorted(errs)
    bad = {n: e for n, e in errs.items() if not e < REL}
    assert not bad, f"{layout} {dispatcher}: gradients differ from the float64 reference: {bad}"


@pytest.fixture(scope="module")
def init_moe(pools, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moeinit") / "qwen3moe")
    pools(2).run(bodies.save_init, Layout(), family="qwen3moe", out=path)
    return path


@pytest.mark.distributed
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_ep2_equals_float64_reference(pools, tmp_path, init_moe, dispatcher):
    _check(pools, tmp_path, init_moe, Layout(ep=2), 2, dispatcher)


@pytest.mark.distributed
def test_ep1_dp2_equals_float64_reference(pools, tmp_path, init_moe):
    """EP=1: the experts still have their own buffers and optimizer (one checkpoint structure
    at every EP)."""
    _check(pools, tmp_path, init_moe, Layout(), 2, "allgather")


@pytest.mark.distributed
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_ep2_dp2_equals_float64_reference(pools, tmp_path, init_moe, dispatcher):
    """World 4: attention DP=4, experts EP=2 × expert-DP=2."""
    _check(pools, tmp_path, init_moe, Layout(ep=2), 4, dispatcher)


@pytest.mark.distributed
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_ep2_tp2_equals_float64_reference(pools, tmp_path, init_moe, dispatcher):
    """World 4: TP=2 with sequence parallelism (Megatron trains MoE with TP only under it),
    experts EP=2 × expert-TP=2."""
    _check(pools, tmp_path, init_moe, Layout(tp=2, ep=2, sequence_parallel=True), 4, dispatcher)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout",
    [Layout(tp=2, sequence_parallel=True), Layout(tp=2, ep=2, etp=1, sequence_parallel=True)],
    ids=["tp2_sp_etp2", "tp2_sp_ep2_etp1"],
)
def test_tp2_sequence_parallel_on_two_ranks_equals_float64_reference(
    pools, tmp_path, init_moe, layout
):
    """The layouts MoE recipes use, on 2 ranks (issue 52, item 0): TP 2 under sequence
    parallelism with the experts split over TP (expert-TP 2) or spread over the same two ranks
    (EP 2, expert-TP 1: rank 1 holds experts 2-3 at TP rank 1)."""
    _check(pools, tmp_path, init_moe, layout, 2, "alltoall")


@pytest.mark.distributed
def test_dense_sequence_parallel_equals_float64_reference(pools, tmp_path, init_ckpts):
    """Sequence parallelism on CPU (the local spec's norm marks its weight for the TP sum)."""
    _check(pools, tmp_path, init_ckpts("llama"), Layout(tp=2, sequence_parallel=True), 2,
           "allgather", family="llama")  # fmt: skip


def test_expert_layout_errors_name_the_numbers():
    with pytest.raises(LayoutError, match="num_experts=6 is not divisible by ep=4"):
        Layout(ep=4).resolve(4).check_model(
            num_layers=2, num_heads=4, num_kv_heads=2, num_experts=6, expert_ffn=32
        )
    with pytest.raises(LayoutError, match=r"etp×ep×pp = 1×4×2 = 8"):
        Layout(pp=2, ep=4).resolve(4)
    with pytest.raises(LayoutError, match="needs a mixture-of-experts model"):
        Layout(ep=2).resolve(2).check_model(num_layers=2, num_heads=4, num_kv_heads=2)
    # Megatron's MoELayer refuses TP without sequence parallelism at the first training forward
    with pytest.raises(LayoutError, match=r"at tp=2 needs parallel.sequence_parallel: true"):
        Layout(tp=2).resolve(2).check_model(
            num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4, expert_ffn=32
        )
