"""User errors through the real command lines: one line on stderr naming the key, path or value,
exit status 2, no traceback (``--debug`` shows it); under torchrun the line appears once."""

import json
import os
import subprocess
import sys

import pytest

from megatron_p3o.ports import free_port

from .cli import ENV, ROOT, sglang_disk_sets, torchrun
from .test_tiny_recipe import _sets

RECIPE = str(ROOT / "recipes/tiny_cpu.yaml")


def _run(*args, timeout=300, env=None):
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=env or ENV,
        timeout=timeout,
        cwd=ROOT,
    )


def _one_line_error(r, prog: str, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-1500:], r.stderr[-3000:])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith(f"{prog}: error: ")]
    assert len(errors) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


TRAIN = "megatron_p3o.train"


@pytest.mark.e2e
@pytest.mark.parametrize(
    "case,sets,needles",
    [
        ("typo", ["optim.lrr=1"], ["optim.lrr", "did you mean 'optim.lr'"]),
        ("bad value", ["optim.lr=fast"], ["optim.lr", "'fast'"]),
        ("bad choice", ["rollout.precision=fp9"], ["rollout.precision", "fp9"]),
        ("unknown objective", ["loss.objective=p30"], ["p30"]),
        ("impossible layout", ["parallel.tp=3"], ["tp×pp×cp = 3×1×1"]),
        (
            "batch arithmetic",
            ["batch.max_tokens_per_gpu=null", "batch.micro_batch_size=7"],
            ["micro_batch_size", "7"],
        ),
        ("token budget", ["batch.max_tokens_per_gpu=0"], ["batch.max_tokens_per_gpu=0", ">= 1"]),
    ],
)
def test_train_config_errors(tmp_path, case, sets, needles):
    args = [a for s in sets for a in ("--set", s)]
    r = _run("-m", TRAIN, RECIPE, "--set", f"run.dir={tmp_path}", *args)
    _one_line_error(r, TRAIN, *needles)
    assert not (tmp_path / "run").exists() and not list(tmp_path.iterdir())  # nothing written


@pytest.mark.e2e
def test_train_file_errors(base, tmp_path):
    r = _run("-m", TRAIN, str(tmp_path / "nope.yaml"))
    _one_line_error(r, TRAIN, "nope.yaml", "does not exist")
    r = _run(
        "-m",
        TRAIN,
        RECIPE,
        *_sets(base, tmp_path, "x"),
        "--set",
        f"model.checkpoint={tmp_path / 'gone'}",
    )
    _one_line_error(r, TRAIN, str(tmp_path / "gone"))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "metadata.json").write_text("{}")
    r = _run(
        "-m", TRAIN, RECIPE, *_sets(base, tmp_path, "x"), "--set", f"model.checkpoint={foreign}"
    )
    _one_line_error(r, TRAIN, str(foreign), "not a checkpoint written by megatron_p3o")
    r = _run(
        "-m",
        TRAIN,
        RECIPE,
        *_sets(base, tmp_path, "x"),
        "--set",
        f"data.path={tmp_path / 'd.jsonl'}",
    )
    _one_line_error(r, TRAIN, "data.path", "d.jsonl")


@pytest.mark.e2e
def test_debug_shows_the_traceback(tmp_path):
    r = _run("-m", TRAIN, RECIPE, "--set", "optim.lrr=1", "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr and "optim.lrr" in r.stderr
    r = _run("-m", TRAIN, RECIPE, "--set", "optim.lrr=1", env={**ENV, "P3O_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.e2e
def test_dead_rollout_server(base, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    r = _run(
        "-m",
        TRAIN,
        RECIPE,
        *_sets(base, tmp_path, "dead"),
        *sglang_disk_sets(url, tmp_path / "w"),
        "--set",
        "rollout.sglang.startup_timeout_s=2",
    )
    _one_line_error(r, TRAIN, url)


@pytest.mark.e2e
def test_non_finite_rollout_logprobs(base, tmp_path):
    from ..sglang_standin import EmbeddedStandIn

    srv = EmbeddedStandIn(base / "ckpt" / "hf", nan_logprobs=True)
    try:
        r = _run(
            "-m",
            TRAIN,
            RECIPE,
            *_sets(base, tmp_path, "nan"),
            *sglang_disk_sets(srv.url, tmp_path / "w"),
            "--set",
            "data.eval_path=''",
        )
    finally:
        srv.server.shutdown()
    _one_line_error(r, TRAIN, "non-finite")


@pytest.mark.e2e
def test_dry_run_defaults_to_one_process_or_torchrun_world():
    r = _run("-m", TRAIN, RECIPE, "--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "OK (world size 1)" in r.stdout
    r = _run("-m", TRAIN, RECIPE, "--dry-run", env={**ENV, "WORLD_SIZE": "2"})
    assert r.returncode == 0 and "OK (world size 2)" in r.stdout, r.stderr[-2000:]


@pytest.mark.e2e
def test_stress_errors(tmp_path):
    r = _run("-m", "megatron_p3o.stress", str(tmp_path / "grid.yaml"), "--list")
    _one_line_error(r, "megatron_p3o.stress", "grid.yaml", "does not exist")
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        f"base: {RECIPE}\nseeds: [1]\nobjectives: {{p3o: {{objective: p3o}}}}\n"
        "mismatch: {bf16: {family: baseline, level: 0, set: {rollout.precison: bf16}}}\n"
    )
    r = _run("-m", "megatron_p3o.stress", str(grid), "--list")
    _one_line_error(r, "megatron_p3o.stress", "precison")


@pytest.mark.e2e
def test_convert_errors(base, tmp_path):
    hf2m, m2hf = "checkpoints_convert.hf_to_megatron", "checkpoints_convert.megatron_to_hf"
    r = _run("-m", hf2m, "--hf", str(tmp_path / "none"), "--out", str(tmp_path / "o"))
    _one_line_error(r, hf2m, str(tmp_path / "none"))
    (tmp_path / "exists").mkdir()
    r = _run("-m", hf2m, "--hf", str(base / "hf"), "--out", str(tmp_path / "exists"))
    _one_line_error(r, hf2m, str(tmp_path / "exists"), "already exists")
    r = _run("-m", m2hf, "--ckpt", str(base / "hf"), "--out", str(tmp_path / "o2"))
    _one_line_error(r, m2hf, str(base / "hf"))
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()
    assert json.loads((base / "base.json").read_text())  # the inputs are untouched


@pytest.mark.e2e
@pytest.mark.distributed
def test_torchrun_reports_once(tmp_path):
    r = subprocess.run(
        [
            *torchrun(2),
            "-m",
            TRAIN,
            RECIPE,
            "--set",
            "optim.lrr=1",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode != 0
    errors = [x for x in r.stderr.splitlines() if f"{TRAIN}: error:" in x]
    assert len(errors) == 1 and "optim.lrr" in errors[0], r.stderr[-3000:]
    assert "[rank0]:" not in r.stderr and "[rank1]:" not in r.stderr, r.stderr[-3000:]
    assert os.environ.get("RANK") is None  # the test itself is not a rank
