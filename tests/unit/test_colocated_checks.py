"""Issue 42, item 2 (the parts a CPU can check without ranks): ``--dry-run`` counts the colocated
push buffers next to the trainer's state and the server's weights, and what a colocated or
CUDA-IPC push cannot serve is refused before any server starts, in one line each."""

import sys
from pathlib import Path

import pytest

from megatron_p3o.config.loading import load_config
from megatron_p3o.train import main

ROOT = Path(__file__).resolve().parents[2]
MOE = str(ROOT / "recipes/qwen3_30b_a3b_h100x8.yaml")


def _cli(monkeypatch, *args) -> int:
    from megatron_p3o.runtime.errors import run_cli

    monkeypatch.setattr(sys, "argv", ["megatron_p3o.train", *args])
    with pytest.raises(SystemExit) as e:
        run_cli(main, "megatron_p3o.train")
    return e.value.code


def test_the_moe_recipe_fits_with_its_push_buffers(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main([MOE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("during a colocated push"))
    # 30.53 B parameters in bf16 over the server's tp 8; three 256 MiB buckets (pushed, being
    # received, the owner's flat copy), each up to the 151936 × 2048 embedding (0.58 GiB) over
    assert "server weights 7.11 GiB" in line and "push buffers 2.49 GiB" in line, line
    total = float(line.rsplit("=", 1)[1].split()[0])
    assert total < 0.9 * 80


def test_a_push_that_cannot_fit_is_refused(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = _cli(monkeypatch, MOE, "--dry-run", "--set", "rollout.sglang.tp_size=1",
                "--set", "rollout.sglang.mem_fraction_static=0.05")  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "a colocated push needs" in err and "push buffers" in err, err
    assert len(err.strip().splitlines()) == 1


def _central(monkeypatch, tmp_path, sets, cuda=False):
    from megatron_p3o.rollout import backend as backend_mod
    from megatron_p3o.runtime.parallel import Layout, initialize

    class Launched(Exception):
        pass

    def fake_fleet(*a, **k):
        raise Launched

    monkeypatch.setattr("megatron_p3o.rollout.sglang.build_fleet", fake_fleet)
    base = ["rollout.engine=sglang", "rollout.sglang.model_path=/m", "rollout.sglang.device=cuda"]
    cfg = load_config(None, base + sets)
    groups = initialize(Layout())
    if cuda:
        import torch

        monkeypatch.setattr(type(groups), "device", property(lambda s: torch.device("cuda", 0)))
    try:
        backend_mod._central_engines(cfg.rollout, groups, {}, str(tmp_path))
    except Launched:
        return None
    except Exception as e:
        return str(e)
    return None


def test_colocated_with_several_servers_is_refused(monkeypatch, tmp_path):
    msg = _central(monkeypatch, tmp_path, ["rollout.weight_sync=colocated",
                                           "rollout.sglang.servers=2"])  # fmt: skip
    assert msg and "colocated with 2 servers" in msg and "\n" not in msg, msg
    msg = _central(monkeypatch, tmp_path, ["rollout.weight_sync=colocated",
                                           "rollout.sglang.url=http://127.0.0.1:1",
                                           "rollout.sglang_workers=[http://127.0.0.1:2,"
                                           "http://127.0.0.1:3]"])  # fmt: skip
    assert msg and "colocated with 2 servers" in msg, msg
    assert _central(monkeypatch, tmp_path, ["rollout.weight_sync=colocated"]) is None


def test_cuda_ipc_tensor_pushes_to_another_node_are_refused(monkeypatch, tmp_path):
    remote = ["rollout.weight_sync=tensor", "rollout.sglang.url=http://gpu-node-17.invalid:30000"]
    assert _central(monkeypatch, tmp_path, remote) is None  # a CPU trainer sends the data
    msg = _central(monkeypatch, tmp_path, remote, cuda=True)
    assert msg and "CUDA-IPC" in msg and "gpu-node-17" in msg and "\n" not in msg, msg
    local = ["rollout.weight_sync=tensor", "rollout.sglang.url=http://127.0.0.1:30000"]
    assert _central(monkeypatch, tmp_path, local, cuda=True) is None


def test_the_colocated_fraction_gives_the_planned_pool():
    """Issue 63, item 2: SGLang 0.5.23 sizes a server's weights + KV cache as the fraction ×
    the memory free when it starts (kv_cache_configurator._profile_available_bytes): free −
    free·(1 − f). With the fraction the launch passes, that is the plan's fraction × the whole
    GPU; a pool that cannot fit in what the trainer left free is one line."""
    from megatron_p3o.rollout.sglang.launch import SGLangSetupError, colocated_fraction

    gib = 2**30
    total, free = 80 * gib, 50 * gib  # the trainer holds 30 GiB
    f = colocated_fraction(0.3, total, free)
    pool = free - free * (1 - f)  # SGLang's rule, with the fraction it is given
    assert abs(pool - 0.3 * total) < 0.001 * gib and f == 0.48
    assert abs(free - free * (1 - 0.3) - 15 * gib) < 1  # the recipe's 0.3 as it was: 15 GiB
    with pytest.raises(SGLangSetupError) as e:
        colocated_fraction(0.3, total, 20 * gib)  # 24 GiB planned, 20 free
    assert "mem_fraction_static=0.3" in str(e.value) and "\n" not in str(e.value)


def test_a_colocated_launch_passes_the_translated_fraction(monkeypatch, tmp_path):
    """The server a colocated run launches (after the trainer's model and optimizer exist) gets
    the fraction that gives it the planned pool, read from the free memory at launch."""
    import torch

    from megatron_p3o.rollout import backend as backend_mod

    got = {}

    def fake_fleet(sg, *a, **k):
        got["f"] = sg.mem_fraction_static
        raise RuntimeError("launched")

    monkeypatch.setattr("megatron_p3o.rollout.sglang.build_fleet", fake_fleet)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (40 * 2**30, 80 * 2**30))
    monkeypatch.setattr(backend_mod, "check_transport", lambda *a: None)
    base = ["rollout.engine=sglang", "rollout.sglang.model_path=/m", "rollout.sglang.device=cuda",
            "rollout.weight_sync=colocated", "rollout.sglang.mem_fraction_static=0.25",
            "rollout.max_staleness=0"]  # fmt: skip
    cfg = load_config(None, base)
    groups = initialize_layout()
    monkeypatch.setattr(type(groups), "device", property(lambda s: torch.device("cuda", 0)))
    with pytest.raises(RuntimeError, match="launched"):
        backend_mod._central_engines(cfg.rollout, groups, {}, str(tmp_path))
    assert got["f"] == 0.5  # 0.25 of 80 GiB out of the 40 GiB free


def initialize_layout():
    from megatron_p3o.runtime.parallel import Layout, initialize

    return initialize(Layout())


def test_the_preflight_reads_the_driver_and_free_memory(monkeypatch):
    """Issue 63, item 5: a driver older than CUDA 13's minimum (580) is one line before any
    server starts; a newer one passes; a GPU without the memory asked is named; without
    nvidia-smi nothing is checked and the report says so."""
    import subprocess

    from megatron_p3o.rollout.sglang import preflight
    from megatron_p3o.rollout.sglang.launch import SGLangSetupError

    def smi(out):
        return lambda *a, **k: subprocess.CompletedProcess(a, 0, out, "")

    monkeypatch.setattr(subprocess, "run", smi("550.54.15, 70000, 81559\n550.54.15, 800, 81559\n"))
    lines = preflight.report(min_free_gib=10)
    assert len(lines) == 2 and "550.54.15 is older than 580" in lines[0] and "GPU 1" in lines[1]
    with pytest.raises(SGLangSetupError, match="older than 580"):
        preflight.check_launch()
    monkeypatch.setattr(subprocess, "run", smi("580.65.06, 70000, 81559\n"))
    assert preflight.report() == [] and preflight.check_launch() is None

    def absent(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", absent)
    assert "no nvidia-smi" in preflight.report()[0] and preflight.check_launch() is None
