"""tools/slurm/p3o.sbatch placement, run with stand-in scontrol/srun/curl that record what the
script would launch (no cluster needed): which nodes train, how many SGLang servers run where,
and what the trainer is told."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, recipe, nodes, healthy=True):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "srun.log"
    fakes = {
        "scontrol": "#!/bin/sh\n" + "".join(f"echo n{i}\n" for i in range(1, nodes + 1)),
        # records the task's CUDA_VISIBLE_DEVICES (set with env) and the command line
        "srun": '#!/bin/sh\ncvd=$(echo "$*" | '
        "sed -n 's/.* env CUDA_VISIBLE_DEVICES=\\([0-9,]*\\) .*/\\1/p')\n"
        f'echo "$cvd|$*" >> {log}\n',
        "curl": f'#!/bin/sh\necho "$*" >> {tmp_path / "curl.log"}\nexit {0 if healthy else 7}\n',
    }
    for name, text in fakes.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(stat.S_IRWXU)
    env = {
        **os.environ,
        "PATH": f"{bin_}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "x",
        "SLURM_JOB_ID": "7",
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
    }
    # from a scratch directory (with the recipes' relative paths valid there): nothing may be
    # written into the repository
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    r = subprocess.run(
        ["bash", str(ROOT / "tools/slurm/p3o.sbatch"), recipe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    import time

    for _ in range(100):  # servers and router are launched in the background (&): let them log
        lines = log.read_text().splitlines()
        if any("torch.distributed.run" in x for x in lines) and (
            nodes == 1 or any("sglang_router" in x for x in lines)
        ):
            break
        time.sleep(0.1)
    return [line.split("|", 1) for line in log.read_text().splitlines()]


def test_multi_node_placement(tmp_path, monkeypatch):
    monkeypatch.delenv("P3O_SGLANG_API_KEY", raising=False)
    calls = _run(tmp_path, "recipes/qwen3_32b_h100x32.yaml", nodes=4)
    # one secret for the job: every server and the router require it, health checks send it,
    # and the trainer gets it from the environment only (not on its command line)
    keys = {c[1].split("--api-key ")[1].split()[0] for c in calls if "--api-key" in c[1]}
    assert len(keys) == 1 and len(next(iter(keys))) == 48, keys
    key = next(iter(keys))
    launched = [c for c in calls if "launch_server" in c[1] or "sglang_router" in c[1]]
    assert launched and all(f"--api-key {key}" in c[1] for c in launched)
    assert all(key not in c[1] for c in calls if "torch.distributed.run" in c[1])
    health = (tmp_path / "curl.log").read_text().splitlines()
    assert health and all(f"Authorization: Bearer {key}" in h for h in health)
    import yaml

    run = yaml.safe_load((ROOT / "recipes/qwen3_32b_h100x32.yaml").read_text())["run"]
    logs = tmp_path / run.get("dir", "runs") / run["name"] / "logs"
    assert logs.is_dir(), "server logs belong under the run directory"
    assert not list(tmp_path.glob("sglang-*.log")) and not list(tmp_path.glob("router-*.log"))
    servers = [c for c in calls if "sglang.launch_server" in c[1]]
    train = [c for c in calls if "torch.distributed.run" in c[1]]
    router = [c for c in calls if "sglang_router" in c[1]]
    assert len(servers) == 4 and {c[0] for c in servers} == {"0,1,2,3", "4,5,6,7"}
    assert sorted(c[1].split("-w ")[1].split()[0] for c in servers) == ["n3", "n3", "n4", "n4"]
    assert all(
        "--tp-size 4" in c[1]
        and "--quantization fp8" in c[1]
        and "--kv-cache-dtype fp8_e4m3" in c[1]
        for c in servers
    )
    assert len(router) == 1 and len(train) == 1
    t = train[0][1]
    assert (
        "-w n1,n2" in t
        and "--nnodes 2" in t
        and "--nproc-per-node 8" in t
        and "--rdzv-backend c10d" in t
    )
    assert "rollout.sglang.url=http://n3:30080" in t
    assert (
        'rollout.sglang_workers=["http://n3:30000","http://n3:30001","http://n4:30000","http://n4:30001"]'
        in t
    )


def test_single_node_shares_gpus(tmp_path):
    calls = _run(tmp_path, "recipes/qwen3_8b_h100x8.yaml", nodes=1)
    servers = [c for c in calls if "sglang.launch_server" in c[1]]
    train = [c for c in calls if "torch.distributed.run" in c[1]]
    assert sorted(c[0] for c in servers) == ["4", "5", "6", "7"]  # training has GPUs 0-3
    assert train[0][0] == "0,1,2,3" and "--nproc-per-node 4" in train[0][1]
    assert not [c for c in calls if "sglang_router" in c[1]] or len(servers) > 1


def test_too_few_nodes_is_refused(tmp_path):
    with pytest.raises(AssertionError, match="needs 4 training node"):
        _run(tmp_path, "recipes/llama31_70b_h100x64.yaml", nodes=4)


def test_a_server_that_never_comes_up_stops_the_job(tmp_path):
    """The wait loops have liveness and time bounds: a server whose launcher exited (here:
    srun returns at once and /health never answers) fails the job, naming the log directory,
    instead of waiting forever."""
    with pytest.raises(AssertionError, match="launcher exited before it became healthy"):
        _run(tmp_path, "recipes/qwen3_8b_h100x8.yaml", nodes=1, healthy=False)
