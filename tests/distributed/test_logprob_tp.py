"""vocab_parallel_logprobs at TP ∈ {1, 2, 4}: values, entropy and gradients equal a float64
``torch.log_softmax`` over the real (unpadded) vocabulary."""

import pytest
import torch

from megatron_p3o.runtime.parallel import Layout

from . import logprob_bodies as lb


def _reference(temperature, dtype=torch.float32, entropy=True, vocab=lb.VOCAB):
    logits, targets, w_lp, w_h = lb.full_inputs(vocab=vocab)
    x = logits.to(dtype).double().requires_grad_()
    logp = torch.log_softmax(x[..., :vocab] / temperature, -1)
    lp = logp.gather(-1, targets[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * w_lp).sum() + ((ent * w_h).sum() if entropy else 0.0)).backward()
    return lp.detach(), ent.detach(), x.grad


def _check(results, temperature, tol, dtype=torch.float32, entropy=True, vocab=lb.VOCAB):
    lp_ref, ent_ref, g_ref = _reference(temperature, dtype, entropy, vocab)
    tp = len({r["tp_rank"] for r in results})
    grad = torch.cat([next(r for r in results if r["tp_rank"] == k)["grad"] for k in range(tp)], -1)
    for r in results:
        assert (r["lp"] - lp_ref).abs().max() < tol
        if entropy:
            assert (r["ent"] - ent_ref).abs().max() < tol
    assert (grad.double() - g_ref).abs().max() < tol
    assert (grad[..., vocab:] == 0).all(), "padded columns got gradient"


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tp1(temperature, chunk, entropy, inplace):
    from types import SimpleNamespace

    groups = SimpleNamespace(layout=SimpleNamespace(tp=1), tp_rank=0, tp=None)
    res = lb.shard_logprobs(groups, temperature, chunk, inplace=inplace, entropy=entropy)
    _check([res], temperature, 1e-6, entropy=entropy)


def test_tp1_bf16_logits_accumulate_in_fp32():
    from types import SimpleNamespace

    groups = SimpleNamespace(layout=SimpleNamespace(tp=1), tp_rank=0, tp=None)
    res = lb.shard_logprobs(groups, 0.7, 7, dtype="bfloat16")
    lp_ref, ent_ref, _ = _reference(0.7, torch.bfloat16)
    assert res["lp"].dtype == torch.float32
    assert (res["lp"] - lp_ref).abs().max() < 1e-5 and (res["ent"] - ent_ref).abs().max() < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,chunk,inplace", [(2, None, False), (2, 5, True), (4, 8, False), (4, None, True)]
)
def test_tp_sharded(pools, world, chunk, inplace):
    results = pools(world).run(
        lb.shard_logprobs, Layout(tp=world), temperature=0.7, chunk_size=chunk, inplace=inplace
    )
    _check(results, 0.7, 1e-6)


@pytest.mark.distributed
def test_shards_of_padding_only(pools):
    """A tiny vocabulary at large TP: ranks 1–3 hold only padded columns (70 real of 320)."""
    results = pools(4).run(
        lb.shard_logprobs, Layout(tp=4), temperature=1.0, chunk_size=None, vocab=70
    )
    _check(results, 1.0, 1e-6, vocab=70)
