"""tools/slurm/p3o.sbatch placement, run with stand-in scontrol/srun/curl that record what the
script would launch (no cluster needed): which nodes train, how many SGLang servers run where,
and what the trainer is told."""

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, recipe, nodes, healthy=True, env=None):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "srun.log"
    fakes = {
        "scontrol": "#!/bin/sh\n" + "".join(f"echo n{i}\n" for i in range(1, nodes + 1)),
        # records the task's CUDA_VISIBLE_DEVICES (set with env) and the command line
        "srun": '#!/bin/sh\ncvd=$(echo "$*" | '
        "sed -n 's/.* env CUDA_VISIBLE_DEVICES=\\([0-9,]*\\) .*/\\1/p')\n"
        f'echo "$cvd|$*" >> {log}\n',
        # records its arguments and the header files it was given (-H @file)
        "curl": f'#!/bin/sh\necho "$*" >> {tmp_path / "curl.log"}\n'
        f'for a in "$@"; do case $a in @*) cat "${{a#@}}" >> {tmp_path / "curl.hdr"};; esac; done\n'
        f"exit {0 if healthy else 7}\n",
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
        "SGLANG_PYTHON": "/bin/true",  # the servers' interpreter (serve.py runs it; srun is fake)
        "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
        **(env or {}),
    }
    # from a scratch directory (with the recipes' relative paths valid there): nothing may be
    # written into the repository
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    for m in ("Qwen3-8B-fp8", "Qwen3-32B-fp8", "Llama-3.1-70B-fp8"):  # present: no conversion
        (tmp_path / "hf" / m).mkdir(parents=True)
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
            nodes == 1 or any("cli.serve router" in x for x in lines)
        ):
            break
        time.sleep(0.1)
    return [line.split("|", 1) for line in log.read_text().splitlines()]


def test_multi_node_placement(tmp_path, monkeypatch):
    monkeypatch.delenv("P3O_SGLANG_API_KEY", raising=False)
    calls = _run(tmp_path, "recipes/qwen3_32b_h100x32.yaml", nodes=4)
    # one secret for the job, made by the script: the health checks send it from a header file;
    # it is on no command line (servers and router get it through serve.py, the trainer from
    # the environment)
    headers = set((tmp_path / "curl.hdr").read_text().splitlines())
    assert len(headers) == 1 and next(iter(headers)).startswith("Authorization: Bearer ")
    key = next(iter(headers)).split()[-1]
    assert len(key) == 48
    assert all(key not in c[1] and "--api-key" not in c[1] for c in calls)
    assert key not in (tmp_path / "curl.log").read_text()
    import yaml

    run = yaml.safe_load((ROOT / "recipes/qwen3_32b_h100x32.yaml").read_text())["run"]
    logs = tmp_path / run.get("dir", "runs") / run["name"] / "logs"
    assert logs.is_dir(), "server logs belong under the run directory"
    assert not list(tmp_path.glob("sglang-*.log")) and not list(tmp_path.glob("router-*.log"))
    servers = [c for c in calls if "cli.serve server" in c[1]]
    train = [c for c in calls if "torch.distributed.run" in c[1]]
    router = [c for c in calls if "cli.serve router" in c[1]]
    assert len(servers) == 4 and {c[0] for c in servers} == {"0,1,2,3", "4,5,6,7"}
    assert sorted(c[1].split("-w ")[1].split()[0] for c in servers) == ["n3", "n3", "n4", "n4"]
    assert all("recipes/qwen3_32b_h100x32.yaml --port 3000" in c[1] for c in servers)
    assert all(f"--log {run.get('dir', 'runs')}/{run['name']}/logs/" in c[1] for c in servers)
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
    servers = [c for c in calls if "cli.serve server" in c[1]]
    train = [c for c in calls if "torch.distributed.run" in c[1]]
    assert sorted(c[0] for c in servers) == ["4", "5", "6", "7"]  # training has GPUs 0-3
    assert train[0][0] == "0,1,2,3" and "--nproc-per-node 4" in train[0][1]
    assert not [c for c in calls if "cli.serve router" in c[1]] or len(servers) > 1


def test_a_missing_sglang_interpreter_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """Issue 24, item 3: the servers run with SGLang's own interpreter (rollout.sglang.python or
    $SGLANG_PYTHON), never the trainer's; without one the script stops before launching."""
    monkeypatch.setenv("SGLANG_PYTHON", "")
    with pytest.raises(AssertionError, match="needs its environment's interpreter"):
        _run(tmp_path, "recipes/qwen3_8b_h100x8.yaml", nodes=1, env={"SGLANG_PYTHON": ""})
    assert not (tmp_path / "srun.log").exists()


def test_too_few_nodes_is_refused(tmp_path):
    with pytest.raises(AssertionError, match="needs 4 training node"):
        _run(tmp_path, "recipes/llama31_70b_h100x64.yaml", nodes=4)


def test_a_server_that_never_comes_up_stops_the_job(tmp_path):
    """The wait loops have liveness and time bounds: a server whose launcher exited (here:
    srun returns at once and /health never answers) fails the job, naming the log directory,
    instead of waiting forever."""
    with pytest.raises(AssertionError, match="launcher exited before it became healthy"):
        _run(tmp_path, "recipes/qwen3_8b_h100x8.yaml", nodes=1, healthy=False)


_FAKE_SGLANG = r"""#!/usr/bin/env python3
# stands in for the SGLang environment's python: records argv, environment and --config file,
# prints what SGLang prints (server_args with the key), exits
import json, os, sys
rec = {"argv": sys.argv, "env_key": os.environ.get("P3O_SGLANG_API_KEY")}
if "--config" in sys.argv:
    rec["config"] = open(sys.argv[sys.argv.index("--config") + 1]).read()
open(os.environ["FAKE_RECORD"], "a").write(json.dumps(rec) + "\n")
print("server_args=ServerArgs(api_key='%s', ...)" % (rec["env_key"] or ""), flush=True)
"""


def test_serve_keeps_the_key_out_of_argv_and_logs(tmp_path):
    """serve.py (what the batch script runs on the rollout nodes) launches the recipe's server
    and router with the trainer's own command and process handling: the key reaches the server
    in its --config file and the router through its environment, is on neither command line,
    and the log files carry it redacted; the server gets the recipe's FP8 serving flags."""
    import json

    from megatron_p3o.weight_sync.fp8 import quantization_config

    fake = tmp_path / "python"
    fake.write_text(_FAKE_SGLANG)
    fake.chmod(stat.S_IRWXU)
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps({"quantization_config": quantization_config()}))
    key = "k" * 48
    env = {**os.environ, "SGLANG_PYTHON": str(fake), "P3O_SGLANG_API_KEY": key,
           "FAKE_RECORD": str(tmp_path / "rec.jsonl"), "PYTHONPATH": str(ROOT)}  # fmt: skip
    base = [sys.executable, "-m", "megatron_p3o.cli.serve"]
    recipe = str(ROOT / "recipes/qwen3_32b_h100x32.yaml")
    for what, extra in (("server", []), ("router", ["--workers", "http://n3:30000"])):
        r = subprocess.run(
            base + [what, recipe, "--port", "30001", "--log", str(tmp_path / f"{what}.log"),
                    "--set", f"rollout.sglang.model_path={fp8}", *extra],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        log = (tmp_path / f"{what}.log").read_text()
        assert "server_args=" in log and key not in log and "<redacted>" in log.lower()
    server, router = [json.loads(x) for x in (tmp_path / "rec.jsonl").read_text().splitlines()]
    for rec in (server, router):
        assert not [a for a in rec["argv"] if key in a] and "--api-key" not in rec["argv"]
    assert key in server["config"]
    argv = " ".join(server["argv"])
    assert "--quantization fp8" in argv and "--kv-cache-dtype fp8_e4m3" in argv
    assert f"--model-path {fp8}" in argv and "--tp-size 4" in argv and "--port 30001" in argv
    assert router["env_key"] == key and "--worker-urls http://n3:30000" in " ".join(router["argv"])


def test_preemption_signal_stops_training_and_requeues(tmp_path):
    """Slurm's warning signal (USR1, --signal=B:USR1@300) to the batch shell: it writes the run's
    STOP file (the trainer checkpoints after its current step and exits 75; here a stand-in
    training step that waits for the file) and requeues the job; the requeued job removes the
    file before training again."""
    import time

    import yaml

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    run = yaml.safe_load((ROOT / "recipes/qwen3_8b_h100x8.yaml").read_text())["run"]
    stop = tmp_path / run["dir"] / run["name"] / "STOP"
    log = tmp_path / "srun.log"
    fakes = {
        "scontrol": f'#!/bin/sh\ncase "$1" in requeue) echo "$*" >> {tmp_path / "requeue.log"};;'
        " *) echo n1;; esac\n",
        # the training step waits for the STOP file (what the trainer does after its step)
        "srun": f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in *torch.distributed.run*)\n'
        f"  i=0; while [ ! -e {stop} ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done\n"
        "  exit 75;; esac\n",
        "curl": "#!/bin/sh\nexit 0\n",
    }
    for name, text in fakes.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(stat.S_IRWXU)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "x",
           "SLURM_JOB_ID": "7", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
           "PYTHONWARNINGS": "ignore", "SGLANG_PYTHON": "/bin/true"}  # fmt: skip
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    (tmp_path / "hf" / "Qwen3-8B-fp8").mkdir(parents=True)
    script = [str(ROOT / "tools/slurm/p3o.sbatch"), "recipes/qwen3_8b_h100x8.yaml"]
    stop.parent.mkdir(parents=True)
    stop.touch()  # left by the job before: the requeued job removes it before training
    proc = subprocess.Popen(["bash", *script], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline and not (
        log.exists() and "torch.distributed.run" in log.read_text()
    ):
        time.sleep(0.2)
    assert not stop.exists()  # removed at the start of the (requeued) job
    time.sleep(0.5)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert stop.exists() and "stop requested" in err
    assert (tmp_path / "requeue.log").read_text().split() == ["requeue", "7"]
