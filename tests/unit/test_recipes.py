"""Every shipped recipe passes ``--dry-run`` (layout, batch arithmetic, memory estimate); the
stress grid's cells are all valid recipes; the memory model's parameter counts equal those of
the transformers model built from the same config (on the meta device, no memory)."""

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_p3o.config.loading import load_config
from megatron_p3o.config.plan import expert_params, layer_params, make_plan
from megatron_p3o.model.description import ModelDescription
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.train import main

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(
    p
    for p in (ROOT / "recipes").glob("*.yaml")
    if "objectives" not in yaml.safe_load(p.read_text())
)
GRIDS = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if p not in RECIPES)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_dry_run(recipe, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = yaml.safe_load(recipe.read_text())
    world = [] if cfg.get("parallel", {}).get("world_size") else ["--world-size", "1"]
    assert main([str(recipe), "--dry-run", *world]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "memory per GPU" in out and "fits" in out and "DOES NOT FIT" not in out


def _cli(monkeypatch, *args) -> int:
    """The train CLI as a user runs it (user errors: one line on stderr, exit status 2)."""
    from megatron_p3o.runtime.errors import run_cli

    monkeypatch.setattr(sys, "argv", ["megatron_p3o.train", *args])
    with pytest.raises(SystemExit) as e:
        run_cli(main, "megatron_p3o.train")
    return e.value.code


def test_dry_run_names_the_problem(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    r = str(ROOT / "recipes/qwen3_8b_h100x8.yaml")
    assert _cli(monkeypatch, r, "--dry-run", "--world-size", "6") == 2
    assert "written for 4 GPUs but the launch has 6" in capsys.readouterr().err
    sets = ["--set", "parallel.world_size=6", "--set", "parallel.tp=4"]
    assert _cli(monkeypatch, r, "--dry-run", *sets) == 2
    assert "world size 6 is not divisible by tp×pp×cp = 4×1×1 = 4" in capsys.readouterr().err
    sets = ["--set", "parallel.tp=3", "--set", "parallel.world_size=6"]
    assert _cli(monkeypatch, r, "--dry-run", *sets) == 2
    assert "num_attention_heads=32 is not divisible by tp=3" in capsys.readouterr().err
    padded = ["--set", "batch.max_tokens_per_gpu=null", "--set", "batch.micro_batch_size=3"]
    assert _cli(monkeypatch, r, "--dry-run", *padded) == 2
    err = capsys.readouterr().err
    assert "not a multiple of dp × micro_batch_size = 2 × 3 = 6" in err
    assert err.count("\n") == 1 and err.startswith("megatron_p3o.train: error: ")
    # packed micro-batches: the step's sequences only need to split over the DP ranks
    packed = ["--set", "batch.prompts_per_rollout=3", "--set", "rollout.n_samples=4"]
    assert _cli(monkeypatch, r, "--dry-run", *packed) == 2
    err = capsys.readouterr().err
    assert "3 sequences per optimizer step are not a multiple of dp = 2" in err
    assert _cli(monkeypatch, r, "--dry-run", "--set", "batch.max_tokens_per_gpu=0") == 2
    assert "batch.max_tokens_per_gpu=0 must be >= 1" in capsys.readouterr().err


def test_colocated_server_memory_is_counted(capsys, monkeypatch):
    """A colocated server holds mem_fraction_static of the GPU next to the trainer's resident
    state (parameters + gradients + optimizer) while it generates: the MoE recipe's old 0.5
    (40 GiB next to 47.7) is refused with the fraction that fits; the recipe's value fits."""
    monkeypatch.chdir(ROOT)
    r = str(ROOT / "recipes/qwen3_30b_a3b_h100x8.yaml")
    assert _cli(monkeypatch, r, "--dry-run", "--set", "rollout.sglang.mem_fraction_static=0.5") == 2
    err = capsys.readouterr().err
    assert "mem_fraction_static=0.5" in err and "use mem_fraction_static <= 0.30" in err
    assert main([r, "--dry-run"]) == 0
    out = capsys.readouterr().out
    resident = sum(
        float(line.split()[1])
        for line in out.splitlines()
        if line.split()[:1] and line.split()[0] in ("parameters", "gradients", "optimizer")
    )
    assert f"trainer {resident:.2f} GiB resident + server 24.00 GiB" in out


def test_colocated_launch_enables_the_memory_saver(monkeypatch, tmp_path):
    """weight_sync=colocated launches SGLang with --enable-memory-saver (without it SGLang's
    no-op adapter makes /release_memory_occupation free nothing); other modes do not."""
    from megatron_p3o.rollout import backend as backend_mod
    from megatron_p3o.rollout.sglang import fleet
    from megatron_p3o.rollout.sglang.launch import server_args
    from megatron_p3o.runtime.parallel import Layout, initialize

    seen = []

    class Stop(Exception):
        pass

    def fake_fleet(sg, workers, log_dir, transport):
        seen.append(server_args(sg))
        raise Stop

    monkeypatch.setattr(fleet, "build_fleet", fake_fleet)
    monkeypatch.setattr("megatron_p3o.rollout.sglang.build_fleet", fake_fleet)
    groups = initialize(Layout())
    base = ["rollout.engine=sglang", "rollout.sglang.model_path=/m", "rollout.sglang.device=cuda"]
    for mode in ("colocated", "distributed", "disk"):
        shared = [f"rollout.weight_sync_dir={tmp_path}"] if mode == "disk" else []
        cfg = load_config(None, base + [f"rollout.weight_sync={mode}"] + shared)
        with pytest.raises(Stop):
            backend_mod._central_engines(cfg.rollout, groups, {}, str(tmp_path))
    assert ["--enable-memory-saver" in a for a in seen] == [True, False, False]


@pytest.mark.parametrize(
    "name",
    ["qwen3-8b", "qwen3-32b", "llama-3.1-70b", "qwen3-30b-a3b", "tiny-llama", "tiny-qwen3-moe"],
)
def test_parameter_count_matches_transformers(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((ROOT / "recipes/models" / name / "config.json").read_text())
    desc = ModelDescription.from_hf_config(raw)
    kw = {
        k: v
        for k, v in raw.items()
        if k not in ("architectures", "model_type", "torch_dtype", "dtype")
    }
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw["model_type"], **kw))
    ref = sum(p.numel() for p in model.parameters())
    cfg = load_config(
        None,
        [
            f"model.hf_config=recipes/models/{name}/config.json",
            "model.seq_length=64",
            "batch.prompts_per_rollout=4",
            "rollout.n_samples=1",
            "batch.micro_batch_size=1",
        ],
    )
    plan = make_plan(cfg, 1, desc, divisible_by=1)
    assert plan.params_total == ref, (plan.params_total, ref)
    sharded, replicated = layer_params(desc)
    layer0 = sum(p.numel() for p in model.model.layers[0].parameters())
    assert sharded + replicated + expert_params(desc) == layer0


def test_stress_grid_cells_are_valid_recipes(monkeypatch):
    from megatron_p3o.stress.grid import cell_config, cells, load_grid

    monkeypatch.chdir(ROOT)
    assert GRIDS
    for g in GRIDS:
        grid = load_grid(g)
        cs = cells(grid)
        per_setting = [len(m.objectives) or len(grid.objectives) for m in grid.mismatch.values()]
        assert len(cs) == sum(per_setting) * len(grid.seeds)
        assert len({c.id for c in cs}) == len(cs)
        for c in cs:
            cfg = cell_config(grid, c)
            assert cfg.loss.objective == grid.objectives[c.objective].objective
            assert cfg.run.seed == c.seed
            assert cfg.wandb.group == grid.name and cfg.run.name == c.id
            # an objective's own overrides (a learning-rate sweep) reach its cells, unless the
            # setting overrides the same key
            for key, want in grid.objectives[c.objective].set.items():
                if key not in grid.mismatch[c.mismatch].set:
                    got = cfg
                    for part in key.split("."):
                        got = getattr(got, part)
                    assert got == want, (c.id, key, got, want)


def test_grid_errors_name_the_key(tmp_path, monkeypatch):
    from megatron_p3o.stress.grid import cell_config, cells, load_grid

    monkeypatch.chdir(ROOT)
    g = tmp_path / "g.yaml"
    g.write_text(
        "base: recipes/tiny_cpu.yaml\nobjectives: {x: {objective: p3o, hyper: {clip: 1}}}\n"
        "mismatch: {a: {set: {}}}\n"
    )
    grid = load_grid(g)
    with pytest.raises(ConfigError, match="cell x__a__s1: loss: .*clip"):
        cell_config(grid, cells(grid)[0])
    g.write_text(
        "base: recipes/tiny_cpu.yaml\nobjectives: {x: {objective: p3o}}\n"
        "mismatch: {a: {famly: b}}\n"
    )
    with pytest.raises(ConfigError, match="famly"):
        load_grid(g)


def test_a_setting_can_run_a_subset_of_the_objectives(tmp_path, monkeypatch):
    from megatron_p3o.stress.grid import cells, load_grid

    monkeypatch.chdir(ROOT)
    g = tmp_path / "g.yaml"
    head = "base: recipes/tiny_cpu.yaml\nobjectives: {x: {objective: p3o}, y: {objective: tis}}\n"
    g.write_text(
        head + "mismatch: {a: {family: baseline}, b: {level: 1, objectives: [y]}}\nseeds: [1, 2]\n"
    )
    ids = [c.id for c in cells(load_grid(g))]
    assert ids == ["x__a__s1", "x__a__s2", "y__a__s1", "y__a__s2", "y__b__s1", "y__b__s2"]
    g.write_text(head + "mismatch: {a: {family: baseline}, b: {objectives: [z]}}\n")
    with pytest.raises(ConfigError, match=r"mismatch\.b\.objectives: 'z'"):
        load_grid(g)
    g.write_text(head + "mismatch: {a: {family: baseline, objectives: [x]}, b: {}}\n")
    with pytest.raises(ConfigError, match=r"mismatch\.a\.objectives: the control"):
        load_grid(g)


def test_sglang_cells_get_their_own_ports_unless_pinned(tmp_path, monkeypatch):
    """Two single-process cells run side by side (--workers 2): each launches its own server and
    weight-update rendezvous, so their ports must differ; ports a grid pins are kept, and a
    multi-rank cell keeps the recipe's (every rank must agree on them)."""
    from megatron_p3o.stress.grid import cell_config, cells, load_grid

    monkeypatch.chdir(ROOT)
    g = tmp_path / "g.yaml"
    sg = "rollout.engine: sglang, rollout.sglang.model_path: runs/tiny_base/hf"
    g.write_text(
        "base: recipes/tiny_cpu.yaml\nobjectives: {x: {objective: p3o}}\n"
        f"mismatch: {{a: {{set: {{{sg}}}}}, b: {{set: {{{sg}, rollout.sglang.port: 31234}}}}}}\n"
        "seeds: [1, 2]\n"
    )
    grid = load_grid(g)
    a1, a2, b1, _ = cells(grid)
    c1, c2 = cell_config(grid, a1), cell_config(grid, a2)
    default = cell_config(grid, a1, world_size=2).rollout
    ports = {c1.rollout.sglang.port, c2.rollout.sglang.port, default.sglang.port}
    assert len(ports) == 3
    assert c1.rollout.weight_sync_port != c2.rollout.weight_sync_port
    assert default.weight_sync_port not in (
        c1.rollout.weight_sync_port,
        c2.rollout.weight_sync_port,
    )
    pinned = cell_config(grid, b1).rollout
    assert pinned.sglang.port == 31234 and pinned.weight_sync_port != default.weight_sync_port
