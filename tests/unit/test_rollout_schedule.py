"""Rollout scheduling (sync / lagged / async staleness), DAPO dynamic sampling, the BAPO replay
buffer and DP-sharded prompt cursors.

The engine here is a recording double: it returns one token per completion and remembers which
weight version and prompts each generate call saw. The expected schedule is written in the test
from the rule "batch j uses weight version L·⌊(j−K)/L⌋ (≥ start)", not taken from the code.
"""

import json
import threading
import time

import pytest
import torch

from megatron_p3o.data.prompts import PromptData, remap_states
from megatron_p3o.rollout.config import RolloutConfig, RolloutShard
from megatron_p3o.rollout.engine import RolloutEngine
from megatron_p3o.rollout.replay import ReplayBuffer, ReplayConfig
from megatron_p3o.rollout.scheduler import (
    LoadWeights,
    NoWeights,
    Publication,
    RolloutScheduler,
)
from megatron_p3o.types import Group, Sample, SamplingParams


class Tok:
    bos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [int(text)]

    def __call__(self, texts, add_special_tokens=False):  # a batch, as transformers' tokenizers
        return {"input_ids": [self.encode(t) for t in texts]}


class RecordingEngine(RolloutEngine):
    def __init__(self, delay=0.0):
        self.weight_version, self.calls, self.loads, self.delay = -1, [], [], delay
        self.busy = threading.Lock()
        self.started = threading.Semaphore(0)  # released when a generate call begins

    def update_weights(self, buckets, version):
        list(buckets)
        self.loads.append(version)
        self.weight_version = version

    def health(self):
        return {"ok": True, "weight_version": self.weight_version}

    def generate(self, prompts, n, sampling):
        assert self.busy.acquire(blocking=False), "generate entered twice at once"
        self.started.release()
        try:
            time.sleep(self.delay)
            self.calls.append((self.weight_version, [p[0] for p in prompts], sampling.seed))
            g = torch.Generator().manual_seed(sampling.seed)
            return [
                Sample(
                    list(p),
                    [int(torch.randint(0, 9, (1,), generator=g))],
                    [-0.5],
                    "stop",
                    self.weight_version,
                    group_id=i,
                )
                for i, p in enumerate(prompts)
                for _ in range(n)
            ]
        finally:
            self.busy.release()


def data_file(tmp_path, n=40):
    p = tmp_path / "d.jsonl"
    # answer: "mixed" groups alternate 0/1 rewards; "zero"/"one" groups are all-equal
    kinds = ["mixed", "zero", "one", "mixed", "zero"]
    p.write_text(
        "".join(json.dumps({"prompt": str(i), "answer": kinds[i % 5]}) + "\n" for i in range(n))
    )
    return p


def score(samples, answers):
    out, seen = [], {}
    for s, a in zip(samples, answers):
        k = seen[s.group_id] = seen.get(s.group_id, -1) + 1
        out.append({"mixed": float(k % 2), "zero": 0.0, "one": 1.0}[a])
    return out


W = [("w", torch.zeros(2))]


def make(
    tmp_path, K=0, L=1, start=0, dynamic=False, rounds=3, engine=None, dp_rank=0, dp=1, prompts=4
):
    data = PromptData(str(data_file(tmp_path)), Tok(), seed=3, dp_rank=dp_rank, dp_size=dp)
    cfg = RolloutConfig(
        n_samples=2,
        sync_every=L,
        max_staleness=K,
        dynamic_sampling=dynamic,
        dynamic_max_rounds=rounds,
    )
    shard = RolloutShard(prompts=prompts, sampling=SamplingParams(max_new_tokens=1), seed=5)
    eng = engine or RecordingEngine()
    return RolloutScheduler(eng, data, score, cfg, shard, start, LoadWeights(W)), eng, data


def run_schedule(sched, steps, start=0, L=1):
    versions = []
    for s in range(start, start + steps):
        res = sched.next()
        versions.append({x.weight_version for g in res.groups for x in g.samples})
        sched.publish(Publication(s, s + 1, LoadWeights(W) if (s + 1) % L == 0 else NoWeights()))
    sched.stop()
    return versions


@pytest.mark.parametrize("K,L", [(0, 1), (0, 3), (1, 1), (2, 1), (2, 2)])
def test_weight_version_schedule(tmp_path, K, L):
    sched, eng, _ = make(tmp_path, K=K, L=L)
    got = run_schedule(sched, 9, L=L)
    expect = [{max(0, L * ((j - K) // L)) if j >= K else 0} for j in range(9)]
    assert got == expect
    assert max(j - min(v) for j, v in enumerate(got)) <= K + L - 1


def test_async_overlaps_and_matches_sync_batches(tmp_path):
    """K=1: batch j+1 is generated while step j trains, and its content equals what a
    synchronous run with the same (lagged) weight versions produces."""
    eng = RecordingEngine()
    (tmp_path / "a").mkdir()
    sched, _, _ = make(tmp_path / "a", K=1, engine=eng)
    first = sched.next()
    assert eng.started.acquire(timeout=60)  # batch 0
    for s in range(4):
        # "training" step s: with K=1 batch s+1 is generated meanwhile, before step s publishes.
        # No clock: a serial scheduler would never start it here and the wait would time out.
        if s < 3:
            assert eng.started.acquire(timeout=60), f"batch {s + 1} did not start during step {s}"
        sched.publish(Publication(s, s + 1, LoadWeights(W)))
        if s < 3:
            sched.next()
    sched.stop()
    (tmp_path / "b").mkdir()
    ref_eng = RecordingEngine()
    ref, _, _ = make(tmp_path / "b", K=0, engine=ref_eng)
    # same prompts and seeds in the same order; only the version labels follow the K=1 rule
    for j in range(4):
        ref.next()
        ref.publish(Publication(j, j + 1, LoadWeights(W)))
    assert [c[1:] for c in eng.calls[:4]] == [c[1:] for c in ref_eng.calls[:4]]
    assert [c[0] for c in eng.calls[:4]] == [0, 0, 1, 2]
    assert first.index == 0


def test_dynamic_sampling_refills_all_equal_groups(tmp_path):
    sched, eng, data = make(tmp_path, dynamic=True, rounds=5, prompts=5)
    res = sched.next()
    sched.stop()
    assert all(not g.homogeneous for g in res.groups)
    assert all(g.answer == "mixed" for g in res.groups)
    assert res.stats["dynamic_refilled"] == len(res.dropped) > 0
    assert {g.answer for g in res.dropped} <= {"zero", "one"}
    # the cursor moved past every prompt drawn: initial 5 + one per refill
    assert data.state_dict()["pos"] == 5 + len(res.dropped)


def test_dynamic_sampling_gives_up_after_max_rounds(tmp_path):
    sched, eng, _ = make(tmp_path, dynamic=True, rounds=1, prompts=5)
    res = sched.next()
    sched.stop()
    assert len(eng.calls) == 2 and res.stats["dynamic_rounds"] == 1
    assert len(res.groups) == 5


def test_scheduler_state_carries_batches_made_with_older_weights(tmp_path):
    """A checkpoint after step 0 with K=1: batch 1 was made with version 0, which a resumed run
    no longer has, so the checkpoint carries it whole; it also holds the cursor before batch 2
    and the re-evaluation request published at step 0 (batch 2 uses it). A scheduler restarted
    from that state (with version 1, the checkpoint's weights) trains on the same batch 1
    without generating it, and rolls out the same batch 2."""
    sched, eng, _ = make(tmp_path, K=1)
    sched.next()
    sched.publish(Publication(0, 1, LoadWeights(W), [(7, [7], "mixed")]))
    st = json.loads(json.dumps(sched.state_dict()))
    b1 = sched.next()
    sched.publish(Publication(1, 2, LoadWeights(W)))
    b2 = sched.next()
    sched.stop()
    assert st["pending"] == [{"step": 0, "version": 1, "reeval": [[7, [7], "mixed"]]}]
    assert [b["index"] for b in st["carried"]] == [1]
    assert b2.groups[0].index == 7 and b2.groups[0].source == "reeval"
    data = PromptData(str(data_file(tmp_path)), Tok(), seed=3)
    data.load_state_dict(st["data"])
    eng2 = RecordingEngine()
    again = RolloutScheduler(
        eng2, data, score, sched.cfg, sched.shard, 1, LoadWeights(W), st["pending"],
        st["carried"],
    )  # fmt: skip
    b1r = again.next()
    again.publish(Publication(1, 2, LoadWeights(W)))
    b2r = again.next()
    again.stop()
    # batch 1 was not generated again: the first call is batch 2, with version 1
    assert eng2.calls[0][0] == 1 and 0 not in [c[0] for c in eng2.calls]
    for x, y in ((b1, b1r), (b2, b2r)):
        assert [g.index for g in y.groups] == [g.index for g in x.groups]
        assert [(s.completion_ids, s.weight_version) for g in y.groups for s in g.samples] == [
            (s.completion_ids, s.weight_version) for g in x.groups for s in g.samples
        ]
    assert {s.weight_version for g in b1r.groups for s in g.samples} == {0}


def test_lagged_sync_state_keeps_the_older_weights(tmp_path):
    """L=2, K=0: after step 2 (version 3) batch 3 is still due from version 2's weights; the
    checkpoint's rollout weights are those (tensors and version); after step 3 (a sync point,
    version 4) there are none to keep. Restarted from the state, batch 3 is made with version 2
    and holds the re-evaluation published at step 2."""
    sched, eng, _ = make(tmp_path, L=2)
    w2 = [(n, t + 2) for n, t in W]
    for j in range(3):
        sched.next()
        v = j + 1
        w = LoadWeights(w2 if v == 2 else W) if v % 2 == 0 else NoWeights()
        sched.publish(Publication(j, v, w, [(7, [7], "mixed")] if j == 2 else []))
    ws, st = sched.weights_state(), sched.state_dict()
    assert ws["version"] == 2 and all(torch.equal(ws["tensors"][n], t) for n, t in w2)
    b3 = sched.next()
    sched.publish(Publication(3, 4, LoadWeights(W)))
    assert sched.weights_state() is None
    sched.stop()
    data = PromptData(str(data_file(tmp_path)), Tok(), seed=3)
    data.load_state_dict(st["data"])
    eng2 = RecordingEngine()
    again = RolloutScheduler(
        eng2, data, score, sched.cfg, sched.shard, 3, LoadWeights(list(ws["tensors"].items())),
        st["pending"], st["carried"], initial_version=2,
    )  # fmt: skip
    b3r = again.next()
    again.stop()
    assert eng2.loads == [2] and {s.weight_version for g in b3r.groups for s in g.samples} == {2}
    assert [g.index for g in b3r.groups] == [g.index for g in b3.groups]
    assert b3r.groups[0].index == 7 and b3r.stats["rollout_version"] == 2  # reeval, version 2


def _group(index, rewards, version=0, source="fresh"):
    return Group(
        index,
        [index],
        "a",
        [Sample([index], [1], [-0.1], "stop", version, reward=r) for r in rewards],
        source,
    )


def test_bapo_swaps_homogeneous_for_stored_and_reevaluates_difficult():
    buf = ReplayBuffer(ReplayConfig(policy="bapo", max_reuse=1, max_age=2, reeval_per_step=5))
    out, st = buf.compose([_group(1, [0, 1]), _group(2, [0, 0]), _group(3, [1, 1])], version=0)
    assert [g.index for g in out] == [1, 2, 3] and st["replay_groups"] == 0  # nothing stored yet
    out, st = buf.compose([_group(4, [1, 1]), _group(5, [0, 1])], version=1)
    assert (
        [g.index for g in out] == [1, 5] and out[0].source == "replay" and st["replay_groups"] == 1
    )
    # group 1 used twice = 1 + max_reuse: not offered again; group 5 is, until it is too old
    out, _ = buf.compose([_group(6, [0, 0]), _group(7, [1, 1])], version=2)
    assert [g.index for g in out] == [5, 7]
    out, _ = buf.compose([_group(8, [1, 1])], version=9)
    assert [g.index for g in out] == [8]  # everything stored is older than max_age
    assert [i for i, _, _ in buf.take_reeval()] == [2, 6]  # the all-wrong prompts, oldest first
    assert buf.take_reeval() == []


def test_bapo_state_round_trip():
    buf = ReplayBuffer(ReplayConfig(policy="bapo"))
    buf.compose([_group(1, [0, 1]), _group(2, [0, 0])], version=0)
    again = ReplayBuffer(ReplayConfig(policy="bapo"))
    again.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    out_a, _ = buf.compose([_group(3, [1, 1])], version=1)
    out_b, _ = again.compose([_group(3, [1, 1])], version=1)
    assert [(g.index, g.uses, g.rewards) for g in out_a] == [
        (g.index, g.uses, g.rewards) for g in out_b
    ]
    assert buf.take_reeval() == again.take_reeval() == [(2, [2], "a")]


def test_replay_none_passes_through():
    buf = ReplayBuffer(ReplayConfig())
    gs = [_group(1, [1, 1]), _group(2, [0, 0])]
    out, st = buf.compose(gs, 0)
    assert out == gs and st["homogeneous_groups"] == 2 and buf.take_reeval() == []
    with pytest.raises(ValueError, match="replay.policy"):
        ReplayBuffer(ReplayConfig(policy="lifo"))


def test_prompt_shards_are_disjoint_and_cover_an_epoch(tmp_path):
    f = str(data_file(tmp_path, n=30))
    ranks = [PromptData(f, Tok(), seed=1, dp_rank=r, dp_size=3) for r in range(3)]
    taken = [[it.index for it in d.next_local(10)] for d in ranks]
    assert sorted(sum(taken, [])) == list(range(30))
    # uneven draws (dynamic sampling on one rank) stay disjoint within the epoch
    a = PromptData(f, Tok(), seed=1, dp_rank=0, dp_size=2)
    b = PromptData(f, Tok(), seed=1, dp_rank=1, dp_size=2)
    xa = [it.index for it in a.next_local(12)]
    xb = [it.index for it in b.next_local(3)]
    assert not set(xa) & set(xb)
    # a different DP size restarts at the earliest position: nothing unseen is skipped
    new = remap_states([a.state_dict(), b.state_dict()], 3)
    fresh = [PromptData(f, Tok(), seed=1, dp_rank=r, dp_size=3) for r in range(3)]
    for d, st in zip(fresh, new):
        d.load_state_dict(st)
    after = {it.index for d in fresh for it in d.next_local(8)}
    assert set(range(30)) - set(xa) - set(xb) <= after
    with pytest.raises(ValueError, match="dp=2"):
        fresh[0].load_state_dict(a.state_dict())
