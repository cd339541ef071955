"""Weights pushed from a TP=2 Megatron model into the embedded engine: the fp32 engine's behaviour
log-probs equal the trainer's; bf16 / fp16 / fp8 engines differ by a measured nonzero amount."""

import pytest
import torch

from megatron_p3o.runtime.parallel import Layout

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


# TP 2, EP 2, expert-TP 1: the dense TP rank 1 holds experts E/2…E−1 whole (issue 52, item 3)
EP_ETP1 = Layout(tp=2, ep=2, etp=1, sequence_parallel=True)


def _experts_complete(names, family="qwen3moe"):
    """Every routed expert of every layer is among ``names`` (the reference is complete)."""
    from megatron_p3o.model.hf.mapping import parse_moe_hf_name

    from .bodies import desc_of

    d = desc_of(family)
    seen = {parse_moe_hf_name(n)[:2] for n in names if parse_moe_hf_name(n) is not None}
    want = {(la, e) for la in range(d.num_layers) for e in range(d.num_experts)}
    return want <= seen


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,layout,family,server_tp",
    [
        (1, Layout(), "llama", 1),
        (2, Layout(pp=2), "llama", 2),
        (2, Layout(tp=2), "llama", 1),
        (2, Layout(ep=2), "qwen3moe", 2),
        (2, EP_ETP1, "qwen3moe", 2),
        (2, EP_ETP1, "qwen3moe", 1),
        (4, EP_ETP1, "qwen3moe", 2),
    ],
    ids=["w1", "pp2", "tp2-server-tp1", "ep2", "tp2-ep2-etp1", "tp2-ep2-etp1-server-tp1",
         "tp2-ep2-etp1-dp2"],
)  # fmt: skip
def test_colocated_push_round_trip(pools, world, layout, family, server_tp):
    """Order on the server (issue 52, item 6): pause → release → resume weights → begin → one
    IPC push per bucket (one payload per server TP rank, cache flush and version on the last)
    → end → resume every other region released → continue. Every payload r holds, over the
    buckets, the whole model exactly as the all-gather path makes it (every expert: item 3); no
    rank held more than a bucket (plus one tensor) at a time, and none called
    ``TrainerWeights.full`` (issue 42, item 2); the regions resumed are the ones released, as
    the pinned release reads the bodies. The second push takes one broadcast per bucket and a
    fixed number of world-wide rounds per bucket, not two per tensor (item 8)."""
    import base64
    import pickle

    from ..sglang_standin import SGLangStandIn
    from ..unit.test_sglang_protocol import released_tags, wheel_memory_tags

    bucket = 64 * 1024
    srv = SGLangStandIn(lambda body: ([1], [-0.1], "stop"))
    try:
        out = pools(world).run(
            engine_bodies.colocated_push, layout, url=srv.url, server_tp=server_tp,
            family=family, bucket_bytes=bucket,
        )  # fmt: skip
    finally:
        srv.close()
    assert [o[0] for o in out] == [4] * world
    reference = out[0][1]
    if family == "qwen3moe":
        assert _experts_complete(reference)
    paths = srv.paths()
    second = len(paths) - 1 - paths[::-1].index("/pause_generation")
    pushes = [b for p, b in srv.routes[second:] if p == "/update_weights_from_tensor"]
    assert paths[second:] == [
        "/pause_generation", "/release_memory_occupation", "/resume_memory_occupation",
        "/begin_weight_update", *["/update_weights_from_tensor"] * len(pushes),
        "/end_weight_update", "/resume_memory_occupation", "/continue_generation",
    ]  # fmt: skip
    bodies = [b for p, b in srv.routes[second:] if "memory_occupation" in p]
    released = released_tags(bodies[0])
    resumed = [released_tags(b) for b in bodies[1:]]
    assert released == set(wheel_memory_tags()) == resumed[0] | resumed[1], (released, resumed)
    assert "weights" in resumed[0] and not resumed[0] & resumed[1]
    assert len(pushes) > 1 and all(len(b["serialized_named_tensors"]) == server_tp for b in pushes)
    assert [b["flush_cache"] for b in pushes] == [False] * (len(pushes) - 1) + [True]
    assert pushes[-1]["weight_version"] == "4" and srv.version == "4" and not srv.released
    # issue 63, item 3: no payload tensor is a parameter's own storage (TP = 1 included)
    assert all(o[3]["aliased"] == 0 for o in out), [o[3]["aliased"] for o in out]
    for r in range(server_tp):  # each server rank's payloads: the whole model, once
        got = {}
        for b in pushes:
            for name, t in pickle.loads(base64.b64decode(b["serialized_named_tensors"][r])):
                assert name not in got, name
                got[name] = t
        assert sorted(got) == sorted(reference)
        for name, t in reference.items():
            assert torch.equal(got[name], t), name
    largest = max(t.numel() * t.element_size() for t in reference.values())
    assert max(o[2] for o in out) <= bucket + largest
    stats = out[0][3]
    n_buckets, n_tensors = stats["buckets"], stats["tensors"]
    assert len(pushes) == n_buckets < n_tensors / 2, (len(pushes), n_buckets, n_tensors)
    for o in out:  # the second push: no table exchange, a broadcast per bucket at most
        calls = o[3]["calls"]
        assert calls.get("all_gather_objects", 0) == 0, calls
        assert calls.get("broadcast", 0) <= n_buckets, calls
        assert calls["gather_objects"] == n_buckets and calls["barrier"] == n_buckets + 2, calls


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,layout", [(2, EP_ETP1), (4, EP_ETP1), (2, Layout(ep=2))],
    ids=["tp2-ep2-etp1", "tp2-ep2-etp1-dp2", "ep2"],
)  # fmt: skip
def test_the_stream_to_rank0_carries_every_expert(pools, world, layout):
    """Issue 52, item 3: the push to rank 0 (gloo group, tensor payloads, disk) where the dense
    TP rank 1 holds half the experts whole: rank 0 gets every tensor of the model once, equal
    bit for bit to the all-gather path's; it used to wait forever for rank 1's experts."""
    out = pools(world).run(engine_bodies.stream_push, layout)
    rank0 = next(o for o in out if o["rank"] == 0)
    names = [n for n, _ in rank0["got"]]
    assert len(names) == len(set(names)) and set(names) == set(rank0["full"])
    assert _experts_complete(names)
    for name, t in rank0["got"]:
        assert torch.equal(t, rank0["full"][name]), name
    assert all(o["got"] == [] for o in out if o["rank"] != 0)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4], ids=["w2", "w4"])
def test_a_silent_expert_rank_is_named_not_waited_for(pools, world):
    """The bounded wait: an EP rank that never sends its experts stops the stream's sender
    within the wait with an error naming that rank (global rank 1 here), never a hang."""
    out = pools(world).run(engine_bodies.stream_missing_peer, EP_ETP1, wait_s=2.0)
    err = next(o for o in out if o["rank"] == 0)["error"]
    assert err is not None and "global rank 1 within 2 s" in err, err
    assert all(o["error"] is None for o in out if o["rank"] != 0)


@pytest.mark.distributed
def test_a_pp2_stream_keeps_one_bucket_per_stage_in_flight(pools):
    """Issue 42, item 4: rank 0 pushes stage 0 slowly while stage 1 would stream ahead; with
    sends that do not block (NCCL's), stage 1 used to export and send its whole stage at once.
    Now it sends a bucket only when rank 0 asks: the bytes stage 1 has exported that rank 0 has
    not yet taken never exceed two buckets (the one pushed, the one asked for; each may end
    one tensor over the size); and rank 0 still gets every tensor of the model, exactly."""
    bucket = 8 * 1024
    out = pools(2).run(engine_bodies.stream_in_flight, Layout(pp=2), bucket_bytes=bucket)
    rank0 = next(o for o in out if o["rank"] == 0)
    stage1 = next(o for o in out if o["pp"] == 1)
    names1 = {n for _, _, n in stage1["produced"]}
    events = [(t, b) for t, b, _ in stage1["produced"]]
    events += [(t, b) for t, b, n in rank0["taken"] if n in names1]
    alive = peak = 0
    for _, b in sorted(events):
        alive += b
        peak = max(peak, alive)
    largest = max(b for _, b, _ in stage1["produced"])
    whole = sum(b for _, b, _ in stage1["produced"])
    print(f"stage 1: {whole} bytes, peak in flight {peak} (bucket {bucket})")
    assert whole > 4 * bucket  # the stage is many buckets: a pile-up would show
    assert peak <= 2 * (bucket + largest), (peak, whole)
    got = {n for _, _, n in rank0["taken"]}
    assert got == set(rank0["full"]) and len(rank0["taken"]) == len(got)
