"""ReVal's loss and gradient, the kernel's log-partition, R2PO's rarity advantage and phase
schedule, the trajectory FIFO: each against a float64 (or plain-Python) computation written
here from the papers' formulas."""

import math

import pytest
import torch

from megatron_p3o.advantage.estimators import rarity_advantages
from megatron_p3o.loss import policy_loss, vocab_parallel_logprobs
from megatron_p3o.rollout.replay import ReplayConfig, TrajectoryFIFO
from megatron_p3o.types import Sample
from megatron_p3o.update.r2po import R2POConfig

B, T = 5, 6


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = (-1.5 + 0.7 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    lref = lp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[1] = 0.0  # a sequence without valid tokens: outside the mean
    mask[0, :2] = 1.0
    v = (2.0 + torch.randn(B, generator=g, dtype=torch.float64)).requires_grad_()
    vref = v.detach() + 0.5 * torch.randn(B, generator=g, dtype=torch.float64)
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1])
    return lp, lref, mask, v, vref, r, groups


def _grads(loss, *xs):
    gs = torch.autograd.grad(loss, xs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(xs, gs)]


@pytest.mark.parametrize("value_grad", [True, False])
@pytest.mark.parametrize("reward", ["centered", "raw"])
def test_reval_loss_and_gradient_float64(value_grad, reward):
    beta = 0.25
    lp, lref, mask, v, vref, r, groups = _data()
    # reference, written from the paper: δ = V_θ − V_ref + Σ_h (ℓθ − ℓref) − r/β, mean δ²
    rr = r.clone()
    if reward == "centered":
        for g in groups.unique():
            rr[groups == g] = r[groups == g] - r[groups == g].mean()
    deltas = []
    for i in range(B):
        if mask[i].sum() == 0:
            continue
        vi = v[i] if value_grad else v[i].detach()
        chain = sum((lp[i, t] - lref[i, t]) for t in range(T) if mask[i, t] > 0)
        deltas.append(vi - vref[i] + chain - rr[i] / beta)
    want = torch.stack(deltas).pow(2).mean()
    g_lp, g_v = _grads(want, lp, v)

    from megatron_p3o.loss.reval import ReValConfig, reval_rewards

    adv = reval_rewards(r, groups, ReValConfig(beta=beta, reward=reward))
    got, metrics = policy_loss(
        "reval", lp, lp.detach(), adv, mask, ref_logprobs=lref, values=v, ref_values=vref,
        beta=beta, value_grad=value_grad, reward=reward,
    )  # fmt: skip
    h_lp, h_v = _grads(got, lp, v)
    assert abs(float(got) - float(want)) < 1e-6 * float(want)
    assert torch.allclose(h_lp * mask, g_lp * mask, rtol=1e-5, atol=1e-9)
    assert torch.allclose(h_v, g_v, rtol=1e-5, atol=1e-9)
    if not value_grad:
        assert float(h_v.abs().max()) == 0.0
    assert metrics["reval_abs_delta"] > 0


def test_reval_needs_its_inputs():
    lp, lref, mask, v, vref, r, groups = _data()
    with pytest.raises(ValueError, match="ref_values"):
        policy_loss("reval", lp, lp.detach(), r, mask, ref_logprobs=lref, values=v)


def test_kernel_log_partition_and_its_gradient():
    """lse = log Σ exp(z/T) from the kernel, and ∂/∂z, against torch float64 (padded vocab)."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 4, 40, generator=g).requires_grad_()
    t = torch.randint(0, 37, (3, 4), generator=g)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    u = torch.randn(3, 4, generator=g, dtype=torch.float64)
    for temp in (1.0, 0.7):
        lp, _, lse = vocab_parallel_logprobs(z, t, temperature=temp, vocab_size=37, with_lse=True)
        (gz,) = torch.autograd.grad((lp.double() * w + lse.double() * u).sum(), z)
        zd = z.detach().double()[..., :37].requires_grad_()
        ls = torch.log_softmax(zd / temp, -1)
        want_lse = torch.logsumexp(zd / temp, -1)
        want = (ls.gather(-1, t[..., None])[..., 0] * w + want_lse * u).sum()
        (gd,) = torch.autograd.grad(want, zd)
        assert float((lse.double() - want_lse).abs().max()) < 1e-5
        assert float((gz[..., :37].double() - gd).abs().max()) < 1e-5
        assert float(gz[..., 37:].abs().max()) == 0.0


def _rarity_python(rewards, groups, eps=1e-6):
    out = [math.nan] * len(rewards)
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = [rewards[i] for i in idx]
        if len(set(r)) == 1:
            continue
        c = [1.0 / r.count(x) for x in r]
        mean = sum(c) / len(c)
        std = math.sqrt(sum((x - mean) ** 2 for x in c) / len(c))
        for i, x in zip(idx, c):
            out[i] = (x - mean) / (std + eps)
    return out


def test_rarity_advantage():
    rewards = [1, 0, 0, 0, 1, 1, 1, 1, 0.5, 0, 0.5, 1]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    got = rarity_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups))
    want = _rarity_python(rewards, groups)
    for a, b in zip(got.tolist(), want):
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) < 1e-12, (got, want)
    assert got[0] > 0 > got[1]  # the one correct answer of group 0 is the rare one
    assert all(math.isnan(x) for x in got[4:8].tolist())  # all-equal group: skipped


def test_r2po_round_schedule():
    cfg = R2POConfig(enabled=True, head_steps=2, policy_steps=3)
    assert [cfg.phase(s) for s in range(7)] == ["head"] * 2 + ["policy"] * 3 + ["head"] * 2
    with pytest.raises(ValueError, match="head_steps"):
        R2POConfig(head_steps=0, policy_steps=0)


def _sample(i):
    return Sample([1, 2], [3, i % 7 + 1], [-0.1, -0.2], "stop", i, group_id=i % 2, reward=1.0)


def test_fifo_evicts_oldest_draws_uniformly_and_roundtrips():
    fifo = TrajectoryFIFO(ReplayConfig(policy="fifo", fifo_capacity=6), seed=3, dp_rank=0)
    fifo.add([_sample(i) for i in range(4)], [0.1 * i for i in range(4)])
    assert fifo.draw(5, step=0) is None  # fewer than asked: no replay update yet
    fifo.add([_sample(i) for i in range(4, 8)], [0.1 * i for i in range(4, 8)])
    assert len(fifo) == 6 and [s.weight_version for s, _ in fifo.items] == list(range(2, 8))
    s1, a1 = fifo.draw(4, step=5)
    assert len({s.weight_version for s in s1}) == 4  # without replacement
    assert all(abs(a - 0.1 * s.weight_version) < 1e-12 for s, a in zip(s1, a1))
    again = TrajectoryFIFO(fifo.cfg, seed=3, dp_rank=0)
    again.load_state_dict(fifo.state_dict())
    s2, _ = again.draw(4, step=5)
    assert [s.weight_version for s in s1] == [s.weight_version for s in s2]  # resumable draws
    counts = [0] * 8
    for step in range(600):
        for s in fifo.draw(2, step=step)[0]:
            counts[s.weight_version] += 1
    assert counts[:2] == [0, 0] and min(counts[2:]) > 150  # uniform over what is kept (200 each)
