import re

import pytest

from megatron_p3o.config.loading import load_config
from megatron_p3o.config.train_config import TrainConfig
from megatron_p3o.runtime.errors import ConfigError, UserError


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    p = _write(tmp_path, "optim:\n  lr: 1.0e-5\nrollout:\n  sampling:\n    temperature: 0.7\n")
    cfg = load_config(
        p, ["loss.objective=grpo", "batch.micro_batch_size=2", "loss.hyper={eps_low: 0.1}"]
    )
    assert isinstance(cfg, TrainConfig)
    assert cfg.optim.lr == 1e-5 and cfg.rollout.sampling.temperature == 0.7
    assert cfg.loss.objective == "grpo" and cfg.batch.micro_batch_size == 2
    assert cfg.loss.hyper == {"eps_low": 0.1}
    cfg.validate(world_size=1)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("optim:\n  lrr: 1\n", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
        ("rollot:\n  engine: embedded\n", "unknown config key 'rollot' (did you mean 'rollout'?)"),
        (
            "batch:\n  micro_batch_size: 2.5\n",
            "batch.micro_batch_size: expected an integer, got 2.5",
        ),
        ("data:\n  shuffle: 1\n", "data.shuffle: expected true/false, got 1"),
        ("optim:\n  lr: fast\n", "optim.lr: expected a number, got 'fast'"),
        ("parallel: 4\n", "parallel: expected a mapping"),
    ],
)
def test_bad_recipes_one_clear_message(tmp_path, text, needle):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, text))
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "overrides,world,needle",
    [
        (["parallel.tp=3"], 4, "world size 4 is not divisible by tp×pp×cp = 3×1×1 = 3"),
        (
            ["parallel.cp=2", "model.seq_length=30"],
            2,
            "sequence length 30 is not divisible by 2×cp = 4",
        ),
        (
            ["batch.prompts_per_rollout=3", "rollout.n_samples=3", "batch.minibatches=2"],
            1,
            "3 × 3 = 9 sequences do not split into minibatches=2",
        ),
        (
            ["batch.prompts_per_rollout=6", "rollout.n_samples=2", "batch.micro_batch_size=4"],
            2,
            "12 sequences per optimizer step are not a multiple of dp × micro_batch_size = "
            "2 × 4 = 8",
        ),
        (["loss.objective=p3oo"], 1, "did you mean 'p3o'"),
        (["loss.hyper={eps: 0.1}", "loss.objective=dapo"], 1, "unknown hyper-parameter 'eps'"),
        (["rollout.precision=fp4"], 1, "rollout.precision='fp4'"),
        (["steps=0"], 1, "steps=0 must be >= 1"),
        (["rollout.logprob_noise=-0.5"], 1, "rollout.logprob_noise=-0.5 must be >= 0"),
        (["rollout.engine_temperature=0"], 1, "rollout.engine_temperature=0.0 must be > 0"),
        (["replay.policy=lifo"], 1, "replay.policy='lifo'; choose one of ['none', 'bapo', 'fifo']"),
        (
            ["replay.quality_min=0.9", "replay.quality_max=0.1"],
            1,
            "replay.quality_min=0.9 > quality_max=0.1",
        ),
        (
            ["rollout.engine=sglang", "rollout.weight_sync=disk"],
            1,
            "rollout.weight_sync=disk needs rollout.weight_sync_dir",
        ),
        (["rollout.weight_sync=ipc"], 1, "rollout.weight_sync='ipc'"),
        (["parallel.world_size=8"], 2, "written for 8 GPUs but the launch has 2 ranks"),
    ],
)
def test_validation_names_the_numbers(overrides, world, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides).validate(world)
    assert needle in str(e.value), str(e.value)


def test_exponent_floats_without_a_dot():
    """PyYAML reads 3e-3 as a string; float fields accept such literals, nothing else."""
    assert load_config(None, ["optim.lr=3e-3"]).optim.lr == 3e-3
    with pytest.raises(ConfigError, match="optim.lr: expected a number, got '3e-3x'"):
        load_config(None, ["optim.lr=3e-3x"])
    with pytest.raises(ConfigError, match="batch.micro_batch_size: expected an integer"):
        load_config(None, ["batch.micro_batch_size=1e3"])


def test_missing_recipe_and_bad_set():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml")
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        load_config(None, ["optim.lr"])


def test_nccl_weight_sync_needs_server_gpus_of_its_own(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    base = ["rollout.engine=sglang", "rollout.weight_sync=distributed",
            "rollout.sglang.model_path=/m", "rollout.sglang.device=cuda",
            "rollout.sglang.sync_backend=nccl"]  # fmt: skip
    with pytest.raises(ConfigError, match="all of them; trainer GPUs 0,1,2,3"):
        load_config(None, base).check_rollout_gpus(4)  # the server would inherit GPUs 0-3
    with pytest.raises(ConfigError, match=r"\(3; trainer GPUs 0,1,2,3\)"):
        load_config(None, base + ["rollout.sglang.gpus='3,4'"]).check_rollout_gpus(4)
    load_config(None, base + ["rollout.sglang.gpus='4,5,6,7'"]).check_rollout_gpus(4)
    load_config(None, base + ["rollout.sglang.url=http://n2:30000"]).check_rollout_gpus(4)
    disk = ["rollout.weight_sync=disk", "rollout.weight_sync_dir=/shared"]
    load_config(None, base[:1] + disk).check_rollout_gpus(4)
    with pytest.raises(ConfigError, match="fp8_e4m3"):
        load_config(None, base + ["rollout.sglang.kv_cache_dtype=fp8_e5m2"]).validate(1)
    colocated = base + ["rollout.weight_sync=colocated", "rollout.sglang.tp_size=2"]
    with pytest.raises(ConfigError, match="tp_size=2 > 1 trainer GPUs"):
        load_config(None, colocated).validate(1)
    load_config(None, colocated).validate(2)
    with pytest.raises(ConfigError, match="cannot generate meanwhile"):
        load_config(None, colocated + ["rollout.max_staleness=1"]).validate(2)
    with pytest.raises(ConfigError, match="nor skip a sync"):
        load_config(None, colocated + ["rollout.sync_every=2"]).validate(2)


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["rollout.deterministic=true"], "rollout.deterministic / rollout.sglang.deterministic "
         "(--enable-deterministic-inference) with a CPU SGLang server"),
        (["rollout.routing_replay=r3"], "rollout.routing_replay=r3 "
         "(--enable-return-routed-experts) with a CPU SGLang server"),
        (["rollout.weight_sync=colocated"], "a CPU SGLang server takes weight_sync=tensor"),
        (["rollout.sglang.sync_backend=nccl"], "NCCL refuses CPU tensors"),
        (["rollout.sglang.servers=0"], "rollout.sglang.servers=0 must be >= 1"),
        (["rollout.sglang.request_batch=0"], "rollout.sglang.request_batch=0 must be >= 1"),
        (["rollout.sglang.servers=2", "rollout.sglang.url=http://h:1"], "rollout.sglang_workers"),
        (["rollout.sglang.quantization=fp8", "rollout.weight_sync=distributed"],
         "gloo cannot carry float8 tensors"),
        (["rollout.sglang.quantization=awq"], "online quantization replaces the weights"),
    ],
)  # fmt: skip
def test_what_a_cpu_sglang_server_cannot_do_is_refused_at_config_time(sets, needle):
    """SGLang 0.5.23 refuses deterministic inference on CPU and dies on routed experts there: one
    config error naming the flag, not a dead server (the flags' names are checked against the
    release by tests/unit/test_sglang_protocol.py)."""
    base = ["rollout.engine=sglang", "rollout.sglang.model_path=/m", "rollout.sglang.device=cpu"]
    with pytest.raises(UserError, match=re.escape(needle)):
        load_config(None, base + sets).validate(1)
    load_config(None, base).validate(1)  # gloo (auto) and the defaults are fine
    gpu = [s.replace("device=cpu", "device=cuda") for s in base]
    load_config(None, gpu + ["rollout.deterministic=true"]).validate(1)
    load_config(None, gpu + ["rollout.sglang.quantization=fp8"]).validate(1)  # nccl there


# -- issue 41, item 4: every numeric value's range, named by its dotted key ---------------------

_BAD = {  # a value outside each rule of config.RANGES
    "> 0": "0",
    ">= 0": "-1",
    ">= 1": "0",
    ">= 2": "1",
    "in (0, 1]": "0",
    "in [0, 1)": "1",
    "in [0, 1]": "1.5",
    "a port in [1, 65535]": "70000",
    "in [0, 65535] (0: a free port)": "-1",
}


def _ranges():
    """Every ``(dotted key, rule)`` the components declare (each config's ``RANGES``), found by
    walking the config tree — a component that declares a range is tested for it."""
    import dataclasses
    import typing

    out = []

    def walk(cls, prefix):
        out.extend((f"{prefix}{k}", rule) for k, rule in getattr(cls, "RANGES", {}).items())
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")

    walk(TrainConfig, "")
    return out


@pytest.mark.parametrize("path,rule", _ranges(), ids=[p for p, _ in _ranges()])
def test_every_range_is_checked_at_load_with_its_key(path, rule):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{path}={_BAD[rule]}"])
    msg = str(e.value)
    assert msg.startswith(f"{path}=") and "must be" in msg, msg


def test_the_ranges_cover_every_component():
    """The per-component tables hold the keys the old central table held (none was dropped in
    the move to one validation path), and the defaults satisfy them (TrainConfig() builds)."""
    keys = {k for k, _ in _ranges()}
    for must in (
        "steps",
        "optim.lr",
        "rollout.sglang.port",
        "r2po.head.lr",
        "data.eval_every",
        "batch.max_tokens_per_gpu",
        "replay.fifo_capacity",
        "parallel.world_size",
    ):
        assert must in keys, must
    assert len(keys) >= 60
    TrainConfig()


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["optim.lr=-0.001"], "optim.lr=-0.001 must be > 0"),
        (["optim.lr=.nan"], "optim.lr=nan must be a finite number"),
        (["optim.lr=1e-6", "optim.min_lr=1e-5"], "optim.min_lr=1e-05 must be <= optim.lr=1e-06"),
        (["optim.lr_decay_style=cosin"], "did you mean 'cosine'"),
        (["rollout.sampling.temperature=0"], "rollout.sampling.temperature=0.0 must be > 0"),
        (["eval.sets={a: {path: x, n: 0}}"], "eval.sets.a.n=0 must be >= 1"),
        (["eval.sets={a: {path: x, top_p: 2}}"], "eval.sets.a.top_p=2.0 must be in (0, 1]"),
        (["eval.sets={a: {path: x, limit: -1}}"], "eval.sets.a.limit=-1 must be >= 0"),
    ],
)
def test_range_messages(sets, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert needle in str(e.value), str(e.value)


def test_validate_checks_ranges_of_a_config_built_in_code():
    from dataclasses import replace

    from megatron_p3o.update.optim import OptimConfig

    with pytest.raises(ConfigError, match=r"optim.lr=-1.0 must be > 0"):
        replace(TrainConfig(), optim=OptimConfig(lr=-1.0)).validate(1)


def test_recipe_that_is_not_utf8_or_is_a_directory(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes(b"run:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"r.yaml: not UTF-8 text \(byte 0xe9 on line 2\)"):
        load_config(p)
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        load_config(tmp_path)


@pytest.mark.parametrize("url", ["127.0.0.1:9", "http://", "http://h:99999", "ftp://h:1"])
def test_sglang_urls_need_a_scheme_and_host(url):
    sets = ["rollout.engine=sglang", f"rollout.sglang.url={url}", "rollout.weight_sync=disk"]
    with pytest.raises(ConfigError, match="is not a URL like http://HOST:PORT"):
        load_config(None, [*sets, "rollout.weight_sync_dir=/tmp/w"]).validate(1)


@pytest.mark.parametrize(
    "hyper,needle",
    [
        ("{eps_low: 0.2x}", "loss.hyper.eps_low='0.2x': objective 'ppo' expects a number"),
        ("{eps_high: -0.1}", "loss.hyper.eps_high=-0.1 must be >= 0"),
        ("{mis_level: tok}", "mis_level='tok'"),
    ],
)
def test_loss_hyper_values_are_checked_with_their_key(hyper, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["loss.objective=ppo", f"loss.hyper={hyper}"]).validate(1)
    assert needle in str(e.value) and not str(e.value).startswith("loss: loss."), str(e.value)


def test_loss_hyper_exponent_literals_are_numbers():
    """PyYAML reads 3e-4 as a string; the objective gets the number."""
    from megatron_p3o.loss import build_objective

    cfg = load_config(None, ["loss.objective=gspo", "loss.hyper={eps_low: 3e-4}"]).validate(1)
    assert build_objective(cfg.loss.objective, **cfg.loss.hyper).hyper.eps_low == 3e-4
