"""A server whose scheduler is blocked in a weight broadcast (issue 63, item 4b), on the real
SGLang 0.5.23 server on CPU over gloo.

A trainer stopped inside ``/update_weights_from_distributed`` — here frozen with SIGSTOP the
moment it would broadcast; with NCCL a trainer killed there leaves the server the same way until
NCCL's timeout — leaves the server paused, a weight-update session open and its scheduler waiting
for the bucket. It accepts connections (``/ready`` answers from the tokenizer manager) and
answers nothing the scheduler must handle. A trainer attaching to it says so in one line within
seconds (``rollout/sglang/attach.py``), instead of waiting ``request_timeout_s`` (600 s).
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_p3o.rollout.sglang import SGLangConfig, build_fleet
from megatron_p3o.rollout.sglang.protocol import EngineUnavailableError
from megatron_p3o.runtime.ports import free_port
from tests.e2e.cli import ENV, ROOT

from .conftest import kill_launched, log_tail

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]

FROZEN_TRAINER = """
import os, signal, sys, time, torch
from megatron_p3o.rollout.sglang import SGLangConfig, build_fleet
from megatron_p3o.rollout.sglang import fleet as fl
url, port, logs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fleet = build_fleet(SGLangConfig(url=url, sync_backend="gloo"), [], logs, "distributed").start()
fleet.init_weight_update_groups("127.0.0.1", port)
def frozen(*a, **k):  # the request (posted from a thread) reaches the server, then a freeze
    time.sleep(3.0)
    print("FROZEN", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
fl.broadcast = frozen
fleet.update_weights(iter([[("model.norm.weight", torch.ones(64))]]), 7)
"""


def test_attaching_to_a_scheduler_blocked_in_a_broadcast_is_one_line(base, tmp_path):
    logs = tmp_path / "server"
    sg = SGLangConfig(model_path=str(base / "hf"), dtype="float32", port=free_port(),
                      startup_timeout_s=300, max_restarts=0)  # fmt: skip
    fleet = build_fleet(sg, [], logs, "distributed")
    trainer = None
    try:
        fleet.start()
        url = fleet.router.url
        trainer = subprocess.Popen(
            [sys.executable, "-c", FROZEN_TRAINER, url, str(free_port()), str(tmp_path / "t1")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=ROOT,
        )  # fmt: skip
        assert trainer.stdout.readline().strip() == "FROZEN", log_tail(logs)
        time.sleep(1.0)  # the server is inside its broadcast
        attach = SGLangConfig(url=url, startup_timeout_s=60, max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="scheduler is blocked") as e:
            build_fleet(attach, [], tmp_path / "t2", "distributed").start()
        took = time.monotonic() - t0
        assert took < 45.0 and "\n" not in str(e.value) and url in str(e.value), took
    finally:
        if trainer is not None:
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait()
        fleet.stop()
        kill_launched(tmp_path)
