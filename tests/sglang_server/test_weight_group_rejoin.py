"""A restarted trainer rejoins the weight-update group of a server that outlived it (issue 42,
item 3), on the real SGLang 0.5.23 server on CPU over gloo.

The server keeps a weight-update group after the trainer that formed it exits, and torch refuses
a second group of the same name; under one fixed name a second trainer got ``400 … The specified
group name has already been created`` at once and then hung in its own end of the rendezvous for
the store's 10 minutes. Here one trainer process trains one step against an attached server and
exits; a second one (the same run, resumed: what ``p3o.sbatch --max-restarts`` does) joins the
same server and trains; its pushes land: the served ``weight_version`` is its last, and the
server's greedy decode equals a transformers decode of its final weights.
"""

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from megatron_p3o.rollout.embedded import EmbeddedEngine
from megatron_p3o.rollout.sglang import SGLangConfig, build_fleet
from megatron_p3o.rollout.sglang.weights import group_name
from megatron_p3o.runtime.ports import free_port
from megatron_p3o.types import SamplingParams
from tests.e2e.cli import ENV, ROOT
from tests.e2e.test_tiny_recipe import _sets

from .conftest import kill_launched, log_tail

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]
PROMPTS = [[1, *[5 + (i * 7 + j) % 10 for j in range(5)]] for i in range(8)]
GREEDY = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6, stop_token_ids=(2,), seed=0)


def test_group_names_are_per_launch():
    env = {"SLURM_JOB_ID": "4242", "TORCHELASTIC_RESTART_COUNT": "2"}
    a, b = group_name(env), group_name(env)
    assert a != b and a.startswith("p3o_ws_4242_r2_") and b.startswith("p3o_ws_4242_r2_")
    assert group_name({}).startswith("p3o_ws_local_r0_")
    assert "/" not in group_name({"TORCHELASTIC_RUN_ID": "a/b c"})


def _train(base, run_dir, url, steps, timeout):
    cmd = [sys.executable, "-m", "megatron_p3o.train", str(ROOT / "recipes" / "tiny_cpu.yaml"),
           *_sets(base, run_dir, "rejoin", steps=steps)]  # fmt: skip
    sets = {
        "rollout.engine": "sglang",
        "rollout.sglang.url": url,
        "rollout.weight_sync": "distributed",
        "rollout.sglang.sync_backend": "gloo",
        "rollout.weight_sync_port": free_port(),
        "checkpoint.every": 1,
    }
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"trainer ({steps} steps) silent for {timeout}s: {str(e.stderr)[-2000:]}")


def test_a_second_trainer_rejoins_a_running_server(base, tmp_path):
    logs = tmp_path / "server"
    sg = SGLangConfig(model_path=str(base / "hf"), dtype="float32", port=free_port(),
                      startup_timeout_s=300, max_restarts=0)  # fmt: skip
    fleet = build_fleet(sg, [], logs, "distributed")
    try:
        fleet.start()
        url = fleet.router.url
        for steps in (1, 2):  # the second process resumes the run and trains step 2
            r = _train(base, tmp_path, url, steps, timeout=420)
            assert r.returncode == 0, r.stderr[-3000:] + "\n" + log_tail(logs)
        joins = (logs / "server0.log").read_text().count("init custom process group")
        assert joins == 2, log_tail(logs)
        run = tmp_path / "rejoin"
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2]
        assert fleet.workers[0].served_version() == "2"  # version step + 1 of the last step
        hf = tmp_path / "hf2"
        subprocess.run([sys.executable, "-m", "checkpoints_convert.megatron_to_hf", "--ckpt",
                        str(run), "--out", str(hf)], check=True, env=ENV, capture_output=True,
                       timeout=300)  # fmt: skip
        cfg = json.loads((hf / "config.json").read_text())
        named = sorted(load_file(str(next(hf.glob("*.safetensors")))).items())
        ref = EmbeddedEngine(cfg, "fp32", pad_token_id=cfg.get("pad_token_id") or 0)
        ref.update_weights([named], 2)
        want = [s.completion_ids for s in ref.generate(PROMPTS, 1, GREEDY)]
        got = fleet.generate(PROMPTS, 1, GREEDY)
        assert {s.weight_version for s in got} == {2}
        assert [s.completion_ids for s in got] == want
    finally:
        fleet.stop()
        kill_launched(logs)
