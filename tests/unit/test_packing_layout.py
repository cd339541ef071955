"""Token-budget partitions and the packed micro-batch layout (single process)."""

import itertools
import random

import pytest
import torch

from megatron_p3o.model.forward import nest_response
from megatron_p3o.model.packed import token_index
from megatron_p3o.types import Sample
from megatron_p3o.update.balance import imbalance, karmarkar_karp, pack_by_budget
from megatron_p3o.update.batching import packed_microbatch, padded_microbatches


def _lognormal(n, seed, median=300, cap=2048):
    rng = random.Random(seed)
    return [max(1, min(cap, int(rng.lognormvariate(0, 1) * median))) for _ in range(n)]


def _first_fit_decreasing(lengths, budget):
    bins = []
    for n in sorted(lengths, reverse=True):
        for b in bins:
            if sum(b) + n <= budget:
                b.append(n)
                break
        else:
            bins.append([n])
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_pack_by_budget_fits_covers_and_is_even(seed):
    lengths = _lognormal(200, seed)
    budget = 4096
    parts, oversize = pack_by_budget(lengths, budget)
    assert oversize == 0
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) <= budget
    # never more micro-batches than first-fit-decreasing needs, and far more even than FFD
    ffd = _first_fit_decreasing(lengths, budget)
    assert len(parts) <= len(ffd)
    assert imbalance(loads) <= imbalance([sum(b) for b in ffd])
    assert imbalance(loads) < 0.05, loads


def test_oversize_sample_gets_its_own_microbatch():
    parts, oversize = pack_by_budget([10, 50, 20, 5], budget=30)
    assert oversize == 1 and [1] in parts
    assert all(sum([10, 50, 20, 5][i] for i in p) <= 30 for p in parts if p != [1])


def test_min_count_pads_with_empty_microbatches():
    parts, _ = pack_by_budget([5, 3], budget=100, min_count=3)
    assert len(parts) == 3 and sorted(i for p in parts for i in p) == [0, 1]


def _lpt(w, k):
    """Greedy reference: heaviest item first onto the lightest part."""
    loads = [0] * k
    for x in sorted(w, reverse=True):
        loads[loads.index(min(loads))] += x
    return max(loads) - min(loads)


@pytest.mark.parametrize("k", [2, 3])
def test_karmarkar_karp_against_exhaustive_optimum_and_greedy(k):
    """Every index once; spread never above the heaviest item; the exact optimum (enumerated)
    in most small cases, and better than greedy on average."""
    rng = random.Random(k)
    kk_spread, lpt_spread, optimal = [], [], 0
    for _ in range(40):
        w = [rng.randint(1, 50) for _ in range(8)]
        parts = karmarkar_karp(w, k)
        assert sorted(i for p in parts for i in p) == list(range(len(w)))
        loads = [sum(w[i] for i in p) for p in parts]
        spread = max(loads) - min(loads)
        assert spread <= max(w)
        best = min(
            max(ld) - min(ld)
            for assign in itertools.product(range(k), repeat=len(w))
            for ld in [[sum(x for x, a in zip(w, assign) if a == j) for j in range(k)]]
        )
        optimal += spread == best
        kk_spread.append(spread)
        lpt_spread.append(_lpt(w, k))
    assert optimal >= 20, optimal
    assert sum(kk_spread) < sum(lpt_spread), (sum(kk_spread), sum(lpt_spread))


def _sample(prompt, completion, lb=None, group=0):
    lb = lb if lb is not None else [-0.5 - 0.1 * i for i in range(len(completion))]
    return Sample(prompt, completion, lb, "stop", 0, group_id=group)


def test_packed_layout_restarts_positions_and_never_predicts_across_sequences():
    samples = [_sample([11, 12], [13, 14, 15]), _sample([21], [22]), _sample([31, 32, 33], [34])]
    mb = packed_microbatch(samples, [1.0, -2.0, 0.5], [7, 8, 9], 16, pad_id=0, align=4, multiple=4)
    cu = mb["cu_seqlens"].tolist()
    assert cu == [0, 8, 12, 16]  # lengths 5, 2, 4 rounded up to multiples of 2·cp = 4
    tgt, pos = mb["targets"][0], mb["position_ids"][0]
    for a, b in zip(cu[:-1], cu[1:]):
        assert pos[a:b].tolist() == list(range(b - a))
        assert tgt[b - 1] == 0  # the last position of a sequence predicts nothing
    r = mb["response"]
    # every completion token's scoring position holds the token before it and targets it
    for i, s in enumerate(samples):
        c = len(s.completion_ids)
        idx = r["index"][i, :c]
        assert tgt[idx].tolist() == s.completion_ids
        assert r["mask"][i].sum() == c
        assert torch.allclose(r["behavior_logprobs"][i, :c], torch.tensor(s.logprobs))
    assert r["sample_index"].tolist() == [7, 8, 9]
    assert torch.equal(r["advantages"][1, :1], torch.tensor([-2.0]))


def test_pipeline_pad_to_adds_an_unscored_filler_sequence():
    mb = packed_microbatch([_sample([1, 2], [3])], [1.0], [0], 16, align=2, multiple=2, pad_to=10)
    assert mb["tokens"].shape == (1, 10)
    assert mb["cu_seqlens"].tolist() == [0, 4, 10]
    assert mb["response"]["mask"].sum() == 1


def test_padded_and_packed_response_tensors_agree():
    samples = [_sample([1, 2], [3, 4, 5]), _sample([6], [7, 8])]
    (pad,) = padded_microbatches(samples, [0.3, -0.7], seq_length=8, micro_batch_size=2)
    pk = packed_microbatch(samples, [0.3, -0.7], [0, 1], 8)
    for k in ("mask", "behavior_logprobs", "advantages", "sample_index"):
        assert torch.equal(pad["response"][k], pk["response"][k]), k
    # the index points at the same (sequence, position) in either grid
    grid_pad = pad["targets"].reshape(-1)[pad["response"]["index"]]
    grid_pk = pk["targets"].reshape(-1)[pk["response"]["index"]]
    m = pad["response"]["mask"] > 0
    assert torch.equal(grid_pad[m], grid_pk[m])


def test_flat_padded_microbatch_is_nested_in_place():
    mb = {
        "tokens": torch.zeros(2, 4, dtype=torch.long),
        "targets": torch.zeros(2, 4, dtype=torch.long),
        "loss_mask": torch.ones(2, 4),
        "behavior_logprobs": torch.zeros(2, 4),
        "advantages": torch.ones(2, 4),
    }
    nest_response(mb)
    assert set(mb) == {"tokens", "targets", "response"}
    assert mb["response"]["index"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("cu", [None, [0, 4, 12, 16]])
def test_cp_token_index_partitions_the_grid(cu):
    cu_t = torch.tensor(cu) if cu else None
    shape = (1, 16) if cu else (2, 8)
    parts = [token_index(shape, cu_t, r, 2) for r in range(2)]
    assert sorted(torch.cat(parts).tolist()) == list(range(16))
    assert parts[0].numel() == parts[1].numel() == 8
    if cu:  # chunks r and 2cp−1−r of every sequence (length 4 → chunks of 1)
        assert parts[0].tolist()[:2] == [0, 3]
