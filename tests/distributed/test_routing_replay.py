"""Rollout routing replay (R3): with recorded experts forced to differ from the trainer's own
top-k, the replayed forward and the router's gradient equal a float64 transformers reference
routed through the recorded experts; with replay off the trainer routes by itself."""

import pytest
import torch

from megatron_p3o.runtime.parallel import Layout

from . import bodies
from . import moe_bodies as mb

REL = 1e-5


@pytest.fixture(scope="module")
def init_moe(pools, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moeinit_r3") / "qwen3moe")
    pools(2).run(bodies.save_init, Layout(), family="qwen3moe", out=path)
    return path


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# TP 2 runs MoE under sequence parallelism only: each TP rank's router sees its slice of the
# sequence, and the recorded routes must be sliced the same way (issue 52, item 0)
SP_LAYOUTS = {
    "tp2_sp": (Layout(tp=2, sequence_parallel=True), 2),
    "tp2_sp_ep2_etp1": (Layout(tp=2, ep=2, etp=1, sequence_parallel=True), 2),
    "tp2_sp_ep2_dp2": (Layout(tp=2, ep=2, sequence_parallel=True), 4),
}
LAYOUTS = {"ep1": (Layout(), 1), "ep2": (Layout(ep=2), 2), **SP_LAYOUTS}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_replayed_forward_and_router_gradient_follow_the_recorded_experts(pools, init_moe, name):
    layout, world = LAYOUTS[name]
    res = pools(world).run(mb.replay_step, layout, family="qwen3moe", init=init_moe, mode="r3")
    ref = pools(1).run(mb.hf_reference, Layout(), family="qwen3moe", init=init_moe,
                       forced_routes=True)[0]  # fmt: skip
    own = pools(1).run(mb.hf_reference, Layout(), family="qwen3moe", init=init_moe,
                       forced_routes=False)[0]  # fmt: skip
    # the recorded experts really differ from the trainer's own choice
    assert all(a is not None and a < 0.75 for r in res for a in r["agree"]), [
        r["agree"] for r in res
    ]
    assert _rel(own["logits"], ref["logits"]) > 1e-2
    for r in res:
        a, b = r["rows"]
        assert _rel(r["logits"], ref["logits"][a:b]) < REL
        for name, g in r["router_grads"].items():
            assert _rel(g, ref["router_grads"][name]) < REL, name
            assert float(g.norm()) > 0


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ep1", "tp2_sp", "tp2_sp_ep2_etp1"])
def test_replay_off_routes_by_itself(pools, init_moe, name):
    layout, world = LAYOUTS[name]
    off = pools(world).run(mb.replay_step, layout, family="qwen3moe", init=init_moe,
                           mode="off")[0]  # fmt: skip
    plain = pools(world).run(mb.replay_step, layout, family="qwen3moe", init=init_moe,
                             mode="none")[0]  # fmt: skip
    own = pools(1).run(mb.hf_reference, Layout(), family="qwen3moe", init=init_moe,
                       forced_routes=False)[0]  # fmt: skip
    assert torch.equal(off["logits"], plain["logits"])
    assert _rel(off["logits"], own["logits"]) < REL
    for name, g in off["router_grads"].items():
        assert _rel(g, own["router_grads"][name]) < REL
    assert all(a is not None and a < 0.75 for a in off["agree"])  # measured, not applied
    assert plain["agree"] == [None, None]
