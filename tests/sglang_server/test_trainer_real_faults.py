"""The trainer with rollouts from real SGLang 0.5.23 servers on CPU, launched by the trainer
itself: a server killed mid-run, a stop with a batch in flight, two servers behind sglang-router
with a TP=2 × PP=2 trainer, and the MoE recipe (learning and bf16 mismatch:
``test_trainer_real.py``). Every run's servers are stopped by process group in teardown
(``reap``), also when the run fails.
"""

import os
import re
import signal
import threading
import time

import pytest

from .test_trainer_real import _train

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]


def test_a_server_killed_mid_run_is_relaunched_and_reloaded(base, reap):
    """kill -9 of the server's process group while the run goes on (async, K = 1, disk sync):
    the trainer relaunches it, reloads the last pushed weights, and finishes; every sample it
    trained on came from a version within the staleness bound."""
    run = reap / "killed"
    killed = []

    def killer():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 1:
                pgid = int((run / "sglang" / "server0.pid").read_text())
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
                return
            time.sleep(0.1)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    m, r = _train(base, reap, "killed", "rollout.weight_sync=disk",
                  f"rollout.weight_sync_dir={reap / 'sync'}", "rollout.max_staleness=1",
                  steps=4)  # fmt: skip
    t.join(timeout=5)
    assert killed, "the server was never killed"
    assert "relaunching" in r.stderr
    assert int((run / "sglang" / "server0.pid").read_text()) != killed[0]
    assert [x["step"] for x in m] == list(range(1, 5))
    assert all(x["staleness_max"] <= 1 for x in m)


def test_a_stopped_async_run_trains_on_the_batch_it_had_in_flight(base, reap):
    """K = 1: the run stops after step 1 (``run.exit_after_minutes``); batch 1 was started by the
    server with version 0 before the checkpoint (version 1's push may retract and resume some
    requests), so it travels in the checkpoint, and the resumed run (a new server, loaded with
    version 1) trains on exactly those samples at step 2: their versions and mean reward are the
    checkpoint's, not a new rollout's."""
    import torch

    from megatron_p3o.runtime.preemption import EXIT_PREEMPTED

    sets = ("rollout.max_staleness=1", "data.eval_path=''")
    _train(base, reap, "inflight", *sets, "run.exit_after_minutes=0.002", steps=3,
           rc=EXIT_PREEMPTED)  # fmt: skip
    common = torch.load(reap / "inflight/checkpoints/step_000001/common.pt", weights_only=True)
    (batch,) = common["trainer"]["ranks"]["0"]["rollout"]["carried"]
    samples = [x for g in batch["groups"] for x in g["samples"]]
    versions = {x["weight_version"] for x in samples}  # version 1's push may land mid-batch
    assert batch["index"] == 1 and versions <= {0, 1}
    m, r = _train(base, reap, "inflight", *sets, steps=3)
    assert "resumed from" in r.stdout and [x["step"] for x in m] == [1, 2, 3]
    assert m[1]["rollout_version"] == 0 and m[1]["staleness_max"] == 1 - min(versions)
    assert m[1]["reward_mean"] == pytest.approx(sum(x["reward"] for x in samples) / len(samples))
    assert m[2]["rollout_version"] == 1


def test_two_servers_behind_the_router_with_a_tp2_pp2_trainer(base, reap):
    """servers: 2 with sglang-router 0.3.2 in front; a TP=2 × PP=2 trainer pushes its weights
    to both servers over one gloo group spanning both (world 3: trainer rank 0, server 0 as
    rank 1, server 1 as rank 2; each bucket broadcast once) after every step; the router spreads
    the requests, and every DP leader's prompts reach the servers exactly once."""
    held = reap / "heldout_small.jsonl"
    held.write_text("".join((base / "heldout.jsonl").read_text().splitlines(True)[:16]))
    m, _ = _train(base, reap, "router", "parallel.tp=2", "parallel.pp=2",
                  "rollout.sglang.servers=2", f"data.eval_path={held}", nproc=4,
                  steps=2)  # fmt: skip
    logs = [(reap / "router" / "sglang" / f"server{i}.log").read_text() for i in (0, 1)]
    for i, x in enumerate(logs):  # the servers' own record of the group they joined
        joins = re.findall(r"init custom process group: .*rank=(\d+), world_size=(\d+)", x)
        assert joins == [(str(i + 1), "3")], joins
    # after start-up (each server warms itself up with one /generate of its own)
    logs = [x.split("The server is fired up", 1)[1] for x in logs]
    gens = [x.count('"POST /generate HTTP/1.1" 200') for x in logs]
    assert all(g > 0 for g in gens), gens  # both servers served
    assert sum(gens) == 2 * 8 * 8 + 2 * 16, gens  # 2 steps × 8 prompts × 8, two evaluations
    for x in logs:  # the initial weights and each step's, on every server
        assert x.count('"POST /update_weights_from_distributed HTTP/1.1" 200') >= 3
    assert (reap / "router" / "sglang" / "router.log").exists()
    assert [x["step"] for x in m] == [1, 2]


def test_the_moe_recipe_served_by_sglang(moe_base, reap):
    """The tiny Qwen3-MoE recipe (EP=2) with an fp32 SGLang server, routing replay off (a CPU
    server cannot return routed experts)."""
    m, _ = _train(moe_base, reap, "moe", "rollout.routing_replay=off", nproc=2, steps=2,
                  recipe="tiny_moe_cpu.yaml")  # fmt: skip
    assert [x["step"] for x in m] == [1, 2]
    assert m[0]["abs_logprob_diff"] <= 1e-4, m[0]["abs_logprob_diff"]
