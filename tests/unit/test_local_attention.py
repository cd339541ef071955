"""The local spec's packed attention without CP: windows of sequences, one block-diagonal SDPA
each, against a float64 per-sequence softmax attention written out here (no SDPA)."""

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_p3o.model import local_attention
from megatron_p3o.model.local_attention import LocalCoreAttention


def _core(kv_channels=8):
    core = LocalCoreAttention.__new__(LocalCoreAttention)
    torch.nn.Module.__init__(core)
    core.cp_group, core.softmax_scale = None, 1.0 / math.sqrt(kv_channels)
    return core


def _reference(q, k, v, cu, scale):
    """float64 causal attention of each sequence alone; GQA by repeating K/V heads."""
    out = []
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1], cu[1:]):
        qs, ks, vs = (x[a:b].double().transpose(0, 1) for x in (q, k, v))  # [h, L, d]
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        s = qs @ ks.transpose(1, 2) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out.append((s.softmax(-1) @ vs).transpose(0, 1).reshape(b - a, -1))
    return torch.cat(out)


def _inputs(lengths, heads=4, groups=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (heads, groups, groups))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                             cu_seqlens_kv=torch.tensor(cu, dtype=torch.int32))  # fmt: skip
    return q, k, v, cu, params


@pytest.mark.parametrize("window", [4096, 20, 1])  # one window, several, one sequence each
def test_windows_equal_the_float64_per_sequence_reference(monkeypatch, window):
    monkeypatch.setattr(local_attention, "PACK_WINDOW", window)
    lengths = [9, 15, 1, 12, 7, 30, 11]
    q, k, v, cu, params = _inputs(lengths)
    core = _core()
    out = core(q, k, v, None, packed_seq_params=params)
    ref = _reference(q, k, v, cu, core.softmax_scale)
    assert out.shape == (sum(lengths), 4 * 8)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_other_sequences_of_a_window_cannot_change_a_sequence_bitwise():
    lengths = [9, 15, 12, 7]
    q, k, v, cu, params = _inputs(lengths)
    core = _core()
    out = core(q, k, v, None, packed_seq_params=params)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):  # every sequence but the third gets other values
        x[: cu[2]] = 1e3 * torch.randn_like(x[: cu[2]])
        x[cu[3] :] = -1e3
    out2 = core(q2, k2, v2, None, packed_seq_params=params)
    assert torch.equal(out[cu[2] : cu[3]], out2[cu[2] : cu[3]])
    assert not torch.equal(out[: cu[2]], out2[: cu[2]])


def test_gradients_equal_the_reference():
    lengths = [5, 13, 8]
    q, k, v, cu, params = _inputs(lengths, seed=3)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    core = _core()
    w = torch.randn(sum(lengths), 32, generator=torch.Generator().manual_seed(1))
    (core(q, k, v, None, packed_seq_params=params) * w).sum().backward()
    got = [x.grad.clone() for x in (q, k, v)]
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    (_reference(qd, kd, vd, cu, core.softmax_scale) * w.double()).sum().backward()
    for a, b in zip(got, (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
