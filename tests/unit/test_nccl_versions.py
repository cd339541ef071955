"""Issue 24, item 2: the trainer and SGLang environments bring their own NCCL (SGLang 0.5.23's
torch 2.14.1 brings nvidia-nccl-cu13), and NCCL refuses a communicator of mixed versions at
the first broadcast. The launch reads both versions and refuses up front, before any server
starts. The SGLang side is read from the real SGLang environment; its expected value comes
from that environment's installed NCCL wheel metadata, not from our probe."""

import subprocess

import pytest

from megatron_p3o.rollout.sglang.weights import check_nccl_versions, server_nccl_version
from megatron_p3o.runtime.errors import UserError
from tests.sglang_env import sglang_python


def test_sglang_environment_nccl_version_is_read_without_a_gpu():
    py = sglang_python()
    meta = subprocess.run(
        [py, "-c", "import importlib.metadata as m; print(m.version('nvidia-nccl-cu13'))"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert meta.returncode == 0, meta.stderr[-1000:]
    wheel = meta.stdout.strip()  # e.g. 2.30.7 (the wheel may carry a 4th post component)
    got = server_nccl_version(py)
    assert got is not None and wheel.startswith(got), (got, wheel)
    assert server_nccl_version("/nonexistent/python") is None


def test_mismatched_nccl_is_refused_with_both_versions_and_remedies():
    with pytest.raises(UserError) as e:
        check_nccl_versions("2.27.3", "2.30.7", "/opt/sgl/bin/python")
    msg = str(e.value)
    assert "2.27.3" in msg and "2.30.7" in msg and "/opt/sgl/bin/python" in msg
    assert "one image" in msg and "LD_PRELOAD" in msg and "weight_sync=disk" in msg
    assert "\n" not in msg
    check_nccl_versions("2.30.7", "2.30.7", "/x")  # equal: fine
    check_nccl_versions(None, "2.30.7", "/x")  # a CPU trainer has none: gloo, not checked


def test_launch_refuses_before_any_server_starts(monkeypatch, tmp_path):
    from megatron_p3o.config.loading import load_config
    from megatron_p3o.rollout import backend as backend_mod
    from megatron_p3o.rollout.sglang import weights
    from megatron_p3o.runtime.parallel import Layout, initialize

    started = []
    monkeypatch.setattr(
        "megatron_p3o.rollout.sglang.build_fleet", lambda *a, **k: started.append(a)
    )
    monkeypatch.setattr(weights, "trainer_nccl_version", lambda: "2.27.3")
    monkeypatch.setenv("SGLANG_PYTHON", sglang_python())
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.model_path=/m",
                             "rollout.sglang.device=cuda", "rollout.weight_sync=distributed",
                             "rollout.sglang.sync_backend=nccl"])  # fmt: skip
    with pytest.raises(UserError, match=r"trainer's NCCL is 2\.27\.3, the SGLang environment"):
        backend_mod._central_engines(cfg.rollout, initialize(Layout()), {}, str(tmp_path))
    assert not started


def test_the_probe_runs_in_the_servers_environment(monkeypatch, tmp_path):
    """Issue 42: an LD_PRELOAD set for the servers only (``rollout.sglang.ld_preload``) must be
    in the probe's environment, as it is in the launched servers'; the probe used to inherit the
    trainer's environment instead."""
    from megatron_p3o.config.loading import load_config
    from megatron_p3o.rollout import backend as backend_mod
    from megatron_p3o.rollout.sglang import weights
    from megatron_p3o.rollout.sglang.launch import server_env
    from megatron_p3o.runtime.parallel import Layout, initialize

    seen = []
    monkeypatch.setattr(
        "megatron_p3o.rollout.sglang.build_fleet", lambda *a, **k: pytest.fail("launched")
    )
    monkeypatch.setattr(weights, "trainer_nccl_version", lambda: "2.27.3")
    monkeypatch.setattr(weights, "server_nccl_version", lambda py, env=None: seen.append(env))
    monkeypatch.setenv("SGLANG_PYTHON", sglang_python())
    monkeypatch.setenv("LD_PRELOAD", "/trainer/libnccl.so.2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lib = str(tmp_path / "libnccl.so.2")
    cfg = load_config(None, ["rollout.engine=sglang", "rollout.sglang.model_path=/m",
                             "rollout.sglang.device=cuda", "rollout.weight_sync=distributed",
                             "rollout.sglang.sync_backend=nccl", f"rollout.sglang.ld_preload={lib}",
                             "rollout.sglang.gpus=4,5"])  # fmt: skip
    with pytest.raises(BaseException):  # noqa: B017 - the fake probe returns no version
        backend_mod._central_engines(cfg.rollout, initialize(Layout()), {}, str(tmp_path))
    assert seen and seen[0] is not None, "the probe inherited the trainer's environment"
    env = seen[0]
    assert env["LD_PRELOAD"] == lib and env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert "TORCHELASTIC_RESTART_COUNT" not in env
    assert server_env(gpus="4,5", ld_preload=lib)["LD_PRELOAD"] == lib
