"""The CPU device shim rewrites CUDA requests where they are made, not by intercepting every torch
call: training steps of every layout (TP, PP, CP, DP, TP×PP, EP with the alltoall dispatcher)
run inside ``cpu_shim.strict()``, a mode that raises as soon as a CUDA device request reaches
torch past the shim. It also counts the torch calls of one optimizer step: under 15 % of them go
through the shim's wrappers (the mode it replaced saw every one)."""

import pytest

from megatron_p3o.runtime.parallel import Layout

from . import shim_bodies

CASES = [
    (2, Layout(tp=2), "llama", "allgather"),
    (2, Layout(pp=2), "llama", "allgather"),
    (2, Layout(cp=2), "llama", "allgather"),
    (2, Layout(dp=2), "llama", "allgather"),
    (4, Layout(tp=2, pp=2), "llama", "allgather"),
    (2, Layout(ep=2), "qwen3moe", "alltoall"),
]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,layout,family,dispatcher", CASES, ids=["tp2", "pp2", "cp2", "dp2", "tp2pp2", "ep2"]
)
def test_no_cuda_request_reaches_torch(pools, tmp_path, init_ckpts, world, layout, family,
                                       dispatcher):  # fmt: skip
    res = pools(world).run(
        shim_bodies.strict_training, layout, family=family, init=init_ckpts(family),
        out=str(tmp_path / "out"), dispatcher=dispatcher,
    )  # fmt: skip
    for r in res:
        print(f"{layout}: one step, torch calls {r['seen']}, through the shim {r['shim_calls']}")
        assert r["seen"] > 300 and r["shim_calls"] < 0.15 * r["seen"], r
        assert all(n == n and n > 0 for n in r["norms"])


@pytest.mark.distributed
def test_the_meta_device_context_still_reaches_every_factory(pools):
    """transformers builds models under ``with torch.device("meta")``; with the factories wrapped
    after torch had listed them, ``torch.tensor`` escaped it and RoPE buffers came out as
    uninitialised memory (the converter's verify mode saw it)."""
    (devices,) = pools(1).run(shim_bodies.meta_factories, Layout())
    assert devices == ["meta"] * 5
