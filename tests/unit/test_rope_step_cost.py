"""The packed RoPE's cos and sin taken once per micro-batch (``mcore_compat``, issue 55) against
Megatron's own ``_apply_rotary_pos_emb_thd``, bit for bit, values and gradients, beyond
``test_mcore_compat_rope.py``'s cases: a pass-through part (rotary dimension below the head
size), ``mscale``, bf16 inputs, and q, k and every layer reusing the pair only for the same
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


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("rot,mscale,dtype", [(8, 1.0, torch.float32), (16, 0.7, torch.float32),
                                              (16, 1.0, torch.bfloat16)])  # fmt: skip
def test_equals_megatrons_function_bitwise(both, rot, mscale, dtype):
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
