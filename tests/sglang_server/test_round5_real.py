"""Issue 52, items 1, 5 and 7 on the real SGLang 0.5.23 server on CPU: one server (fp32, the
quickstart base), shared by the three checks.

- Item 7: a trainer attaching with a wrong ``rollout.sglang.tp_size`` takes the server's own
  (``GET /server_info``); with the recipe's value the weight-update group's world counted a rank
  that never joins, and the rendezvous waited for it until the join timeout.
- Item 1: ``/release_memory_occupation`` and ``/resume_memory_occupation`` answer ``null`` (their
  handlers return nothing), which the client took for an object and called ``.get`` on. On a
  machine without CUDA SGLang's release ends in ``torch.cuda.synchronize()`` on its CUDA build of
  torch and kills the server; the server here is launched with a ``sitecustomize`` that makes that
  one call a no-op where no GPU is present (nothing is freed on CPU either way).
- Item 5: a trainer SIGKILLed between ``/begin_weight_update`` and ``/end_weight_update`` leaves the
  server paused with a session open (only ``/end_weight_update`` closes one); the same run started
  again attaches, closes it and trains on, where it got ``400 a weight-update session is already
  open`` before.
"""

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
from safetensors.torch import load_file

from megatron_p3o.rollout.sglang import SGLangConfig, SGLangEngine, build_fleet
from megatron_p3o.rollout.sglang.launch import SGLangSetupError
from megatron_p3o.rollout.sglang.protocol import (
    RESUME_AFTER_PUSH,
    RESUME_BEFORE_PUSH,
    release_payload,
)
from megatron_p3o.runtime.ports import free_port
from tests.e2e.cli import ENV, ROOT
from tests.e2e.test_tiny_recipe import _sets

from .conftest import kill_launched, log_tail

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

# the server's processes only: torch.cuda.synchronize() is a no-op where no GPU is present
NO_CUDA_SYNC = """\
try:
    import torch

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
except Exception:
    pass
"""

# a trainer that SIGKILLs itself right after the server opened its second weight-update session
# (the push after step 1): the server is left paused, with the session open
KILLED_INSIDE_A_PUSH = """\
import os, signal, sys
from megatron_p3o.rollout.sglang.client import SGLangEngine
from megatron_p3o.runtime.errors import run_cli
from megatron_p3o.train import main

post, begun = SGLangEngine._post_checked, []

def killing(self, path, body):
    out = post(self, path, body)
    if path == "/begin_weight_update":
        begun.append(path)
        if len(begun) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    return out

SGLangEngine._post_checked = killing
run_cli(main, "megatron_p3o.train")
"""


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    """(url, the module's directory) of one fp32 CPU server, launched through the trainer's
    launch path."""
    d = tmp_path_factory.mktemp("round5")
    (d / "site").mkdir()
    (d / "site" / "sitecustomize.py").write_text(NO_CUDA_SYNC)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(d / "site")  # read by the launch below, then restored
    sg = SGLangConfig(model_path=str(base / "hf"), dtype="float32", port=free_port(),
                      startup_timeout_s=300, max_restarts=0)  # fmt: skip
    fleet = build_fleet(sg, [], d / "logs", "distributed")
    try:
        fleet.start()
        os.environ.pop("PYTHONPATH")
        if old is not None:
            os.environ["PYTHONPATH"] = old
        yield fleet.router.url, d
    except BaseException:
        print(log_tail(d / "logs"))
        raise
    finally:
        fleet.stop()
        kill_launched(d / "logs")


def _raw(url: str, method: str, path: str, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_an_attached_server_s_tp_size_comes_from_the_server(server, base, capsys):
    """The recipe says tp_size 2, the server serves 1: the client takes 1 (one line says so),
    the group forms with world 2 and a push lands; a colocated push refuses the mismatch in
    one line naming the key and the server."""
    url, d = server
    sg = SGLangConfig(url=url, tp_size=2, startup_timeout_s=60, max_restarts=0)
    fleet = build_fleet(sg, [], d / "attach", "distributed")
    try:
        fleet.start()
        worker = fleet.workers[0]
        assert worker.cfg.tp_size == 1
        err = capsys.readouterr().err
        assert f"at {url}: serves tp_size=1 (GET /server_info); rollout.sglang.tp_size=2" in err
        fleet.init_weight_update_groups("127.0.0.1", free_port())
        named = sorted(load_file(str(base / "hf" / "model.safetensors")).items())
        fleet.update_weights(iter([named]), 7)
        assert worker.served_version() == "7"
    finally:
        fleet.stop()  # an attached server: the group is destroyed there
    colocated = build_fleet(replace(sg, tp_size=2), [], d / "colocated", "colocated")
    with pytest.raises(SGLangSetupError, match=r"rollout.sglang.tp_size=2, but") as e:
        colocated.start()
    assert url in str(e.value) and "tp_size=1" in str(e.value) and "\n" not in str(e.value)


def test_the_memory_routes_answer_null_and_the_client_takes_it(server):
    """The release's answer is ``null``; the client's release and both resumes go through, and
    the server still generates."""
    url, _ = server
    assert _raw(url, "POST", "/release_memory_occupation", release_payload()) == (200, b"null")
    eng = SGLangEngine(SGLangConfig(url=url, max_retries=0))
    eng.resume_memory(RESUME_BEFORE_PUSH)
    eng.resume_memory(RESUME_AFTER_PUSH)
    eng.release_memory()
    eng.resume_memory(RESUME_BEFORE_PUSH)
    eng.resume_memory(RESUME_AFTER_PUSH)
    body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    code, raw = _raw(url, "POST", "/generate", body)
    assert code == 200 and len(json.loads(raw)["output_ids"]) >= 1, raw


def _train(base, run_dir, url, code=None):
    """The tiny recipe attached to ``url`` for 2 steps (gloo group pushes), resumable;
    ``code``: a ``python -c`` program in place of ``-m megatron_p3o.train``."""
    head = [sys.executable, "-c", code] if code else [sys.executable, "-m", "megatron_p3o.train"]
    cmd = [*head, str(ROOT / "recipes" / "tiny_cpu.yaml"), *_sets(base, run_dir, "killed")]
    sets = {
        "rollout.engine": "sglang",
        "rollout.sglang.url": url,
        "rollout.weight_sync": "distributed",
        "rollout.sglang.sync_backend": "gloo",
        "rollout.sglang.startup_timeout_s": 120,  # a server left paused never passes /health
        "rollout.weight_sync_port": free_port(),
        "checkpoint.every": 1,
        "data.eval_path": "''",
    }
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=420)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"trainer silent for 420s: {str(e.stderr)[-2000:]}")


def test_a_trainer_killed_inside_a_push_is_followed_by_one_that_trains(server, base, tmp_path):
    url, d = server
    r = _train(base, tmp_path, url, code=KILLED_INSIDE_A_PUSH)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:] + "\n" + log_tail(d / "logs")
    assert _raw(url, "GET", "/ready") == (503, b"")  # left paused, its session open
    r = _train(base, tmp_path, url)
    assert r.returncode == 0, r.stderr[-3000:] + "\n" + log_tail(d / "logs")
    assert "a weight-update session it left open closed" in r.stderr
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 2
    assert _raw(url, "GET", "/ready") == (200, b"")
    assert SGLangEngine(SGLangConfig(url=url)).served_version() == "2"
