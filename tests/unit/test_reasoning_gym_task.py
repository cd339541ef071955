"""Issue 27: reasoning-gym tasks as prompt data (``data.task``) scored by the dataset's own
``score_answer`` (``reward.kind: reasoning_gym``). The references are reasoning-gym's own
generator and verifier, called directly."""

import json
import re
import statistics
from importlib import metadata
from pathlib import Path

import pytest

rg = pytest.importorskip("reasoning_gym")

from megatron_p3o.config.loading import load_config  # noqa: E402
from megatron_p3o.data.tasks import chain_sum  # noqa: E402
from megatron_p3o.data.tasks import reasoning_gym as task  # noqa: E402
from megatron_p3o.reward import build_reward  # noqa: E402
from megatron_p3o.runtime.errors import ConfigError, DataError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARGS = {"min_terms": 4, "max_terms": 6, "min_digits": 2, "max_digits": 3}


def _cfg(tmp_path, *extra):
    return load_config(
        None,
        [
            "data.task=reasoning_gym:chain_sum",
            f"data.task_args={json.dumps(ARGS)}",
            "data.task_format=chain_scratchpad",
            "data.task_train_size=300",
            "data.task_heldout_size=50",
            "reward.kind=reasoning_gym",
            f"run.dir={tmp_path}",
            *extra,
        ],
    ).with_task_files()


def _rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_splits_are_reasoning_gyms_own_problems_disjoint_and_deterministic(tmp_path):
    cfg = _cfg(tmp_path)
    train, held = _rows(cfg.data.path), _rows(cfg.data.eval_path)
    assert len(held) == 50 and 0 < len(train) <= 300
    ref_held = rg.create_dataset("chain_sum", seed=task.HELDOUT_SEED_OFFSET, size=50, **ARGS)
    ref_train = rg.create_dataset("chain_sum", seed=0, size=300, **ARGS)
    assert [r["prompt"] for r in held] == [
        e["metadata"]["expression"].replace(" ", "") + "=" for e in ref_held
    ]
    ref_train_prompts = {e["metadata"]["expression"].replace(" ", "") + "=" for e in ref_train}
    assert {r["prompt"] for r in train} <= ref_train_prompts
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert [json.loads(r["answer"])["answer"] for r in held] == [e["answer"] for e in ref_held]
    # the same keys give the same files; another task seed gives other problems
    again = _cfg(tmp_path)
    assert again.data.path == cfg.data.path and _rows(again.data.path) == train
    other = _cfg(tmp_path, "data.task_seed=7")
    assert other.data.path != cfg.data.path and _rows(other.data.eval_path) != held


def test_reward_is_the_datasets_own_score_answer(tmp_path):
    cfg = _cfg(tmp_path)
    fn = build_reward("reasoning_gym")
    ds = rg.create_dataset("chain_sum", seed=0, size=1, **ARGS)
    for row in _rows(cfg.data.eval_path)[:20]:
        entry = json.loads(row["answer"])
        gold = entry["answer"]
        ref = {"answer": gold, "metadata": entry["metadata"]}
        # the character tokenizer decodes "1 2 + 3 = 1 5 ; # 1 5": spaces are dropped
        for completion, extracted in (
            (" ".join("12+3=15;#" + gold), gold),
            ("#" + gold + "0", gold + "0"),  # partial credit where score_answer gives it
            ("12+3=15;#9" + gold, "9" + gold),
            ("12+3=15;" + gold, None),  # no '#': no answer
        ):
            assert fn(completion, row["answer"]) == ds.score_answer(extracted, ref)
        assert fn("#" + gold, row["answer"]) == 1.0
    assert 0 < fn("#" + gold + "0", row["answer"]) < 1


def test_scratchpad_completion_works_the_problem_and_fits_the_length_band():
    train, _ = task.splits("chain_sum", ARGS, 0, 2000, 10)
    lengths = []
    for e in train:
        target = chain_sum.scratchpad_target(e)
        steps, final = target.split("#")
        acc = int(e["metadata"]["expression"].split(" ")[0])
        for step in steps.rstrip(";").split(";"):  # each step is true arithmetic
            lhs, rhs = step.split("=")
            a, op, b = re.fullmatch(r"(-?\d+)([+-])(\d+)", lhs).groups()
            assert int(a) == acc and int(rhs) == (int(a) + int(b) if op == "+" else int(a) - int(b))
            acc = int(rhs)
        assert final == e["answer"] == str(acc)
        lengths.append(len(target) + 1)  # one token per character, then <eos>
    assert 24 <= min(lengths) and max(lengths) <= 96 and statistics.median(lengths) >= 32


def test_bad_task_keys_are_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="did you mean 'chain_sum'"):
        _cfg(tmp_path, "data.task=reasoning_gym:chain_sums")
    with pytest.raises(DataError, match="use 'reasoning_gym:<dataset name>'"):
        _cfg(tmp_path, "data.task=chain_sum")
    with pytest.raises(DataError, match="data.task_args.*min_termz"):
        _cfg(tmp_path, "data.task_args={min_termz: 3}")
    with pytest.raises(DataError, match="data.task_format='chat'"):
        _cfg(tmp_path, "data.task_format=chat")
    with pytest.raises(ConfigError, match="reward.kind: reasoning_gym"):
        _cfg(tmp_path, "reward.kind=math_verify")
    with pytest.raises(ConfigError, match="set one of them"):
        _cfg(tmp_path, "data.path=prompts.jsonl")
    with pytest.raises(DataError, match="not a reasoning_gym row"):
        build_reward("reasoning_gym")("#3", "3")


def test_every_task_format_has_its_answer_reader():
    """The task's formats (data/) and the reward's answer readers (reward/, the lower folder)
    carry the same names: a format the reward cannot read would fail at the first score."""
    from megatron_p3o.reward.reasoning_gym import ANSWER_READERS

    assert sorted(task._formats()) == sorted(ANSWER_READERS)


def test_the_lock_pins_reasoning_gym_and_its_requirements():
    pins = {}
    for line in (ROOT / "constraints-cpu.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, v = line.split("==")
            pins[k.lower().replace("_", "-")] = v
    text = (ROOT / "setup.py").read_text()
    assert f'"reasoning-gym=={pins["reasoning-gym"]}"' in text
    assert metadata.version("reasoning-gym") == pins["reasoning-gym"]
    for req in metadata.requires("reasoning-gym"):
        if "extra ==" not in req:
            name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")
            assert name in pins, name


def test_loading_reads_only_and_the_task_files_come_from_with_task_files(tmp_path):
    """Issue 44: loading a recipe writes nothing; ``with_task_files`` writes the splits once and is
    idempotent; a task beside a data file the user set is one error naming both keys."""
    sets = [
        "data.task=reasoning_gym:chain_sum",
        f"data.task_args={json.dumps(ARGS)}",
        "data.task_train_size=30",
        "data.task_heldout_size=5",
        "reward.kind=reasoning_gym",
        f"run.dir={tmp_path}",
    ]
    cfg = load_config(None, sets)
    assert cfg.data.path == "" and not (tmp_path / "tasks").exists()
    done = cfg.with_task_files()
    assert Path(done.data.path).is_file() and Path(done.data.eval_path).is_file()
    assert done.with_task_files() is done  # already written: the same config
    with pytest.raises(ConfigError, match=r"data.task='reasoning_gym:chain_sum' and data.path="):
        load_config(None, sets + ["data.path=mine.jsonl"]).with_task_files()
    with pytest.raises(ConfigError, match=r"data.task=.* set reward.kind: reasoning_gym"):
        load_config(None, sets + ["reward.kind=exact_match"])


def test_the_splits_written_for_one_run_dir_serve_a_config_moved_to_another(tmp_path):
    """The probe (and any tool that reruns a recipe in a scratch run directory) keeps the
    splits the recipe's run wrote: the same task's files are accepted wherever run.dir now
    points; a path the user set beside the task, or the task's folder without its file, is
    still refused."""
    from dataclasses import replace

    cfg = _cfg(tmp_path / "a").with_task_files()
    moved = replace(cfg, run=replace(cfg.run, dir=str(tmp_path / "scratch")))
    assert moved.with_task_files().data.path == cfg.data.path
    other = tmp_path / "mine" / "train.jsonl"
    other.parent.mkdir()
    other.write_text(Path(cfg.data.path).read_text())
    with pytest.raises(ConfigError, match="set one of them"):
        replace(moved, data=replace(moved.data, path=str(other))).with_task_files()
    Path(cfg.data.path).unlink()
    with pytest.raises(ConfigError, match="set one of them"):
        moved.with_task_files()
