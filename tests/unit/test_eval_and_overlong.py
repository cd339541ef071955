"""pass@k against a hand-computed case, DAPO's over-long penalty against its formula, truncated
completions leaving the loss normalizer, and the eval-set configuration."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_p3o.config.loading import load_config
from megatron_p3o.evaluation.heldout import pass_at_k, summarize
from megatron_p3o.reward.overlong import OverlongConfig, dapo_overlong_reward
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.types import Sample
from megatron_p3o.update.batching import BatchConfig, MicroBatcher


def test_pass_at_k_by_hand():
    """n = 5 samples, c = 2 correct: pass@1 = 2/5; pass@2 = 1 − C(3,2)/C(5,2) = 1 − 3/10;
    pass@5 = 1 (every draw of 5 holds a correct one)."""
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 5) == 1.0
    assert pass_at_k(5, 0, 5) == 0.0
    for n, c, k in [(7, 3, 2), (10, 4, 3), (16, 1, 8)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)


def test_summarize_averages_over_prompts():
    # two prompts, n = 5: 2 and 5 correct; greedy right on the second only
    m = summarize("s", [[2, 5, 0], [5, 5, 1]], 5, [1, 2, 5], True)
    assert m["eval/s/pass@1"] == pytest.approx((0.4 + 1.0) / 2)
    assert m["eval/s/pass@2"] == pytest.approx((0.7 + 1.0) / 2)
    assert m["eval/s/pass@5"] == 1.0
    assert m["eval/s/pass@1_mean"] == pytest.approx(0.7)
    assert m["eval/s/greedy_acc"] == 0.5 and m["eval/s/prompts"] == 2


def test_overlong_penalty_matches_the_formula():
    """L_max = 10, L_cache = 4: no penalty up to 6 tokens, linear to −1 at 10, −1 beyond."""
    lens = torch.tensor([0, 6, 7, 8, 10, 11, 50])
    expect = [0.0, 0.0, (6 - 7) / 4, (6 - 8) / 4, -1.0, -1.0, -1.0]
    assert dapo_overlong_reward(lens, 10, 4).tolist() == pytest.approx(expect)
    with pytest.raises(ValueError, match="cache"):
        OverlongConfig(max_len=10, cache=0)


def _s(c, finish):
    return Sample([1, 2], list(range(3, 3 + c)), [-0.5] * c, finish, 0)


@pytest.mark.parametrize("packed", [False, True])
def test_truncated_completions_leave_the_loss_normalizer(packed):
    from megatron_p3o.update.policy_update import PolicyUpdate

    samples = [_s(3, "stop"), _s(5, "length"), _s(2, "stop"), _s(5, "length")]
    adv = torch.tensor([1.0, -1.0, 0.5, 0.2])
    from megatron_p3o.runtime.parallel import Layout

    lay = Layout().resolve(1)
    groups = SimpleNamespace(layout=lay, dp=None, dp_rank=0, device=torch.device("cpu"))
    counts = {}
    for mask_truncated in (False, True):
        cfg = BatchConfig(
            micro_batch_size=2, max_tokens_per_gpu=16 if packed else None,
            mask_truncated=mask_truncated,
        )  # fmt: skip
        (mbs,), _ = MicroBatcher(cfg, groups, 8, 0).build(samples, adv)
        upd = PolicyUpdate.__new__(PolicyUpdate)
        upd.groups = groups
        counts[mask_truncated] = upd._global_counts(mbs)[:2]
    assert counts[False] == (15.0, 4.0)
    assert counts[True] == (5.0, 2.0)  # exactly the two truncated samples' 10 tokens are gone


def test_eval_sets_config_is_strict(tmp_path):
    cfg = load_config(
        None,
        [
            "eval.sets={a: {path: x.jsonl, n: 5, k: [1, 2, 5], reward: {kind: exact_match}}}",
            "eval.every=10",
            "reward.overlong={max_len: 100, cache: 20}",
        ],
    )
    s = cfg.eval.sets["a"]
    assert s.n == 5 and s.k == [1, 2, 5] and s.reward.kind == "exact_match"
    assert cfg.eval.every == 10 and cfg.reward.overlong.cache == 20
    with pytest.raises(ConfigError, match="eval.sets.a"):
        load_config(None, ["eval.sets={a: {path: x.jsonl, nn: 5}}"])
    with pytest.raises(ConfigError, match=r"k=\[8\]"):
        load_config(None, ["eval.sets={a: {path: x.jsonl, n: 5, k: [8]}}"])


def test_dataset_names_go_through_datasets(tmp_path, monkeypatch):
    """A name that is not a .jsonl/.json/.parquet file goes to ``datasets.load_dataset`` like a
    hub dataset (here a local dataset repository: a folder of data files, as on the hub); an
    unreadable one is one clear error naming the key."""
    import json

    import datasets

    from megatron_p3o.data.prompts import read_dataset
    from megatron_p3o.runtime.errors import InputFileError

    # no hub round trips from a test machine (CI reaches package registries only)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)

    repo = tmp_path / "org_math"
    repo.mkdir()
    rows = [{"problem": f"{i}+1", "solution": str(i + 1)} for i in range(5)]
    (repo / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = read_dataset(str(repo), "train")
    assert ds["problem"] == [r["problem"] for r in rows]
    with pytest.raises(InputFileError, match=r"eval.sets.x.path='no/such-set-here'"):
        read_dataset("no/such-set-here", "train", "eval.sets.x.path")
    with pytest.raises(InputFileError, match="does not exist"):
        read_dataset(str(tmp_path / "missing.jsonl"))


def test_the_overlong_penalty_counts_the_policys_tokens_of_a_trajectory():
    """Issue 62: a multi-turn trajectory of 20 tokens, 6 of them the policy's: DAPO's penalty
    (L_max 10, cache 4) counts the 6 — none — not the environment's 14 (−1 if counted)."""
    from megatron_p3o.reward.overlong import OverlongConfig as Ol
    from megatron_p3o.trainer import Trainer

    cfg = SimpleNamespace(reward=SimpleNamespace(overlong=Ol(max_len=10, cache=4)))
    me = SimpleNamespace(turns=object(), cfg=cfg)
    mask = [1] * 3 + [0] * 14 + [1] * 3
    s = Sample([1], list(range(20)), [0.0] * 20, "stop", 0, reward=1.0, policy_mask=mask)
    long = Sample([1], list(range(20)), [0.0] * 20, "stop", 0, reward=1.0, policy_mask=[1] * 20)
    assert Trainer._score(me, [s, long], ["", ""]) == [1.0, 0.0]
