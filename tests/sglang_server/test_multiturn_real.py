"""Multi-turn rollouts against one real SGLang 0.5.23 server on CPU (issue 53): token in, token
out through ``/generate`` with ``input_ids``; the prefix invariant over every turn; on policy
(fp32 server, no push) the trainer's ℓθ equals the server's ℓb and no gradient reaches an
environment token; a weight push inside turn 2 versions each token and keeps turn 1's ℓb.

The served model is a tiny Llama over the tool task's BPE tokenizer with random weights (so its
turns are arbitrary token sequences, often not the canonical encoding of their text), its
output rows sharpened and the end-of-turn row zeroed (a turn runs its whole budget: a push can
land inside it).
"""

import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from megatron_p3o.rollout.sglang import SGLangConfig, build_fleet
from megatron_p3o.rollout.trajectory import ENV_VERSION
from megatron_p3o.runtime.parallel import Layout
from megatron_p3o.runtime.ports import free_port

from ..distributed import multiturn_bodies as mb
from .conftest import kill_launched, log_tail
from .test_engine_real import _hf_logprobs

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]


@pytest.fixture(scope="module")
def served_tool(pools, tmp_path_factory):
    """(fleet, Megatron checkpoint dir): the tool-tokenizer model served in fp32."""
    from megatron_p3o.data.tasks import tool_calc

    d = tmp_path_factory.mktemp("served_tool")
    tool_calc.make_tokenizer(d / "tok", tool_calc.splits(2000, 10)[0])
    ckpt = d / "ckpt"
    pools(1).run(mb.tool_model, Layout(), tok_dir=str(d / "tok"), out=str(ckpt), peaked=True)
    sg = SGLangConfig(model_path=str(ckpt / "hf"), dtype="float32", port=free_port(),
                      startup_timeout_s=300, max_restarts=0)  # fmt: skip
    fleet = build_fleet(sg, [], d / "logs", "tensor")
    try:
        fleet.start()
        # the trainer's first push: a launched server answers with version "default" until one
        fleet.update_weights(
            iter([sorted(load_file(str(ckpt / "hf/model.safetensors")).items())]), 0
        )
        yield fleet, str(ckpt)
    except BaseException:
        print(log_tail(d / "logs"))
        raise
    finally:
        fleet.stop()
        kill_launched(d / "logs")


def test_sglang_multiturn_token_in_token_out_and_on_policy(served_tool, pools):
    """One /generate per trajectory turn, concurrently (the server batches them), tools of
    random latency, and two pushes of the same weights as new versions while trajectories are
    out (some in a tool call, some mid-turn): 0 prefix violations over 51 episodes × 3 turns,
    per-token versions in sampling order, and on policy afterwards."""
    from transformers import AutoTokenizer

    from tests.turn_recording import prefix_violations, record_turns

    fleet, ckpt = served_tool
    base = sorted(load_file(f"{ckpt}/hf/model.safetensors").items())
    fleet.update_weights(iter([base]), 1)
    calls = record_turns(fleet)
    real, asked, pushers = fleet.generate_turn, [0], []
    lock = threading.Lock()

    def generate_turn(ids, sampling, key=None):  # a push after the 40th and the 100th turn
        with lock:
            asked[0] += 1
            v = {40: 2, 100: 3}.get(asked[0])
        if v is not None:
            pushers.append(threading.Thread(target=fleet.update_weights, args=(iter([base]), v)))
            pushers[-1].start()
        return real(ids, sampling, key)

    fleet.generate_turn = generate_turn
    fleet.workers[0]._request("POST", "/slow_down", {"forward_sleep_time": 0.02})
    try:
        samples = mb.rollout(fleet, f"{ckpt}/hf", n_prompts=17, n=3, turns=3,
                             env="RandomLatency", env_args={"turns": 3, "hi": 0.4})  # fmt: skip
    finally:
        fleet.workers[0]._request("POST", "/slow_down", {"forward_sleep_time": None})
        for t in pushers:
            t.join(timeout=120)
        del fleet.turn_server, fleet.generate_turn  # the wrappers (instance attributes)
    inv = prefix_violations(samples, calls)
    assert inv["episodes"] >= 50 and inv["turns"] >= 150 and inv["violations"] == 0, inv
    assert mb.retokenized(samples, AutoTokenizer.from_pretrained(f"{ckpt}/hf")) >= 1
    assert all(s.meta["turns"] == 3 for s in samples)
    spans = [s.policy_versions() for s in samples]
    assert all(v == sorted(v) for v in spans) and {x for v in spans for x in v} == {1, 2, 3}
    assert any(len(set(v)) > 1 for v in spans)  # trajectories out while a push landed
    res = pools(1).run(mb.on_policy_step, Layout(), ckpt=ckpt, samples=samples)[0]
    assert res["max_lp_diff"] < 1e-5, res
    assert abs(res["ess"] - 1.0) < 1e-6, res
    assert res["env_rows"] > 0 and res["env_grad_max"] == 0.0, res


def test_an_agent_through_the_endpoint_trains_on_the_servers_tokens(served_tool, pools):
    """An agent of tests/agents.py (the ``openai`` client, three turns, tool messages) against
    the real server through the endpoint (issue 64): 0 prefix violations over 51 episodes × 3
    turns (ℓb as the server gave them), the tool messages' spans the template's own text, and
    on policy at fp32 (the trainer's ℓθ = ℓb, e_B = 1, no gradient on environment tokens)."""
    from transformers import AutoTokenizer

    from tests.agents import tool_result
    from tests.turn_recording import appended_spans, prefix_violations, record_turns

    fleet, ckpt = served_tool
    fleet.update_weights(iter([sorted(load_file(f"{ckpt}/hf/model.safetensors").items())]), 1)
    calls = record_turns(fleet)
    try:
        samples = mb.agent_rollout(fleet, f"{ckpt}/hf", n_prompts=17, n=3)
    finally:
        del fleet.turn_server
    inv = prefix_violations(samples, calls)
    assert inv["episodes"] >= 50 and inv["turns"] >= 150 and inv["violations"] == 0, inv
    tok = AutoTokenizer.from_pretrained(f"{ckpt}/hf")
    for s in samples:
        assert s.meta["status"] == "completed" and s.meta["segments"] == 1, s.meta
        spans = appended_spans(s)
        assert [tok.decode(x, skip_special_tokens=False) for x in spans] == [
            f"<|end|><|tool|>{tool_result(t)}<|end|><|assistant|>" for t in range(2)
        ]  # the tool task's template (turns run their budget: the whole end of turn)
    res = pools(1).run(mb.on_policy_step, Layout(), ckpt=ckpt, samples=samples)[0]
    assert res["max_lp_diff"] < 1e-5, res
    assert abs(res["ess"] - 1.0) < 1e-6, res
    assert res["env_rows"] > 0 and res["env_grad_max"] == 0.0, res


def test_a_weight_push_inside_turn_2(served_tool, tmp_path):
    """Turn 1 at version 5, the tool's observation, then a push (version 6) lands k tokens into
    turn 2: versions [5]·n₁ + [−1]·obs + [5]·k + [6]·rest; turn 1's ℓb are unchanged from
    what the server reported before the push, and each token's ℓb is under its version."""
    fleet, ckpt = served_tool
    hf = f"{ckpt}/hf"
    base = load_file(f"{hf}/model.safetensors")
    g = torch.Generator().manual_seed(6)
    v6 = sorted((n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in base.items())
    fleet.update_weights(iter([sorted(base.items())]), 5)
    server = fleet.workers[0]
    real, turn1 = fleet.generate_turn, []

    def generate_turn(ids, sampling, key=None):
        if not turn1:
            turn1.append(real(ids, sampling, key))
            return turn1[0]
        pusher = threading.Thread(target=lambda: (time.sleep(1.0),
                                                  fleet.update_weights(iter([v6]), 6)))  # fmt: skip
        server._request("POST", "/slow_down", {"forward_sleep_time": 0.1})
        pusher.start()
        try:
            return real(ids, sampling, key)
        finally:
            pusher.join(timeout=120)
            server._request("POST", "/slow_down", {"forward_sleep_time": None})

    fleet.generate_turn = generate_turn
    try:
        (s,) = mb.rollout(fleet, hf, n_prompts=1, n=1, turns=2, max_new_tokens=30)
    finally:
        del fleet.generate_turn
    n1 = len(turn1[0].completion_ids)
    v = s.token_versions
    obs = v[n1:].index(5) if 5 in v[n1:] else None
    assert v[:n1] == [5] * n1 and obs is not None and set(v[n1 : n1 + obs]) == {ENV_VERSION}
    rest = v[n1 + obs :]
    k = rest.index(6) if 6 in rest else None
    assert k is not None and 0 < k < len(rest) and rest == [5] * k + [6] * (len(rest) - k), v
    assert s.logprobs[:n1] == turn1[0].logprobs  # turn 1 kept what the server reported
    cfg = json.loads(open(f"{hf}/config.json").read())
    lb = torch.tensor(s.logprobs, dtype=torch.float64)
    a = n1 + obs
    old = _hf_logprobs(cfg, sorted(base.items()), s.prompt_ids + s.completion_ids[:a],
                       s.completion_ids[a:])  # fmt: skip
    new = _hf_logprobs(cfg, v6, s.prompt_ids + s.completion_ids[:a], s.completion_ids[a:])
    assert torch.allclose(lb[a : a + k], old[:k], atol=1e-4)
    assert torch.allclose(lb[a + k :], new[k:], atol=1e-4)


def test_an_aborted_request_ends_its_trajectory_aborted(served_tool):
    """The real server's abort (``/abort_request``, every request in flight) reaches the loop as
    the abort status, not an exception from the client: both trajectories, each inside its
    first turn (a turn runs its whole 30-token budget at 0.2 s a forward), end ``aborted``, and a
    rollout with every trajectory aborted is one error naming the environment and the reason."""
    from megatron_p3o.rollout.turns import AllAborted

    fleet, ckpt = served_tool
    server = fleet.workers[0]
    server._request("POST", "/slow_down", {"forward_sleep_time": 0.2})
    abort = threading.Timer(
        3.0, lambda: server._request("POST", "/abort_request", {"abort_all": True})
    )
    abort.start()
    try:
        with pytest.raises(AllAborted, match="the engine aborted the request") as e:
            mb.rollout(fleet, f"{ckpt}/hf", n_prompts=2, n=1, turns=2, max_new_tokens=30)
        assert "tests.envs:EchoEnv" in str(e.value) and "2 of 2 trajectories" in str(e.value)
    finally:
        abort.join()
        server._request("POST", "/slow_down", {"forward_sleep_time": None})
