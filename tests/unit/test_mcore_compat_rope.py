"""The one-gather packed RoPE (``mcore_compat.packed_rope_in_one_gather``) against Megatron's own
``_apply_rotary_pos_emb_thd``: the same tensor bit for bit, values and gradients, in both of
Megatron's frequency layouts (max-length rows; a row per packed token); with cos and sin taken
once per micro-batch (issue 55): a pass-through part (rotary dimension below the head size),
``mscale``, bf16 inputs, and q, k and every layer reusing the pair only for the same
``cu_seqlens`` and ``freqs`` tensors."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_p3o.runtime import mcore_compat


class _Group:  # what the function reads of a CP group of one
    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.fixture(scope="module")
def both():
    mcore_compat.packed_rope_in_one_gather()
    fast = rope_utils._apply_rotary_pos_emb_thd
    return fast.p3o_megatrons, fast


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_equals_megatrons_function_bitwise(both, per_token, interleaved):
    megatrons, fast = both
    g = torch.Generator().manual_seed(0)
    lengths = [9, 1, 15, 12, 7]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    t_total = sum(lengths)
    d = 16
    rows = t_total if per_token else 32
    freqs = torch.randn(rows, 1, 1, d, generator=g)
    x = torch.randn(t_total, 4, d, generator=g)
    outs = []
    for fn in (megatrons, fast):
        xi = x.clone().requires_grad_()
        y = fn(xi, cu, freqs, rotary_interleaved=interleaved, cp_group=_Group())
        (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
        outs.append((y.detach(), xi.grad))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[1][0], x)  # it did rotate


def test_a_new_layout_of_the_same_length_is_not_served_stale_positions(both):
    megatrons, fast = both
    g = torch.Generator().manual_seed(1)
    freqs = torch.randn(32, 1, 1, 8, generator=g)
    x = torch.randn(20, 2, 8, generator=g)
    for lengths in ([10, 10], [10, 10], [3, 17], [20]):  # same tokens, other sequences
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        for _ in range(2):  # q, then k: the same cu tensor
            a = megatrons(x, cu, freqs, cp_group=_Group())
            assert torch.equal(a, fast(x, cu, freqs, cp_group=_Group())), lengths


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("rot,mscale,dtype", [(8, 1.0, torch.float32), (16, 0.7, torch.float32),
                                              (16, 1.0, torch.bfloat16)])  # fmt: skip
def test_pass_through_mscale_and_bf16_equal_megatrons_bitwise(both, rot, mscale, dtype):
    megatrons, fast = both
    g = torch.Generator().manual_seed(2)
    cu = _cu([5, 11, 1, 9])
    freqs = torch.randn(32, 1, 1, rot, generator=g)
    x = torch.randn(26, 4, 16, generator=g).to(dtype)
    w = torch.randn(26, 4, 16, generator=g).to(dtype)
    outs = []
    for fn in (megatrons, fast):
        grads, ys = [], []
        for _ in range(3):  # q, k, the next layer: the same cu_seqlens and freqs tensors
            xi = x.clone().requires_grad_()
            y = fn(xi, cu, freqs, mscale=mscale, cp_group=_Group())
            (y * w).float().sum().backward()
            ys.append(y.detach())
            grads.append(xi.grad)
        outs.append((ys, grads))
    for a, b in zip(outs[0][0] + outs[0][1], outs[1][0] + outs[1][1]):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_another_freqs_tensor_is_not_served_stale_cos_and_sin(both):
    megatrons, fast = both
    g = torch.Generator().manual_seed(3)
    cu = _cu([7, 7])
    x = torch.randn(14, 2, 8, generator=g)
    for _ in range(3):  # the same cu_seqlens tensor, a new freqs tensor each time
        freqs = torch.randn(16, 1, 1, 8, generator=g)
        assert torch.equal(megatrons(x, cu, freqs, cp_group=_Group()),
                           fast(x, cu, freqs, cp_group=_Group()))  # fmt: skip
