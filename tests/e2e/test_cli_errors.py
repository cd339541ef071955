"""User errors through the real command lines: one line on stderr naming the key, path or value,
exit status 2, no traceback (``--debug`` shows it); under torchrun the line appears once."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from megatron_p3o.runtime.ports import free_port

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
        stdin=subprocess.DEVNULL,  # as under a scheduler: nothing may wait for a prompt
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


# -- issue 41, items 3c and 4: what still ended in a traceback (or a silent wait) -------------


@pytest.mark.e2e
def test_broken_hf_directory_is_one_line(base, tmp_path):
    """A truncated safetensors file (SafetensorError) and a config.json that is not JSON."""
    hf2m = "checkpoints_convert.hf_to_megatron"
    trunc = tmp_path / "trunc"
    shutil.copytree(base / "hf", trunc)
    weights = trunc / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    r = _run("-m", hf2m, "--hf", str(trunc), "--out", str(tmp_path / "o"))
    _one_line_error(r, hf2m, str(weights), "not a readable safetensors file")
    bad = tmp_path / "badcfg"
    shutil.copytree(base / "hf", bad)
    (bad / "config.json").write_text("{not json")
    r = _run("-m", hf2m, "--hf", str(bad), "--out", str(tmp_path / "o"))
    _one_line_error(r, hf2m, str(bad / "config.json"))
    assert not (tmp_path / "o").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("flag,value", [("--tp", "0"), ("--pp", "-1")])
def test_converter_counts_must_be_positive(base, tmp_path, flag, value):
    """--tp 0 was a ZeroDivisionError traceback; argparse now refuses it in one line."""
    hf2m = "checkpoints_convert.hf_to_megatron"
    r = _run("-m", hf2m, "--hf", str(base / "hf"), "--out", str(tmp_path / "o"), flag, value)
    _one_line_error(r, "hf_to_megatron.py", f"argument {flag}", f"{value} must be >= 1")
    assert not (tmp_path / "o").exists()


@pytest.mark.e2e
def test_verify_names_a_missing_hf_directory(tmp_path):
    """transformers took the missing path for a hub repo id: a 40-line OSError traceback."""
    v = "checkpoints_convert.verify"
    r = _run("-m", v, "--hf", str(tmp_path / "none"), "--ckpt", str(tmp_path / "ck"))
    _one_line_error(r, v, str(tmp_path / "none"), "does not exist")


@pytest.mark.e2e
def test_recipe_file_that_is_not_text_or_a_directory(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    r = _run("-m", TRAIN, str(bad), "--dry-run")
    _one_line_error(r, TRAIN, str(bad), "not UTF-8", "line 2")
    r = _run("-m", TRAIN, str(tmp_path), "--dry-run")
    _one_line_error(r, TRAIN, str(tmp_path), "is a directory")


@pytest.mark.e2e
@pytest.mark.parametrize(
    "sets,needle",
    [
        (["optim.lr=-0.001"], "optim.lr=-0.001 must be > 0"),
        (["optim.min_lr=-1e-7"], "optim.min_lr=-1e-07 must be >= 0"),
        (["optim.weight_decay=-0.1"], "optim.weight_decay=-0.1 must be >= 0"),
        (["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p=1.5 must be in (0, 1]"),
        (["rollout.sglang.mem_fraction_static=0"], "mem_fraction_static=0.0 must be in (0, 1]"),
        (["parallel.pp=0"], "parallel.pp=0 must be >= 1"),
        (["eval.sets={s: {path: x.jsonl, temperature: 0}}"], "eval.sets.s.temperature=0"),
    ],
)
def test_out_of_range_values_fail_the_dry_run(sets, needle):
    """A negative lr passed --dry-run; the real run died after building the model."""
    r = _run("-m", TRAIN, RECIPE, *[a for s in sets for a in ("--set", s)], "--dry-run")
    _one_line_error(r, TRAIN, needle)


@pytest.mark.e2e
def test_malformed_prompt_files_name_file_and_line(base, tmp_path):
    """datasets reported these in a 68-line traceback naming neither the file nor the line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    r = _run("-m", TRAIN, RECIPE, *_sets(base, tmp_path, "bad"), "--set", f"data.path={bad}")
    _one_line_error(r, TRAIN, "data.path", str(bad), "line 2 is not valid JSON")
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xe9", "answer": "2"}\n'
                      .encode("latin-1"))  # fmt: skip
    r = _run("-m", TRAIN, RECIPE, *_sets(base, tmp_path, "latin"), "--set", f"data.path={latin}")
    _one_line_error(r, TRAIN, str(latin), "line 2 is not UTF-8")


def _no_wandb_login(home) -> dict:
    env = {k: v for k, v in ENV.items() if k not in ("WANDB_API_KEY", "WANDB_MODE", "NETRC")}
    return {**env, "HOME": str(home)}


@pytest.mark.e2e
def test_wandb_online_without_a_login(base, tmp_path):
    """wandb.init's UsageError was a traceback after the model was built. Without any
    credential the dry run refuses it; with a netrc that holds no key, the run does, in one
    line, before a step."""
    home = tmp_path / "home"
    home.mkdir()
    sets = ["--set", "wandb.enabled=true"]
    r = _run("-m", TRAIN, RECIPE, *sets, "--dry-run", env=_no_wandb_login(home))
    _one_line_error(r, TRAIN, "WANDB_API_KEY", "WANDB_MODE=offline")
    (home / ".netrc").write_text("")
    r = _run("-m", TRAIN, RECIPE, *_sets(base, tmp_path, "wb"), *sets, env=_no_wandb_login(home))
    _one_line_error(r, TRAIN, "WANDB_API_KEY", "WANDB_MODE=offline")
    assert not (tmp_path / "wb" / "metrics.jsonl").exists()


@pytest.mark.e2e
def test_recipe_info_errors(tmp_path):
    info = str(ROOT / "tools/slurm/recipe_info.py")
    r = _run(info, str(tmp_path / "nope.yaml"))
    _one_line_error(r, "recipe_info.py", "nope.yaml", "does not exist")
    r = _run(info, RECIPE, "--set", "optim.lrr=1")
    _one_line_error(r, "recipe_info.py", "optim.lrr", "did you mean 'optim.lr'")
    r = _run(info, RECIPE)  # tiny_cpu names no parallel.world_size
    _one_line_error(r, "recipe_info.py", "parallel.world_size")


@pytest.mark.e2e
def test_dead_attached_sglang_url_fails_in_seconds(base, tmp_path):
    """Nothing listens at rollout.sglang.url: an error naming the URL within seconds, not a
    silent wait of rollout.sglang.startup_timeout_s (900 s by default)."""
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = _run(
        "-m", TRAIN, RECIPE, *_sets(base, tmp_path, "dead"),
        *sglang_disk_sets(url, tmp_path / "w"), timeout=180,
    )  # fmt: skip
    _one_line_error(r, TRAIN, url, "connection refused")
    assert time.monotonic() - t0 < 60


@pytest.mark.e2e
def test_sglang_url_without_a_scheme(tmp_path):
    """urllib's 'unknown url type' came mid-run; the recipe check names the key."""
    r = _run(
        "-m", TRAIN, RECIPE, *sglang_disk_sets("127.0.0.1:9", tmp_path / "w"), "--dry-run"
    )  # fmt: skip
    _one_line_error(r, TRAIN, "rollout.sglang.url='127.0.0.1:9'", "http://HOST:PORT")


@pytest.mark.e2e
def test_stress_grid_file_errors(tmp_path):
    stress = "megatron_p3o.stress"
    grid = tmp_path / "grid.yaml"
    grid.write_bytes(b"base: \xff\n")
    r = _run("-m", stress, str(grid), "--list")
    _one_line_error(r, stress, str(grid), "not UTF-8")
    grid.write_text(f"base: {RECIPE}\nobjectives: {{p3o: 3}}\nmismatch: {{bf16: {{}}}}\n")
    r = _run("-m", stress, str(grid), "--list")
    _one_line_error(r, stress, "objectives.p3o", "expected a mapping")
    grid.write_text(
        f"base: {RECIPE}\nobjectives: {{p3o: {{objective: p3o}}}}\n"
        "mismatch: {bf16: {set: {optim.lr: -1}}}\n"
    )
    r = _run("-m", stress, str(grid), "--list")
    _one_line_error(r, stress, "cell p3o__bf16__s1", "optim.lr=-1.0 must be > 0")
    other = tmp_path / "other_base"
    other.mkdir()
    (other / "weights").write_text("not the shipped base")
    grid.write_text(
        f"base: {RECIPE}\nbase_hash: 003ed285272a9928\nwork: {tmp_path / 'w'}\n"
        f"set: {{model.checkpoint: {other}}}\n"
        "objectives: {p3o: {objective: p3o}}\nmismatch: {bf16: {}}\n"
    )
    r = _run("-m", stress, str(grid))  # refused before any cell runs
    _one_line_error(r, stress, "base_hash", str(other), "expects 003ed285272a9928")
    assert not (tmp_path / "w").exists()


@pytest.mark.e2e
def test_make_tiny_base_errors(tmp_path):
    tool = str(ROOT / "tools/make_tiny_base.py")
    r = _run(tool, "--out", str(tmp_path / "b"), "--eval-every", "0")
    _one_line_error(r, "make_tiny_base.py", "--eval-every", "0 must be >= 1")
    (tmp_path / "file").write_text("")
    r = _run(tool, "--out", str(tmp_path / "file"))
    _one_line_error(r, "make_tiny_base.py", str(tmp_path / "file"), "is a file")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me")
    r = _run(tool, "--out", str(tmp_path / "full"))  # installing the shipped base loses nothing
    _one_line_error(r, "make_tiny_base.py", str(tmp_path / "full"), "no base.json")
    assert (tmp_path / "full" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "b").exists()
