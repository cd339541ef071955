"""Weights pushed from a TP=2 Megatron model into the embedded engine: the fp32 engine's behaviour
log-probs equal the trainer's; bf16 / fp16 / fp8 engines differ by a measured nonzero amount."""

import pytest

from megatron_p3o.parallel import Layout

from . import engine_bodies


@pytest.mark.distributed
def test_engine_logprobs_match_trainer_after_weight_sync(pools, record_property):
    reports = pools(2).run(engine_bodies.engine_vs_trainer, Layout(tp=2))
    rep = reports[0]
    assert rep["buckets"] > 1
    assert rep["fp32"]["max"] < 1e-5, rep
    for prec in ("bf16", "fp16", "fp8", "fp8_block"):
        assert rep[prec]["mean"] > 1e-5, (prec, rep)
        assert rep[prec]["version"] == 3
        record_property(f"mismatch_{prec}", rep[prec])
    assert rep["fp16"]["mean"] < rep["bf16"]["mean"] < rep["fp8"]["mean"], rep
    print({k: v for k, v in rep.items()})


@pytest.mark.distributed
@pytest.mark.parametrize("world,server_tp", [(1, 1), (2, 2)])
def test_colocated_push_round_trip(pools, world, server_tp):
    """Order on the server: release → resume weights → pause → begin → one IPC push per bucket
    (one payload per server TP rank, cache flush and version on the last) → end → continue →
    resume the KV cache."""
    import base64

    from ..sglang_standin import SGLangStandIn

    srv = SGLangStandIn(lambda body: ([1], [-0.1], "stop"))
    try:
        versions = pools(world).run(
            engine_bodies.colocated_push, Layout(), url=srv.url, server_tp=server_tp
        )
    finally:
        srv.close()
    assert versions == [4] * world
    pushes = [b for p, b in srv.routes if p == "/update_weights_from_tensor"]
    assert srv.paths() == [
        "/release_memory_occupation", "/resume_memory_occupation", "/pause_generation",
        "/begin_weight_update", *["/update_weights_from_tensor"] * len(pushes),
        "/end_weight_update", "/continue_generation", "/resume_memory_occupation",
    ]  # fmt: skip
    assert len(pushes) >= 1 and all(len(b["serialized_named_tensors"]) == server_tp for b in pushes)
    assert [b["flush_cache"] for b in pushes] == [False] * (len(pushes) - 1) + [True]
    assert pushes[-1]["weight_version"] == "4" and srv.version == "4" and not srv.released
    blobs = pushes[0]["serialized_named_tensors"]
    assert all(base64.b64decode(b) for b in blobs) and len(set(blobs)) == server_tp
