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
