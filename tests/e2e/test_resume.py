"""Checkpoint/resume as a user meets it: re-running the same command continues the run, and a
run killed in the middle of a checkpoint write leaves the previous checkpoint in charge."""

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from .cli import ENV, ROOT
from .test_tiny_recipe import _sets

RECIPE = str(ROOT / "recipes/tiny_cpu.yaml")


def _train(base, run_dir, name, steps, *extra, code=None):
    args = [
        RECIPE,
        *_sets(base, run_dir, name, steps),
        "--set",
        "checkpoint.every=2",
        "--set",
        "checkpoint.keep_last=3",
        *extra,
    ]
    cmd = (
        [sys.executable, "-c", code, *args]
        if code
        else [sys.executable, "-m", "megatron_p3o.train", *args]
    )
    out, err = run_dir / f"{name}.out", run_dir / f"{name}.err"
    # Output to files and a process group of its own: a killed trainer can leave the checkpoint
    # writer's helper processes behind, holding pipes open; they are reaped with the group.
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=ENV, start_new_session=True)
        try:
            rc = proc.wait(timeout=600)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return SimpleNamespace(returncode=rc, stdout=out.read_text(), stderr=err.read_text())


def _tensors(ckpt: Path, tmp: Path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.parent.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(out, weights_only=False)
    return {k: v for k, v in sd.items() if torch.is_tensor(v)}


@pytest.mark.e2e
# plain Adam: tests/e2e/test_preemption.py resumes bitwise at a random step
@pytest.mark.parametrize("dist_opt", [True], ids=["distributed_optimizer"])
def test_four_steps_equal_two_plus_resume_plus_two(base, tmp_path, dist_opt):
    """Also with Megatron's distributed optimizer (its checkpoint format and, without TE, its
    Adam step state: see ``mcore_compat.optimizer_sharded_state``)."""
    extra = ("--set", f"optim.distributed_optimizer={str(dist_opt).lower()}")
    a = _train(base, tmp_path, "straight", 4, *extra)
    assert a.returncode == 0, a.stderr[-3000:]
    b1 = _train(base, tmp_path, "resumed", 2, *extra)
    assert b1.returncode == 0, b1.stderr[-3000:]
    b2 = _train(base, tmp_path, "resumed", 4, *extra)
    assert b2.returncode == 0, b2.stderr[-3000:]
    assert "resumed from" in b2.stdout and "step_000002" in b2.stdout
    ta = _tensors(tmp_path / "straight" / "checkpoints" / "step_000004", tmp_path)
    tb = _tensors(tmp_path / "resumed" / "checkpoints" / "step_000004", tmp_path)
    assert ta.keys() == tb.keys() and any("optimizer" in k for k in ta), sorted(ta)[:5]
    diff = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not diff, diff
    ma = (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    mb = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert len(ma) == len(mb) == 4


CRASH = """
import os, sys
import megatron.core.dist_checkpointing as dc
orig, calls = dc.save, {"n": 0}
def crashing(*a, **k):
    calls["n"] += 1
    orig(*a, **k)            # the chunks are on disk (in the .tmp directory) ...
    if calls["n"] == 2:
        os._exit(9)          # ... and the process dies before the rename and the pointer
dc.save = crashing
from megatron_p3o.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.e2e
def test_kill_during_checkpoint_write_keeps_previous(base, tmp_path):
    from megatron_p3o.checkpoint.state import latest_checkpoint

    r = _train(base, tmp_path, "crash", 6, code=CRASH)
    assert r.returncode == 9, r.stderr[-2000:]
    ck = tmp_path / "crash" / "checkpoints"
    assert (ck / "latest").read_text() == "step_000002"
    assert (ck / "step_000004.tmp").is_dir() and not (ck / "step_000004").exists()
    assert latest_checkpoint(tmp_path / "crash").name == "step_000002"
    again = _train(base, tmp_path, "crash", 6)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "step_000002" in again.stdout
    assert (ck / "latest").read_text() == "step_000006" and not (ck / "step_000004.tmp").exists()


@pytest.mark.e2e
@pytest.mark.distributed
def test_resume_at_another_tensor_parallel_size(base, tmp_path):
    """Steps 1–2 on one process (TP=1), then step 3 either on one process or under torchrun at
    TP=2 from the same checkpoint: the rollout of step 3 is identical (the TP=2 export gathers
    bitwise the same weights) and the loss agrees to float rounding."""
    import json
    import shutil

    first = _train(base, tmp_path, "tp1", 2)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.copytree(tmp_path / "tp1", tmp_path / "tp2")
    one = _train(base, tmp_path, "tp1", 3)
    assert one.returncode == 0, one.stderr[-3000:]
    code = (
        "import runpy, sys; sys.argv = ['torchrun', '--nproc-per-node', '2', '--standalone', "
        "'-m', 'megatron_p3o.train'] + sys.argv[1:]; runpy.run_module('torch.distributed.run', "
        "run_name='__main__')"
    )
    two = _train(base, tmp_path, "tp2", 3, "--set", "parallel.tp=2", code=code)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert "resumed from" in two.stdout and "(step 2)" in two.stdout
    m1 = [json.loads(x) for x in (tmp_path / "tp1" / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (tmp_path / "tp2" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in m1] == [m["step"] for m in m2] == [1, 2, 3]
    a, b = m1[-1], m2[-1]
    assert a["reward_mean"] == b["reward_mean"] and a["n_tokens"] == b["n_tokens"]
    assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(a["loss"])), (a["loss"], b["loss"])
    assert abs(a["ess"] - b["ess"]) <= 1e-6, (a["ess"], b["ess"])
    assert json.loads((tmp_path / "tp2" / "config.json").read_text())["parallel"]["tp"] == 2


@pytest.mark.distributed
def test_resume_at_another_data_parallel_size_regroups_the_rollout_state(base, tmp_path):
    """Steps 1–2 on one process with async rollouts (K = 1) and BAPO's buffer, then step 3 on
    two DP ranks: the data cursor is remapped, the buffers and owed re-evaluations are dealt out
    to the two ranks (each component's ``regroup``), and the run trains on."""
    import json
    import shutil

    sets = ("--set", "rollout.max_staleness=1", "--set", "replay.policy=bapo")
    first = _train(base, tmp_path, "dp1", 2, *sets)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.copytree(tmp_path / "dp1", tmp_path / "dp2")
    code = (
        "import runpy, sys; sys.argv = ['torchrun', '--nproc-per-node', '2', '--standalone', "
        "'-m', 'megatron_p3o.train'] + sys.argv[1:]; runpy.run_module('torch.distributed.run', "
        "run_name='__main__')"
    )
    two = _train(base, tmp_path, "dp2", 3, *sets, code=code)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert "dp=2" in two.stdout and "(step 2)" in two.stdout, two.stdout[-2000:]
    m = [json.loads(x) for x in (tmp_path / "dp2" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in m] == [1, 2, 3] and m[-1]["n_tokens"] > 0


def _corrupt(ckpt: Path, how: str) -> str:
    """Damage ``ckpt`` as a failing disk or a hand would; returns the file named."""
    shard = sorted(ckpt.glob("__0_*.distcp"))[0]
    if how == "truncated shard":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        return shard.name
    if how == "flipped bytes":
        p = ckpt / "common.pt"
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
        return p.name
    (ckpt / "rank" / "0.pt").unlink()  # a missing file
    return "rank/0.pt"


@pytest.mark.e2e
def test_torn_checkpoints_fall_back_to_the_newest_that_verifies(base, tmp_path):
    """Each checkpoint carries a manifest (files, sizes, digests) written last. A torn or
    corrupted ``latest`` is named in one line, kept as ``step_N.damaged`` and the run resumes
    from the newest checkpoint that verifies, ending like an undamaged run; with none left that
    verifies, one clear error."""
    import json as _json
    import shutil

    a = _train(base, tmp_path, "orig", 4)
    assert a.returncode == 0, a.stderr[-3000:]
    ck = tmp_path / "orig" / "checkpoints"
    man = _json.loads((ck / "step_000004" / "manifest.json").read_text())["files"]
    assert "common.pt" in man and any(k.endswith(".distcp") for k in man)
    want = (tmp_path / "orig" / "metrics.jsonl").read_text().splitlines()
    for i, how in enumerate(["truncated shard", "flipped bytes", "missing file"]):
        name = f"torn{i}"
        shutil.copytree(tmp_path / "orig", tmp_path / name)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()[:2]
        (tmp_path / name / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
        bad = _corrupt(tmp_path / name / "checkpoints" / "step_000004", how)
        r = _train(base, tmp_path, name, 4)
        assert r.returncode == 0, r.stderr[-3000:]
        said = [x for x in r.stdout.splitlines() if "is damaged" in x]
        assert len(said) == 1 and f"step_000004 is damaged ({bad}" in said[0], r.stdout[-2000:]
        assert "resuming from step_000002" in said[0]
        root = tmp_path / name / "checkpoints"
        assert (root / "step_000004.damaged").is_dir() and (root / "step_000004").is_dir()
        got = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        strip = lambda rows: [  # noqa: E731 - timings differ
            {k: v for k, v in _json.loads(x).items() if not k.endswith(("_s", "_per_s"))}
            for x in rows
        ]
        assert strip(got) == strip(want), how
    for step in ("step_000002", "step_000004"):  # nothing left that verifies
        _corrupt(tmp_path / "torn0" / "checkpoints" / step, "flipped bytes")
    r = _train(base, tmp_path, "torn0", 6)
    assert r.returncode == 2 and "no checkpoint under" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "step_000004 is damaged (common.pt" in r.stderr


@pytest.mark.e2e
def test_resuming_with_another_recipe_is_refused_unless_allowed(base, tmp_path):
    """The checkpoint keeps its recipe: resuming with other training-relevant keys (here the
    learning rate and the objective's batch) stops with one line naming every key and both
    values; run.allow_config_change=true trains on and logs them; the run's length, layout and
    evaluation may change freely."""
    a = _train(base, tmp_path, "run", 2)
    assert a.returncode == 0, a.stderr[-3000:]
    changed = ("--set", "optim.lr=0.001", "--set", "batch.prompts_per_rollout=4")
    r = _train(base, tmp_path, "run", 4, *changed)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert (
        "optim.lr: 0.0002 -> 0.001" in r.stderr and "batch.prompts_per_rollout: 8 -> 4" in r.stderr
    )
    r = _train(base, tmp_path, "run", 3, *changed, "--set", "run.allow_config_change=true")
    assert r.returncode == 0 and "resuming with a changed recipe" in r.stdout, r.stderr[-2000:]
    r = _train(base, tmp_path, "run", 4, *changed, "--set", "run.allow_config_change=true",
               "--set", "data.eval_every=0")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG), no kill
import megatron_p3o.checkpoint.state as ck
orig, calls = ck.save_model_state, {"n": 0}
def limited(*a, **k):
    calls["n"] += 1
    if calls["n"] == 2:  # the second save meets a filesystem with no room (4 KiB per file)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    return orig(*a, **k)
ck.save_model_state = limited
from megatron_p3o.train import main
from megatron_p3o.runtime.errors import run_cli
run_cli(main, "megatron_p3o.train")
"""


@pytest.mark.e2e
def test_a_save_that_fails_keeps_the_previous_checkpoint(base, tmp_path):
    """A save that cannot be written (the process's file-size limit stands in for a full
    filesystem: every write past it fails with an OS error, as on a full disk) stops the run
    with one line naming the directory and the bytes needed; the partial directory is removed,
    the previous checkpoint and ``latest`` are intact and the same command resumes from them."""
    from megatron_p3o.checkpoint.manifest import check
    from megatron_p3o.checkpoint.state import LATEST

    r = _train(base, tmp_path, "full", 4, code=FULL_DISK)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    root = tmp_path / "full" / "checkpoints"
    assert f"saving checkpoint step_000004 in {root} failed (" in r.stderr
    assert "bytes and" in r.stderr and "step_000002 and latest are intact" in r.stderr
    assert (root / LATEST).read_text().strip() == "step_000002"
    assert not (root / "step_000004.tmp").exists() and check(root / "step_000002") is None
    r = _train(base, tmp_path, "full", 4)
    assert r.returncode == 0 and "step_000002" in r.stdout, r.stderr[-3000:]
