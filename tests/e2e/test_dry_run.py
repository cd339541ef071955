"""``--dry-run`` refuses what does not fit and says where the job runs (issue 41, item 3).

A plan over 90% of the GPU used to print "DOES NOT FIT" and exit 0. Now it exits 2 with one line
naming the largest items and the smallest change that fits, and that change, applied with the
``--set`` items the line names, must really fit (exit 0): the suggestion is checked by the
same CLI, not trusted. The placement line counts trainer and rollout GPUs as
``tools/slurm/p3o.sbatch`` places them.
"""

import re
import subprocess
import sys

import pytest

from .cli import ENV, ROOT

pytestmark = pytest.mark.e2e


def _dry(recipe: str, *args):
    cmd = [sys.executable, "-m", "megatron_p3o.train", str(ROOT / "recipes" / recipe),
           "--dry-run", *map(str, args)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)


def test_a_plan_that_does_not_fit_exits_2_with_a_change_that_fits():
    r = _dry("qwen3_8b_h100x8.yaml", "--gpu-gib", 60)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "does not fit: 67.2 GiB per GPU > 90% of 60 GiB" in err[0], err
    assert "largest: optimizer" in err[0] and "Traceback" not in r.stderr
    assert "total" in r.stdout  # the breakdown is still printed
    first = re.search(r"fits with (--set \S+(?: --set \S+)*) \(([\d.]+) GiB\)", err[0])
    assert first, err[0]
    sets = first.group(1).split()
    ok = _dry("qwen3_8b_h100x8.yaml", "--gpu-gib", 60, *sets)
    assert ok.returncode == 0, ok.stderr
    total = re.search(r"total\s+([\d.]+) GiB of 60 GiB — fits", ok.stdout)
    assert total and abs(float(total.group(1)) - float(first.group(2))) < 0.06, ok.stdout


def test_placement_counts_trainer_and_rollout_gpus():
    r = _dry("qwen3_8b_h100x8.yaml")
    assert r.returncode == 0, r.stderr
    # issue 63, item 5: an SGLang recipe's dry run reports this machine's driver check (on a
    # machine without nvidia-smi: none to read, said in one line)
    import shutil

    if shutil.which("nvidia-smi") is None:
        assert "preflight: no nvidia-smi here; the driver and GPU memory are checked at " in (
            r.stdout
        ), r.stdout
    want = (
        "trainer 4 GPUs (1 node) + rollout 4 (4 SGLang servers × tp 1, on the same node) = "
        "1 node × 8 GPUs, 8 in all"
    )
    assert want in r.stdout, r.stdout
    r = _dry("llama31_70b_h100x64.yaml", "--nodes", 8)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("GPUs:"))
    assert "trainer 32 GPUs (4 nodes) + rollout 32 (4 SGLang servers × tp 8" in line, line
    assert "8 nodes × 8 GPUs, 64 in all" in line, line
    r = _dry("llama31_70b_h100x64.yaml", "--nodes", 4)
    assert r.returncode == 2 and "--nodes 4" in r.stderr and "5 in all" in r.stderr, r.stderr


def test_a_wrong_environment_argument_is_one_line_at_the_dry_run():
    """The environment is built once by the dry run: an OpenEnv URL that is not http(s) is one
    line naming the key (issue 64), not an error at the first rollout."""
    r = _dry("tiny_cpu_tools.yaml", "--set", "model.hf_config=" + str(
        ROOT / "recipes/models/tool-llama/config.json"), "--set",
        "rollout.multi_turn.env=megatron_p3o.env.openenv_client:OpenEnvClient", "--set",
        "rollout.multi_turn.env_args={url: 'localhost:8000'}")  # fmt: skip
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stderr
    assert "rollout.multi_turn.env_args" in err[0] and "localhost:8000" in err[0], err
