"""Issue 24, item 6: under FP8 training Transformer Engine needs every rank's token rows (the
packed micro-batch's tokens ÷ cp, ÷ tp under sequence parallelism) divisible by 16. Checked per
shipped recipe, through real packed micro-batches of random lengths: the rule is derived here
from the layout, independently of ``token_multiple``."""

import math
import random
from pathlib import Path

import pytest
import yaml

from megatron_p3o.config.loading import load_config
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.types import Sample
from megatron_p3o.update.batching import MicroBatcher, packed_microbatch, token_multiple

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(
    p
    for p in (ROOT / "recipes").glob("*.yaml")
    if "objectives" not in yaml.safe_load(p.read_text())
)


def _sample(n_prompt, n_completion):
    return Sample(
        prompt_ids=[1] * n_prompt,
        completion_ids=[2] * n_completion,
        logprobs=[-0.5] * n_completion,
        finish_reason="length",
        weight_version=0,
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
@pytest.mark.parametrize("fp8", [False, True])
def test_packed_rows_per_rank_suit_the_precision(recipe, fp8, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(str(recipe))
    world = cfg.parallel.world_size or 1
    lay = cfg.parallel.layout().resolve(world)
    m = token_multiple(lay, fp8)
    shard = lay.cp * (lay.tp if lay.sequence_parallel else 1)  # ranks one micro-batch splits over
    rng = random.Random(recipe.name)
    align = 2 * lay.cp if lay.cp > 1 else 1
    cap = min(cfg.model.seq_length, 130)
    for _ in range(20):
        samples = [
            _sample(rng.randint(1, cap // 2), rng.randint(1, cap // 2))
            for _ in range(rng.randint(1, 6))
        ]
        mb = packed_microbatch(samples, [1.0] * len(samples), list(range(len(samples))),
                               cfg.model.seq_length, align=align, multiple=m)  # fmt: skip
        t = mb["tokens"].shape[1]
        assert t % shard == 0 and (lay.cp == 1 or t % (2 * lay.cp) == 0)
        if fp8:
            assert (t // shard) % 16 == 0, (recipe.name, t, shard)
        assert (
            t - sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
            < m * len(samples) + m
        )


def test_the_trainer_pads_for_its_recipe(monkeypatch):
    """The recipe that trains in FP8 gets the FP8 multiple in its batcher."""
    monkeypatch.chdir(ROOT)
    cfg = load_config("recipes/llama31_70b_h100x64.yaml")
    assert cfg.model.fp8
    lay = cfg.parallel.layout().resolve(cfg.parallel.world_size)

    class G:
        layout = lay

    b = MicroBatcher(cfg.batch, G(), cfg.model.seq_length, 0, fp8=bool(cfg.model.fp8))
    shard = lay.cp * (lay.tp if lay.sequence_parallel else 1)
    assert b.multiple % (16 * shard) == 0 and b.multiple == math.lcm(b.align, 16 * shard)


def test_padded_fp8_rows_are_checked_at_config_time():
    sets = ["model.fp8=hybrid", "batch.micro_batch_size=1", "model.seq_length=40"]
    with pytest.raises(ConfigError, match="is not a multiple of 16"):
        load_config(None, sets).validate(1)
    load_config(None, sets[:2] + ["model.seq_length=48"]).validate(1)


def test_gpu_round3_script_runs_here():
    """tools/gpu_check.sh's round-3 step (without its nested host-sync run) works on a CPU."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_round3", ROOT / "tools/gpu_round3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fp8 = mod.fp8_on_device("cpu")
    assert fp8 and all(v["bitwise_equal_to_cpu"] for v in fp8.values())
    pad = mod.padding_rule()
    assert len(pad) == len(RECIPES) and all(v["ok"] for v in pad.values())
