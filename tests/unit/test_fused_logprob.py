"""The fused output layer + log-prob kernel at TP=1 against a float64 ``torch.log_softmax`` of
``h·Wᵀ`` (values, entropy, log-partition and the gradients w.r.t. h and W), against today's
kernel on materialised logits, and its chunking (bitwise run to run; how the chunk size moves
the rounding)."""

import pytest
import torch

from megatron_p3o.logprob.fused import fused_vocab_parallel_logprobs
from megatron_p3o.logprob.kernels import vocab_parallel_logprobs

B, S, D, VPAD, VOCAB = 3, 37, 24, 320, 300
REL = 1e-6


def inputs(seed=0, dtype=torch.float32):
    """h ``[B, S, D]``, W ``[VPAD, D]`` (padding rows large: they must not count), targets and
    the loss weights of ℓ, H and lse, all rounded to ``dtype`` first."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, S, D, generator=g).to(dtype)
    w = (0.4 * torch.randn(VPAD, D, generator=g)).to(dtype)
    w[VOCAB:] = 3.0
    t = torch.randint(0, VOCAB, (B, S), generator=g)
    wts = torch.randn(3, B, S, generator=g)
    return h, w, t, wts


def reference(h, w, t, wts, temperature, extra=()):
    """float64 ℓ, H, lse and ∂(Σ w₀ℓ + w₁H + w₂lse)/∂(h, W, extra…)."""
    leaves = [x.double().requires_grad_() for x in (h, w, *[a for pair in extra for a in pair])]
    z = leaves[0] @ leaves[1].t()
    for i in range(len(extra)):
        z = z + leaves[2 + 2 * i] @ leaves[3 + 2 * i].t()
    z = z[..., :VOCAB] / temperature
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, t[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    lse = torch.logsumexp(z, -1)
    ((lp * wts[0]).sum() + (ent * wts[1]).sum() + (lse * wts[2]).sum()).backward()
    return lp.detach(), ent.detach(), lse.detach(), [x.grad for x in leaves]


def rel(a, b) -> float:
    """max |a − b| / max |b| (the tests' relative error)."""
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))


def fused(h, w, t, wts, temperature, chunk, extra=(), entropy=True, lse=True, keep=False):
    leaves = [x.clone().requires_grad_() for x in (h, w, *[a for pair in extra for a in pair])]
    pairs = [(leaves[2 + 2 * i], leaves[3 + 2 * i]) for i in range(len(extra))]
    out = fused_vocab_parallel_logprobs(
        leaves[0], leaves[1], t, None, temperature, chunk, entropy, VOCAB, lse, extra=pairs,
        keep_logits=keep,
    )  # fmt: skip
    loss = (out[0] * wts[0]).sum()
    if entropy:
        loss = loss + (out[1] * wts[1]).sum()
    if lse:
        loss = loss + (out[2] * wts[2]).sum()
    loss.backward()
    return [o.detach() if o is not None else None for o in out], [x.grad for x in leaves]


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("chunk", [None, 5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_float64_reference(temperature, chunk, keep):
    h, w, t, wts = inputs()
    lp_r, ent_r, lse_r, (gh_r, gw_r) = reference(h, w, t, wts, temperature)
    (lp, ent, lse), (gh, gw) = fused(h, w, t, wts, temperature, chunk, keep=keep)
    errs = [rel(lp, lp_r), rel(ent, ent_r), rel(lse, lse_r), rel(gh, gh_r), rel(gw, gw_r)]
    assert max(errs) < REL, errs
    assert (gw[VOCAB:] == 0).all(), "padded vocabulary rows got gradient"


def test_extra_term_equals_float64_reference():
    """R2PO's z^μ = h·Wᵀ + x·W₂ᵀ as a second term."""
    h, w, t, wts = inputs()
    g = torch.Generator().manual_seed(1)
    x, w2 = torch.relu(torch.randn(B, S, 8, generator=g)), 0.3 * torch.randn(VPAD, 8, generator=g)
    lp_r, ent_r, lse_r, grads_r = reference(h, w, t, wts, 0.7, extra=[(x, w2)])
    (lp, ent, lse), grads = fused(h, w, t, wts, 0.7, 7, extra=[(x, w2)])
    errs = [rel(lp, lp_r), rel(ent, ent_r), rel(lse, lse_r)]
    errs += [rel(a, b) for a, b in zip(grads, grads_r)]
    assert max(errs) < REL, errs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_unfused_kernel(temperature):
    """Today's kernel on materialised logits h·Wᵀ: the same values (both combine in float64
    from the same fp32 steps) and gradients."""
    h, w, t, wts = inputs()
    (lp, ent, lse), (gh, gw) = fused(h, w, t, wts, temperature, None)
    hu, wu = h.clone().requires_grad_(), w.clone().requires_grad_()
    lpu, entu, lseu = vocab_parallel_logprobs(
        hu @ wu.t(), t, None, temperature, None, True, VOCAB, with_lse=True
    )
    ((lpu * wts[0]).sum() + (entu * wts[1]).sum() + (lseu * wts[2]).sum()).backward()
    assert rel(lp, lpu) < 1e-7 and rel(ent, entu) < 1e-7 and rel(lse, lseu) < 1e-7
    assert rel(gh, hu.grad) < REL and rel(gw, wu.grad) < REL


def test_bitwise_run_to_run_and_chunk_rounding():
    """The same chunk size: bitwise-identical values and gradients; another chunk size: the
    per-token values move only through the matmul's rounding, dW through its summation order."""
    h, w, t, wts = inputs()
    a = fused(h, w, t, wts, 0.7, 16)
    b = fused(h, w, t, wts, 0.7, 16)
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)
    c = fused(h, w, t, wts, 0.7, 5)
    for x, y in zip(a[0] + a[1], c[0] + c[1]):
        assert rel(x, y) < 1e-6


@pytest.mark.parametrize("dtype,extra,chunk", [(torch.float32, False, 16),
                                               (torch.float32, True, 5),
                                               (torch.bfloat16, False, 5)])  # fmt: skip
def test_kept_logits_give_the_recomputed_backward_bit_for_bit(dtype, extra, chunk):
    """``keep_logits``: the backward starts from the forward's own chunk logits instead of a
    matmul again: the same values and gradients bit for bit (run against run; chunks of 5 rows
    of 300 put them at unaligned offsets of the kept buffer)."""
    h, w, t, wts = inputs(dtype=dtype)
    g = torch.Generator().manual_seed(2)
    pairs = [(torch.randn(B, S, 8, generator=g).to(dtype), torch.randn(VPAD, 8, generator=g).to(
        dtype))] if extra else []  # fmt: skip
    a = fused(h, w, t, wts, 0.7, chunk, extra=pairs, keep=False)
    for _ in range(2):  # the second forward reuses the memory the first backward handed back
        b = fused(h, w, t, wts, 0.7, chunk, extra=pairs, keep=True)
        for x, y in zip(a[0] + a[1], b[0] + b[1]):
            assert torch.equal(x, y)


def test_kept_logits_memory_is_reused_and_a_retained_graph_recomputes():
    from megatron_p3o.logprob import fused as fused_mod

    h, w, t, wts = inputs()
    pool = fused_mod._KEPT
    pool.free.clear()
    pool.give(torch.empty(7))  # too small for the next forward, kept anyway
    fused(h, w, t, wts, 1.0, 16, keep=True)
    assert [b.numel() for b in pool.free] == [B * S * VOCAB, 7]
    pool.free.pop()
    assert fused_mod.kept_logits_pooled_bytes() == B * S * VOCAB * 4  # handed back
    with torch.no_grad():  # no gradient: nothing kept, nothing taken
        fused_vocab_parallel_logprobs(h, w, t, vocab_size=VOCAB, keep_logits=True)
    assert len(pool.free) == 1
    # a retained graph's second backward no longer has the logits: it recomputes them
    hh = h.clone().requires_grad_()
    lp, _ = fused_vocab_parallel_logprobs(hh, w, t, vocab_size=VOCAB, keep_logits=True)
    assert not pool.free  # in use until the backward
    (lp * wts[0]).sum().backward(retain_graph=True)
    first = hh.grad.clone()
    pool.free[0].fill_(float("nan"))  # the memory is another forward's now
    hh.grad = None
    (lp * wts[0]).sum().backward()
    assert torch.equal(hh.grad, first)


def test_bf16_weights_accumulate_in_fp32():
    """bf16 h and W: logits formed in bf16 (as the unfused output layer's), statistics in fp32
    and float64; against float64 of the same bf16 inputs."""
    h, w, t, wts = inputs(dtype=torch.bfloat16)
    lp_r, ent_r, _, _ = reference(h, w, t, wts, 0.7)
    (lp, ent, _), (gh, gw) = fused(h, w, t, wts, 0.7, 9)
    assert lp.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    assert rel(lp, lp_r) < 1e-2 and rel(ent, ent_r) < 1e-2


def test_without_entropy_and_lse():
    h, w, t, wts = inputs()
    (lp, ent), _ = fused(h, w, t, wts, 1.0, None, entropy=False, lse=False)
    assert ent is None
    lp_r = reference(h, w, t, wts, 1.0)[0]
    assert rel(lp, lp_r) < REL


def test_shape_errors():
    h, w, t, _ = inputs()
    with pytest.raises(ValueError, match="disagree"):
        fused_vocab_parallel_logprobs(h, w, t[:, :-1])
    with pytest.raises(ValueError, match="does not fit"):
        fused_vocab_parallel_logprobs(h, w[:, :-1], t)
    with pytest.raises(ValueError, match="temperature"):
        fused_vocab_parallel_logprobs(h, w, t, temperature=0.0)
